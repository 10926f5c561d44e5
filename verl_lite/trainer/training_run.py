"""A training run's files around ``PPOTrainer.run_loop``, for the CLI and the Python API's ``fit()``:
``config.json``, the ``trainer.logger`` trackers (``metrics.jsonl`` always), ``curves.png`` and
``summary.json`` (``status``: completed | failed | interrupted; ``startup_s``) in a fresh run directory."""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from verl_lite.config import config_to_dict
from verl_lite.errors import RunFailure, RunInterrupted
from verl_lite.trainer.metrics import plot_curves
from verl_lite.trainer.run_dir import make_run_dir
from verl_lite.trainer.signal_watch import ZeroSignalWatch
from verl_lite.trainer.stop_signals import SIGNALS
from verl_lite.trainer.tracking import Tracking


def _warn(message: str) -> None:
    print(f"verl_lite: warning: {message}", file=sys.stderr, flush=True)


def _seconds_since_process_start() -> float:
    """Wall seconds since this process started, to a clock tick: on Linux from /proc (start tick vs uptime);
    psutil's ``create_time`` adds the boot time, which /proc/stat rounds to a whole second."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime_s = float(f.read().split()[0])
        return uptime_s - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        import psutil

        return time.time() - psutil.Process().create_time()


def _why_no_validation(cfg, trainer) -> str:
    if getattr(trainer, "val_dataset", None) is None:
        return "no validation set: data.val_files is empty"
    if cfg.trainer.test_freq <= 0 and not cfg.trainer.val_before_train:
        return "trainer.test_freq <= 0 and trainer.val_before_train=false"
    return "the run stopped before its first validation"


def accuracy_line(summary: dict) -> str:
    """The held-out accuracy of the summary in words: first and last validated steps, or why none ran."""
    a0, a1, s0, s1 = (summary.get(k) for k in ("initial_val_accuracy", "final_val_accuracy", "initial_val_step",
                                                "final_val_step"))
    if a0 is None:
        return f"no validation ({summary.get('no_validation') or 'none ran'})"
    if s0 == s1:
        return f"held-out accuracy {a1:.3f} (validated once, at step {s1})"
    return (f"held-out accuracy {a0:.3f} (first validated step {s0}) -> {a1:.3f} (last validated step {s1}), "
            f"{100 * (a1 - a0):+.1f} points")


PLOT_TIMEOUT_S = 60.0  # the longest the run's end waits for curves.png


def _in_background(target, name: str) -> threading.Thread:
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread


def _import_plotting_in_background(trainer, wait_s: float = 60.0) -> threading.Thread:
    """matplotlib's import in a daemon thread while the driver waits for its workers, so drawing curves.png at
    the end takes only the drawing. It waits until the workers are being created (``trainer.actor`` is set):
    beside ``ray.init`` or the actors' creation it delayed the first step (docs/performance.md)."""

    def load():
        deadline = time.monotonic() + wait_s
        while getattr(trainer, "actor", None) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        try:
            for module in ("matplotlib.figure", "matplotlib.backends.backend_agg"):
                importlib.import_module(module)
        except Exception:  # the drawing reports it, where it matters
            pass

    return _in_background(load, "verl-lite-plot-import")


def _draw_in_background(records: list[dict], path: Path) -> threading.Thread:
    """``plot_curves`` in a daemon thread, overlapping the workers' shutdown; a failure is a warning: a plot
    never hides the run's own result or error."""
    def draw():
        try:
            plot_curves(records, path)
        except Exception as e:
            _warn(f"could not draw {path}: {type(e).__name__}: {e}")

    return _in_background(draw, "verl-lite-curves")


def train_in_run_dir(trainer, on_step=None) -> dict:
    """What the CLI does after the config is loaded, for a built ``PPOTrainer`` (also the Python API's
    ``fit()``): train (``start`` + ``run_loop``) writing the run's files into a fresh run directory
    (``trainer.run_dir``, set before anything starts). Returns the summary."""
    cfg = trainer.cfg
    out = trainer.run_dir = make_run_dir(cfg.trainer.output_dir, cfg.trainer.experiment_name)
    (out / "config.json").write_text(json.dumps(config_to_dict(cfg), indent=1, default=str))

    # trainer.logger backends; metrics.jsonl always (the summary points at it)
    tracking = Tracking(cfg, out, trainer.total_steps(), config_dict=config_to_dict(cfg), always_jsonl=True)
    records: list[dict] = []
    watch = ZeroSignalWatch()

    def log_step(record: dict) -> None:
        records.append(record)
        if on_step is not None:
            on_step(record)
        with SIGNALS.deferred():
            try:
                tracking.log(record)
            except OSError as e:
                raise RunFailure(f"writing {tracking.metrics_path} failed at step {record.get('step')} ({e.strerror or e})",
                                 "free disk space or set trainer.output_dir to a disk with room") from None
        warning = watch.update(record)
        if warning:
            _warn(warning)

    summary = {"status": "failed", "steps": 0, "startup_s": None}
    _import_plotting_in_background(trainer)
    try:
        trainer.start()  # Ray + workers + engines (fit() finds them started)
        summary["startup_s"] = round(_seconds_since_process_start(), 2)
        trainer.run_loop(on_step=log_step)
        summary["status"] = "completed"
    except BaseException as err:
        stop = SIGNALS.interruption(err)  # a signal inside ray.wait surfaces as a SystemError
        if not isinstance(stop, RunInterrupted):
            raise
        summary["status"] = f"interrupted ({signal.Signals(stop.signum).name})"
        if stop is err:
            raise
        raise stop from err
    finally:
        plot = _draw_in_background(records, out / "curves.png") if records else None  # while the workers stop
        trainer.close()
        with contextlib.suppress(OSError):
            tracking.close()
        if plot is not None:
            plot.join(PLOT_TIMEOUT_S)
        vals = [(r["step"], r["val/accuracy"]) for r in records if r.get("val/accuracy") is not None]
        (first_step, first), (last_step, last) = (vals[0], vals[-1]) if vals else ((None, None), (None, None))
        summary.update({
            "val_steps": [step for step, _ in vals],
            "no_validation": None if vals else _why_no_validation(cfg, trainer),
            "steps": trainer.global_step,
            "initial_val_accuracy": first,
            "initial_val_step": first_step,
            "final_val_accuracy": last,
            "final_val_step": last_step,
            "total_time_s": sum(r.get("timing_s/step", 0.0) + r.get("timing_s/validate", 0.0) for r in records),
            "run_dir": str(out),
            "metrics": str(out / "metrics.jsonl"),
            "curve": str(out / "curves.png"),
        })
        try:
            (out / "summary.json").write_text(json.dumps(summary, indent=1))
        except OSError as e:
            if summary["status"] == "completed":
                raise RunFailure(f"writing {out / 'summary.json'} failed ({e.strerror or e})",
                                 "free disk space or set trainer.output_dir to a disk with room") from None
    return summary
