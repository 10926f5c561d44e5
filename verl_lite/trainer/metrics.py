"""Step metrics: timing, masked statistics for logging, and the metrics.jsonl / curve writers.

Only logging statistics live here (means and maxima of tensors that already exist); the RL math
is in ``verl_lite.algorithms``.
"""

from __future__ import annotations

import json
import math
import time
from contextlib import contextmanager
from pathlib import Path

import torch


@contextmanager
def timer(metrics: dict, name: str):
    """Adds ``timing_s/<name>`` (wall seconds) to ``metrics``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        metrics[f"timing_s/{name}"] = metrics.get(f"timing_s/{name}", 0.0) + time.perf_counter() - start


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    m = mask != 0
    return float(x[m].double().mean()) if m.any() else float("nan")


def masked_abs_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """(mean, max) of |a - b| over valid tokens."""
    m = mask != 0
    if not m.any():
        return float("nan"), float("nan")
    d = (a.double() - b.double()).abs()[m]
    return float(d.mean()), float(d.max())


def stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    v = values.double()
    return {f"{prefix}/mean": float(v.mean()), f"{prefix}/max": float(v.max()), f"{prefix}/min": float(v.min())}


def sum_dicts(dicts: list[dict]) -> dict[str, float]:
    out: dict[str, float] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0.0) + float(v)
    return out


def mean_dicts(dicts: list[dict]) -> dict[str, float]:
    total = sum_dicts(dicts)
    return {k: v / len(dicts) for k, v in total.items()} if dicts else {}


class JsonlWriter:
    """One JSON object per line (non-finite floats written as null)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "w")

    def write(self, record: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def plot_curves(records: list[dict], path: str | Path) -> Path:
    """Training reward and held-out accuracy against the step (matplotlib, Agg backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    train = [(r["step"], r["reward/mean"]) for r in records if r.get("reward/mean") is not None]
    val = [(r["step"], r["val/accuracy"]) for r in records if r.get("val/accuracy") is not None]
    if train:
        ax.plot(*zip(*train), label="train reward (mean)", color="tab:blue")
    if val:
        ax.plot(*zip(*val), "o-", label="held-out accuracy (greedy)", color="tab:orange")
    ax.set_xlabel("RL step")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
