"""Bring your own task, TRL-style: reverse a string of digits (digits: what the shipped tiny model
and its character tokenizer know). The rows, the rewards and the hooks are all here.

    python examples/own_task.py [output_dir]

- Rows as TRL takes them: a ``prompt`` (chat messages here; a plain string works too and is
  tokenized as it is) and a free-form ``answer`` column. No ``data_source``, no
  ``reward_model.ground_truth``: every column other than the prompt reaches the reward functions
  as a keyword argument of its own name.
- Two reward functions read ``answer`` by name: exact match, and partial credit per character in
  place. ``SEEN`` keeps what they were given, so you (and the test) can check it.
- ``callbacks=``: plain objects with any of ``on_step_end`` / ``on_evaluate`` / ``on_save`` /
  ``on_log`` (transformers' names), called with the keyword arguments they name.
- ``generation_kwargs``: passed to the rollout backend (here HF's: a repetition penalty and a
  stop string); what the backend cannot do is refused before anything starts.
- ``log_completions=True``: every logging step's prompts, completions and rewards go to the
  trackers (a TensorBoard text here, a W&B table with ``trainer.logger`` wandb).
"""

import random
import string
import sys

from verl_lite.config import load_config
from verl_lite.trainer.ppo_trainer import PPOTrainer

SEEN: list[dict] = []  # per reward call: the prompts, completions and answers the function received


def make_rows(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        word = "".join(rng.choice(string.digits) for _ in range(rng.randint(3, 5)))
        rows.append({"prompt": [{"role": "user", "content": f"reverse {word}"}], "answer": word[::-1]})
    return rows


def exact_reversal(prompts, completions, answer, **kwargs):
    SEEN.append({"function": "exact_reversal", "prompts": list(prompts), "completions": list(completions),
                 "answer": list(answer)})
    return [1.0 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]


def chars_in_place(completions, answer, **kwargs):
    SEEN.append({"function": "chars_in_place", "answer": list(answer)})
    return [sum(x == y for x, y in zip(c.strip(), a)) / len(a) for c, a in zip(completions, answer)]


class StepPrinter:
    """A callback: prints each step and keeps the events it saw (event, step)."""

    def __init__(self):
        self.events: list[tuple[str, int]] = []

    def on_step_end(self, step, metrics):
        self.events.append(("on_step_end", step))
        print(f"step {step}: reward {metrics['reward/mean']:.3f}  exact {metrics['reward/exact_reversal/mean']:.3f}")

    def on_evaluate(self, step, metrics):
        self.events.append(("on_evaluate", step))
        print(f"step {step}: held-out accuracy {metrics['val/accuracy']:.3f}")

    def on_log(self, step, **kwargs):
        self.events.append(("on_log", step))


def main(output_dir: str = "outputs/own_task", steps: int = 20):
    cfg = load_config([f"trainer.total_training_steps={steps}", f"trainer.test_freq={steps}",
                       f"trainer.output_dir={output_dir}", "data.train_batch_size=8",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=8", "actor_rollout_ref.rollout.n=4",
                       "trainer.logger=[console,jsonl,tensorboard]"])
    printer = StepPrinter()
    trainer = PPOTrainer(cfg, reward_funcs=[exact_reversal, chars_in_place], reward_weights=[1.0, 0.5],
                         train_dataset=make_rows(64, seed=0), val_dataset=make_rows(16, seed=1),
                         callbacks=[printer], generation_kwargs={"repetition_penalty": 1.2, "stop": ["\n"]},
                         log_completions=True)
    history = trainer.fit()
    print("run directory:", trainer.run_dir)
    return trainer, history, printer


if __name__ == "__main__":
    main(*sys.argv[1:2])
