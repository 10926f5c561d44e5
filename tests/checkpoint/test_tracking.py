"""trainer.logger=[console,jsonl,tensorboard,wandb] with WANDB_MODE=offline writes all four: the
TensorBoard event file holds exactly the scalars of metrics.jsonl, W&B an offline run, and the
console (no TTY) one line every trainer.log_freq steps with step/total and a time estimate."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest


def _run_dir(straight_run) -> Path:
    dirs = [p.parent for p in (straight_run["root"] / "out").glob("*/metrics.jsonl") if not p.parent.is_symlink()]
    assert len(dirs) == 1
    return dirs[0]


def test_tensorboard_holds_the_jsonl_scalars(straight_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir = _run_dir(straight_run)
    events = list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert events, "no TensorBoard event file"
    acc = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0})
    acc.Reload()
    tb = {(tag, e.step): e.value for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)}
    expected = {}
    for row in straight_run["metrics"]:
        for k, v in row.items():
            if k != "step" and (isinstance(v, (int, float)) or v is None) and not isinstance(v, bool):
                expected[(k, row["step"])] = v
    assert set(tb) == set(expected)
    for key, v in expected.items():
        if v is None:  # non-finite in JSON
            assert not math.isfinite(tb[key]), key
        else:
            assert tb[key] == pytest.approx(v, rel=1e-6, abs=1e-7), key  # TB stores float32


def test_wandb_offline_run_written(straight_run):
    run_dir = _run_dir(straight_run)
    offline = list((run_dir / "wandb").glob("offline-run-*"))
    assert offline, f"no offline W&B run under {run_dir / 'wandb'}"
    assert list(offline[0].glob("run-*.wandb")), "the offline run holds no .wandb data file"
    summary = offline[0] / "files" / "wandb-summary.json"
    if summary.is_file():  # written at finish
        last = straight_run["metrics"][-1]
        data = json.loads(summary.read_text())
        assert data["reward/mean"] == pytest.approx(last["reward/mean"])
    config = json.loads((run_dir / "config.json").read_text())
    assert config["trainer"]["project_name"] and config["trainer"]["experiment_name"]


def test_console_without_tty_prints_every_log_freq(straight_run):
    lines = [ln for ln in straight_run["log"].splitlines() if " step " in ln and "/4 (" in ln]
    steps = [int(ln.split(" step ", 1)[1].split("/", 1)[0]) for ln in lines]
    assert steps == [2, 4], lines  # log_freq=2 over 4 steps
    assert all("eta " in ln and "elapsed " in ln and "reward " in ln for ln in lines)


def test_console_logger_eta_and_tty_switch():
    from omegaconf import OmegaConf

    from verl_lite.trainer.tracking import ConsoleLogger, EtaClock, Tracking

    clock = EtaClock(total_steps=10)
    assert clock.update(3, now=100.0) == (0.0, None)  # resumed at step 3: no estimate yet
    elapsed, remaining = clock.update(5, now=110.0)  # 2 steps in 10 s -> 5 s/step x 5 left
    assert elapsed == 10.0 and remaining == pytest.approx(25.0)

    buf = io.StringIO()
    console = ConsoleLogger(total_steps=6, title="exp", log_freq=3, stream=buf, tty=False)
    for step in range(1, 7):
        console.log({"step": step, "reward/mean": 0.5})
    assert [ln.split(" step ")[1].split(" ")[0] for ln in buf.getvalue().splitlines()] == ["3/6", "6/6"]

    cfg = OmegaConf.create({"trainer": {"logger": ["console", "mlflow"], "log_freq": 1, "project_name": "p",
                                        "experiment_name": "e"}})
    with pytest.raises(ValueError, match="mlflow"):
        Tracking(cfg, None, 3)
