"""Console progress for the main job: a rich progress bar with the latest step's key numbers."""

from __future__ import annotations

import math

SHOWN = (
    ("reward/mean", "reward"),
    ("val/accuracy", "val acc"),
    ("actor/pg_loss", "pg loss"),
    ("actor/entropy", "entropy"),
    ("actor/grad_norm", "grad norm"),
    ("timing_s/step", "s/step"),
)


def _fmt(v) -> str:
    return "-" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{v:.3f}"


class ProgressDisplay:
    """``with ProgressDisplay(total_steps) as d: d.update(record)``; falls back to plain lines off a TTY."""

    def __init__(self, total_steps: int, title: str = "verl_lite"):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.console = Console()
        self.progress = Progress(
            TextColumn(f"[bold]{title}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"), console=self.console, transient=False,
        )
        self.task = self.progress.add_task("train", total=total_steps, info="starting workers...")
        self.last_val = None

    def __enter__(self):
        self.progress.start()
        return self

    def __exit__(self, *exc):
        self.progress.stop()

    def update(self, record: dict) -> None:
        if record.get("val/accuracy") is not None:
            self.last_val = record["val/accuracy"]
        values = dict(record, **{"val/accuracy": self.last_val})
        info = "  ".join(f"{label} {_fmt(values.get(key))}" for key, label in SHOWN)
        step = record.get("step", 0)
        self.progress.update(self.task, completed=step, info=info)
        if step == 0 or record.get("val/accuracy") is not None:
            self.progress.console.log(f"step {step}: {info}")
