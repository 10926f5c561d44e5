"""Step metrics: timing, logging statistics of tensors that already exist (the RL math is in
``verl_lite.algorithms``), and the metrics.jsonl / curve writers."""

from __future__ import annotations

import json
import math
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from verl_lite.utils.metric_reduce import combine_all, reduction


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


def stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    v = values.double()
    return {f"{prefix}/mean": float(v.mean()), f"{prefix}/max": float(v.max()), f"{prefix}/min": float(v.min())}


def mean_dicts(dicts: list[dict]) -> dict[str, float]:
    """The mean over optimizer steps of each summed metric; ``*_max`` / ``*_min`` over all of them."""
    total = combine_all(dicts)
    return {k: v if reduction(k) != "sum" else v / len(dicts) for k, v in total.items()} if dicts else {}


def merge_owner_steps(owners: list[list[dict]]) -> list[dict]:
    """Owners' results ``[dp][step]`` -> one dict per optimizer step: loss metrics summed over the
    DP owners (each is that rank's share of the mini-batch value), grad norm, lr and the MoE
    router-loss metrics (``router_*``: the engine reduces them over the whole role) from DP rank 0
    (the same on every rank)."""
    merged = []
    for step in range(len(owners[0])):
        per_dp = [owners[d][step] for d in range(len(owners))]
        same = [k for k in per_dp[0] if k in ("grad_norm", "lr") or k.startswith("router_")]
        loss_metrics = combine_all([{k: v for k, v in r.items() if k not in same} for r in per_dp])
        merged.append({**loss_metrics, **{k: per_dp[0][k] for k in same}})
    return merged


class JsonlWriter:
    """One JSON object per line (non-finite floats written as null)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "w")

    def log(self, record: dict) -> None:
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self._file.write(json.dumps(clean) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


REWARD_PANEL = (  # (metric, label, line style, color) of the first panel; all lie in [0, 1]
    ("reward/mean", "train reward (mean)", "-", "tab:blue"),
    ("val/accuracy", "held-out accuracy (greedy)", "o-", "tab:orange"),
    ("agent/tool_call_rate", "train tool-call rate (multi-turn)", "--", "tab:purple"),
    ("val/tool_call_rate", "held-out tool-call rate", "s--", "tab:brown"),
)


def _series(records: list[dict], key: str) -> list[tuple]:
    """(step, value) of every record holding a number under ``key``."""
    return [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]


def reward_panel_lines(records: list[dict]) -> list[tuple[str, list, str, str]]:
    """(label, [(step, value)], style, color) of every REWARD_PANEL metric the records hold."""
    lines = [(label, _series(records, key), style, color) for key, label, style, color in REWARD_PANEL]
    return [line for line in lines if line[1]]


def plot_curves(records: list[dict], path: str | Path) -> Path:
    """Training reward and held-out accuracy against the step, with the tool-call rates of multi-turn runs
    beside them; with a critic, a second panel shows the value loss and the explained variance.
    matplotlib's object API (no pyplot state, no backend switch): safe in any thread, and the caller's
    own matplotlib settings are left alone."""
    from matplotlib.figure import Figure

    critic = _series(records, "critic/vf_loss")
    fig = Figure(figsize=(12 if critic else 7, 4))
    axes = fig.subplots(1, 2 if critic else 1, squeeze=False)
    ax = axes[0][0]
    for label, points, style, color in reward_panel_lines(records):
        ax.plot(*zip(*points), style, label=label, color=color)
    ax.set_xlabel("RL step")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    if critic:
        ax = axes[0][1]
        ax.plot(*zip(*critic), label="critic value loss", color="tab:red")
        explained = _series(records, "critic/explained_variance")
        if explained:
            ax.plot(*zip(*explained), label="explained variance", color="tab:green")
        ax.set_xlabel("RL step")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    return path
