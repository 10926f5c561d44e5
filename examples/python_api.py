"""Run GRPO from your own Python code with two reward functions, TRL-style.

    python examples/python_api.py [output_dir]

Reward functions are batched and take keyword arguments (any of ``prompts``, ``completions``,
``ground_truth``, ``data_source`` and the row's extra fields); ``reward_weights`` combine them.
Here one grades the built-in addition task exactly, the other gives partial credit for each
correct trailing digit, a shaped reward you would not want to put in a file. Any config key can
be overridden as on the command line; ``fit()`` writes the same run directory as the CLI, and
``save_pretrained`` keeps the trained policy as an HF model directory.
"""

import sys

from verl_lite.config import load_config
from verl_lite.trainer.ppo_trainer import PPOTrainer


def exact(completions, ground_truth, **kwargs):
    return [1.0 if c.strip() == str(g).strip() else 0.0 for c, g in zip(completions, ground_truth)]


def trailing_digits(completions, ground_truth, **kwargs):
    scores = []
    for answer, truth in zip(completions, ground_truth):
        answer, truth = answer.strip(), str(truth).strip()
        same_tail = 0
        for a, b in zip(reversed(answer), reversed(truth)):
            if a != b:
                break
            same_tail += 1
        scores.append(same_tail / max(1, len(truth)))
    return scores


def main(output_dir: str = "outputs/python_api", steps: int = 20):
    cfg = load_config([f"trainer.total_training_steps={steps}", "trainer.test_freq=10",
                       f"trainer.output_dir={output_dir}"])
    trainer = PPOTrainer(cfg, reward_funcs=[exact, trailing_digits], reward_weights=[1.0, 0.5])
    history = trainer.fit(on_step=lambda m: print(
        f"step {m['step']:3d}  reward {m.get('reward/mean', float('nan')):.3f}  "
        f"val acc {m.get('val/accuracy', float('nan')):.3f}"))
    print("held-out accuracy:", [round(m["val/accuracy"], 3) for m in history if "val/accuracy" in m])
    print("run directory:", trainer.run_dir)
    print("trained policy:", trainer.save_pretrained(trainer.run_dir / "policy"))
    return trainer, history


if __name__ == "__main__":
    main(*sys.argv[1:2])
