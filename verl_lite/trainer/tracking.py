"""Experiment tracking: the ``trainer.logger`` backends (verl's names) behind one ``Tracking.log(record)``:
``console`` (a live bar on a TTY, else a line every ``trainer.log_freq`` steps, every validation and the last
step), ``jsonl`` (``<run_dir>/metrics.jsonl``, non-finite floats as null), ``tensorboard`` (every numeric key a
scalar at ``record["step"]``), ``wandb`` (``trainer.project_name`` / ``experiment_name`` with the config;
``WANDB_MODE=offline`` needs no network). ``record["completions"]`` (the Python API's ``log_completions``) is the
W&B table / TensorBoard text ``completions`` at that step, kept out of metrics.jsonl and the console.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

from verl_lite.config.schema import LOGGER_BACKENDS
from verl_lite.errors import BadInput
from verl_lite.trainer.metrics import JsonlWriter

# the key numbers of a console line: (metric, label)
SHOWN = (("reward/mean", "reward"), ("val/accuracy", "val acc"), ("actor/pg_loss", "pg loss"),
         ("actor/entropy", "entropy"), ("actor/grad_norm", "grad norm"), ("timing_s/step", "s/step"))


def _fmt(v) -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{v:.3f}"


COMPLETIONS_KEY = "completions"


def completions_markdown(rows: list[dict]) -> str:
    """The rows as a markdown table (TensorBoard renders text summaries as markdown)."""
    columns = list(rows[0]) if rows else []

    def cell(v) -> str:
        text = f"{v:.4g}" if isinstance(v, float) else str(v)
        return text.replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return "\n".join(lines)


def _numeric(record: dict) -> dict[str, float]:
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


def _duration(seconds: float | None) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "-"
    s = int(round(seconds))
    h, rem = divmod(s, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class EtaClock:
    """Time remaining from the steps trained by THIS process, measured from the end of the first one (it carries
    the warm-up); a record that trained no step starts only the elapsed clock."""

    def __init__(self, total_steps: int):
        self.total = total_steps
        self.start_time: float | None = None  # the first record (elapsed)
        self.rate_step: int | None = None  # the end of the first trained step (the estimate's origin)
        self.rate_time: float | None = None
        self.last_step = 0

    def update(self, step: int, now: float | None = None, trained: bool = True) -> tuple[float, float | None]:
        """(elapsed seconds, estimated seconds remaining, or None until a second trained step is measured)."""
        now = time.perf_counter() if now is None else now
        if self.start_time is None:
            self.start_time = now
        self.last_step = max(self.last_step, step)
        if trained and self.rate_time is None:
            self.rate_step, self.rate_time = step, now
        elapsed = now - self.start_time
        done = self.last_step - self.rate_step if self.rate_step is not None else 0
        if done <= 0:
            return elapsed, None
        return elapsed, (now - self.rate_time) / done * max(0, self.total - self.last_step)


class ConsoleLogger:
    """Progress on stderr-like ``stream``: rich bar on a TTY, else a line every ``log_freq`` steps."""

    def __init__(self, total_steps: int, title: str, log_freq: int = 1, stream=None, tty: bool | None = None):
        self.total, self.title, self.log_freq = total_steps, title, max(1, log_freq)
        self.stream = stream if stream is not None else sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self.clock = EtaClock(total_steps)
        self.last_val = None
        self.progress = None
        if self.tty:
            from rich.console import Console
            from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                       TimeRemainingColumn)

            self.progress = Progress(
                TextColumn(f"[bold]{title}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
                console=Console(file=self.stream), transient=False,
            )
            self.task = self.progress.add_task("train", total=total_steps, info="starting workers...")
            self.progress.start()

    def line(self, record: dict) -> str:
        """The plain line for a record: ``title step k/N (p%) | elapsed | eta | key metrics``."""
        step = int(record.get("step", 0))
        elapsed, remaining = self.clock.update(step, trained="timing_s/step" in record)
        values = dict(record, **{"val/accuracy": self.last_val})
        info = "  ".join(f"{label} {_fmt(values.get(key))}" for key, label in SHOWN)
        pct = 100.0 * step / self.total if self.total else 100.0
        return (f"{self.title} step {step}/{self.total} ({pct:.0f}%) | elapsed {_duration(elapsed)} | "
                f"eta {_duration(remaining)} | {info}")

    def log(self, record: dict) -> None:
        if record.get("val/accuracy") is not None:
            self.last_val = record["val/accuracy"]
        step = int(record.get("step", 0))
        text = self.line(record)
        if self.progress is not None:
            info = text.split(" | ", 3)[-1]
            self.progress.update(self.task, completed=step, info=info)
            if step == 0 or record.get("val/accuracy") is not None:
                self.progress.console.log(text)
            return
        if step % self.log_freq == 0 or step >= self.total or record.get("val/accuracy") is not None:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


class TensorBoardLogger:
    def __init__(self, directory: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(directory))

    def log(self, record: dict) -> None:
        step = int(record.get("step", 0))
        for key, value in _numeric(record).items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_completions(self, step: int, rows: list[dict]) -> None:
        self.writer.add_text(COMPLETIONS_KEY, completions_markdown(rows), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbLogger:
    def __init__(self, project: str, name: str, directory: Path, config: dict | None):
        import wandb

        directory.mkdir(parents=True, exist_ok=True)
        self.wandb = wandb
        try:
            self.run = wandb.init(project=project, name=name, dir=str(directory), config=config or {})
        except Exception as e:  # no API key / no network: say what to do instead of a traceback
            raise BadInput(f"trainer.logger=wandb could not start a W&B run ({type(e).__name__}: {e})",
                           "log in with `wandb login`, or set WANDB_MODE=offline (no network needed), or drop "
                           "wandb from trainer.logger") from None

    def log(self, record: dict) -> None:
        self.run.log(_numeric(record), step=int(record.get("step", 0)))

    def log_completions(self, step: int, rows: list[dict]) -> None:
        columns = list(rows[0]) if rows else []
        table = self.wandb.Table(columns=["step", *columns], data=[[step, *(r.get(c) for c in columns)] for r in rows])
        self.run.log({COMPLETIONS_KEY: table}, step=step)

    def close(self) -> None:
        self.run.finish()


class Tracking:
    """Every backend of ``trainer.logger``; ``run_dir`` holds the file backends (None: ``console`` only).
    ``always_jsonl`` writes metrics.jsonl even when ``jsonl`` is not listed (the run's summary points at it)."""

    def __init__(self, cfg, run_dir: str | Path | None, total_steps: int, config_dict: dict | None = None,
                 always_jsonl: bool = False, stream=None, tty: bool | None = None):
        tr = cfg.trainer
        names = list(tr.logger)
        unknown = [n for n in names if n not in LOGGER_BACKENDS]
        if unknown:
            raise ValueError(f"trainer.logger entries {unknown} are unknown; choose from {list(LOGGER_BACKENDS)}")
        file_backends = [n for n in names if n != "console"] + (["jsonl"] if always_jsonl else [])
        if file_backends and run_dir is None:
            raise ValueError(f"trainer.logger={names} writes files but no run directory was given")
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.backends: dict[str, object] = {}
        try:
            if "jsonl" in names or always_jsonl:
                self.backends["jsonl"] = JsonlWriter(self.run_dir / "metrics.jsonl")
            if "tensorboard" in names:
                self.backends["tensorboard"] = TensorBoardLogger(self.run_dir / "tensorboard")
            if "wandb" in names:
                self.backends["wandb"] = WandbLogger(tr.project_name, tr.experiment_name, self.run_dir, config_dict)
            if "console" in names:
                self.backends["console"] = ConsoleLogger(total_steps, tr.experiment_name, tr.log_freq, stream, tty)
        except BaseException:
            self.close()
            raise

    @property
    def metrics_path(self) -> Path | None:
        j = self.backends.get("jsonl")
        return j.path if j is not None else None

    def log(self, record: dict) -> None:
        completions = record.get(COMPLETIONS_KEY)
        if completions is not None:
            record = {k: v for k, v in record.items() if k != COMPLETIONS_KEY}
        for backend in self.backends.values():
            if completions and hasattr(backend, "log_completions"):  # before the step's scalars: W&B steps go up
                backend.log_completions(int(record.get("step", 0)), completions)
            backend.log(record)

    def close(self) -> None:
        errors = []
        for name, backend in list(self.backends.items()):
            try:
                backend.close()
            except Exception as e:  # close every backend; re-raise the first failure after
                errors.append((name, e))
        self.backends = {}
        if errors:
            raise errors[0][1]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

