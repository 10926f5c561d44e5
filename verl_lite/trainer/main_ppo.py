"""The main job: ``python -m verl_lite.trainer.main_ppo key=value ...`` (Hydra overrides of ppo_trainer.yaml).

Loads and validates the config BEFORE any Ray process or worker starts, trains with a live
progress display, and writes into ``trainer.output_dir``:

- ``metrics.jsonl``: one JSON object per step (rewards, losses, KL, entropy, grad norm,
  validation accuracy, timing per stage); step 0 is the validation before training;
- ``curves.png``: training reward and held-out accuracy against the step;
- ``summary.json``: initial vs final held-out accuracy.

``--recipe FILE.yaml`` (repeatable) applies a YAML file of overrides (nested keys, as in
ppo_trainer.yaml) before the command-line ones, e.g. ``--recipe recipes/gspo_cpu.yaml``.

Also works under ``ray job submit --address ... -- python -m verl_lite.trainer.main_ppo ...``
(Ray is joined through ``RAY_ADDRESS``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from verl_lite.config import ConfigError, config_to_dict, load_config


def run(overrides: list[str]) -> dict:
    """Train with the given overrides; returns the summary dict (raises on any error)."""
    from verl_lite.trainer.display import ProgressDisplay
    from verl_lite.trainer.metrics import JsonlWriter, plot_curves
    from verl_lite.trainer.ppo_trainer import PPOTrainer

    cfg = load_config(overrides)
    trainer = PPOTrainer(cfg)  # validates the config; nothing is started yet
    out = Path(cfg.trainer.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config_to_dict(cfg), indent=1, default=str))
    writer = JsonlWriter(out / "metrics.jsonl")  # always written: the summary reads it
    tensorboard = None
    if "tensorboard" in cfg.trainer.logger:
        from torch.utils.tensorboard import SummaryWriter

        tensorboard = SummaryWriter(str(out / "tensorboard"))
    records: list[dict] = []

    def on_step(record: dict) -> None:
        records.append(record)
        writer.write(record)
        if tensorboard is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    tensorboard.add_scalar(key, value, record["step"])
        if display is not None:
            display.update(record)

    display = None
    try:
        if "console" in cfg.trainer.logger:
            with ProgressDisplay(trainer.total_steps(), title=cfg.trainer.experiment_name) as display:
                trainer.fit(on_step=on_step)
        else:
            trainer.fit(on_step=on_step)
    finally:
        writer.close()
        if tensorboard is not None:
            tensorboard.close()
        if records:
            plot_curves(records, out / "curves.png")
    vals = [(r["step"], r["val/accuracy"]) for r in records if r.get("val/accuracy") is not None]
    summary = {
        "steps": trainer.global_step,
        "initial_val_accuracy": vals[0][1] if vals else None,
        "initial_val_step": vals[0][0] if vals else None,
        "final_val_accuracy": vals[-1][1] if vals else None,
        "final_val_step": vals[-1][0] if vals else None,
        "total_time_s": sum(r.get("timing_s/step", 0.0) + r.get("timing_s/validate", 0.0) for r in records),
        "metrics": str(out / "metrics.jsonl"),
        "curve": str(out / "curves.png"),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def recipe_overrides(path: str) -> list[str]:
    """A YAML file of nested keys -> Hydra ``key=value`` overrides."""
    from omegaconf import OmegaConf

    if not Path(path).is_file():
        raise ConfigError([f"--recipe {path}: no such file"])
    flat: list[str] = []

    def walk(node, prefix):
        for key, value in node.items():
            name = f"{prefix}{key}"
            if isinstance(value, dict) and value and name != "reward.custom_reward_function.reward_kwargs":
                walk(value, name + ".")
            else:
                text = "null" if value is None else json.dumps(value) if isinstance(value, (list, dict)) else str(value)
                flat.append(f"{name}={text}")

    walk(OmegaConf.to_container(OmegaConf.load(path)), "")
    return flat


def expand_recipes(argv: list[str]) -> list[str]:
    """``--recipe FILE`` / ``--recipe=FILE`` arguments -> their overrides, in place."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        if a == "--recipe":
            if i + 1 >= len(argv):
                raise ConfigError(["--recipe needs a file path"])
            out += recipe_overrides(argv[i + 1])
            i += 2
            continue
        if a.startswith("--recipe="):
            out += recipe_overrides(a.split("=", 1)[1])
        else:
            out.append(a)
        i += 1
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        return 0
    from verl_lite.controller import WorkerError
    from verl_lite.reward import RewardError

    try:
        summary = run(expand_recipes(argv))
    except ConfigError as err:
        print(f"verl_lite: {err}", file=sys.stderr)
        return 2
    except (RewardError, WorkerError) as err:
        print(f"verl_lite: the run stopped: {err}", file=sys.stderr)
        return 1
    a0, a1 = summary["initial_val_accuracy"], summary["final_val_accuracy"]
    if a0 is None:
        accuracy = "no validation ran (trainer.test_freq <= 0 and trainer.val_before_train=false)"
    else:
        accuracy = (f"held-out accuracy {a0:.3f} (step {summary['initial_val_step']}) -> "
                    f"{a1:.3f} (step {summary['final_val_step']}), {100 * (a1 - a0):+.1f} points")
    print(f"\nsummary: {summary['steps']} steps; {accuracy}")
    print(f"metrics: {summary['metrics']}\ncurve:   {summary['curve']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
