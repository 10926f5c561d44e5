"""Run GRPO from your own Python code, with your own reward function.

    python examples/python_api.py

The reward follows verl's signature (one call per sample); here it grades the built-in
addition task but also gives partial credit for each correct trailing digit, a shaped reward
you would not want to put in a file. Any config key can be overridden as on the command line.
"""

from verl_lite.config import load_config
from verl_lite.trainer.ppo_trainer import PPOTrainer


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    answer, truth = solution_str.strip(), str(ground_truth).strip()
    if answer == truth:
        return 1.0
    same_tail = 0
    for a, b in zip(reversed(answer), reversed(truth)):
        if a != b:
            break
        same_tail += 1
    return 0.5 * same_tail / max(1, len(truth))


def main():
    cfg = load_config(["trainer.total_training_steps=20", "trainer.test_freq=10",
                       "trainer.output_dir=outputs/python_api"])
    trainer = PPOTrainer(cfg, reward_fn=compute_score)  # validates the config; starts nothing yet
    history = trainer.fit(on_step=lambda m: print(
        f"step {m['step']:3d}  reward {m.get('reward/mean', float('nan')):.3f}  "
        f"val acc {m.get('val/accuracy', float('nan')):.3f}"))
    print("held-out accuracy:", [round(m["val/accuracy"], 3) for m in history if "val/accuracy" in m])


if __name__ == "__main__":
    main()
