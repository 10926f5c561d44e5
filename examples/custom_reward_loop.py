"""A custom reward loop: one async function over the WHOLE batch that reads the prompt.

    python examples/custom_reward_loop.py [output_dir]

Your own reward loop is a single batched callable: it receives every sample of the step at
once (``prompts``, ``completions``, ``ground_truth`` and the rows' extra fields as keyword
lists) and returns one score per sample. It may be ``async``: here each sample is "judged"
concurrently, as you would call a remote verifier or an LLM judge, and the judge recomputes the
answer from the prompt itself instead of trusting the dataset's ground truth. The data is a
plain list of dicts (an HF ``datasets.Dataset`` works the same way).
"""

import asyncio
import random
import re
import sys

from verl_lite.config import load_config
from verl_lite.trainer.ppo_trainer import PPOTrainer


def make_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        rows.append({"prompt": [{"role": "user", "content": f"{a}+{b}="}], "ground_truth": str(a + b),
                     "data_source": "synthetic/addition"})
    return rows


async def judge_one(prompt: str, completion: str) -> float:
    await asyncio.sleep(0.001)  # stands in for a network call
    a, b = map(int, re.findall(r"(\d+)\+(\d+)=", prompt)[-1])
    return 1.0 if completion.strip() == str(a + b) else 0.0


async def judge(prompts, completions, **kwargs):
    return await asyncio.gather(*(judge_one(p, c) for p, c in zip(prompts, completions)))


def main(output_dir: str = "outputs/custom_reward_loop", steps: int = 10):
    cfg = load_config([f"trainer.total_training_steps={steps}", "trainer.test_freq=5",
                       f"trainer.output_dir={output_dir}"])
    trainer = PPOTrainer(cfg, reward_funcs=judge, train_dataset=make_rows(256, seed=0),
                         val_dataset=make_rows(64, seed=1))
    history = trainer.fit()
    print("held-out accuracy:", [round(m["val/accuracy"], 3) for m in history if "val/accuracy" in m])
    print("run directory:", trainer.run_dir)
    return trainer, history


if __name__ == "__main__":
    main(*sys.argv[1:2])
