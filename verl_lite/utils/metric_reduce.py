"""How per-shard metrics combine into one value: a metric named ``*_max`` is the largest of its shards'
values, ``*_min`` the smallest, and every other one their sum (each shard reports its share of the whole:
a loss contribution, a token mean over the whole mini-batch's N). The engine combines its micro-batches
this way, the controller its DP ranks, and a mean over optimizer steps averages the sums only."""

from __future__ import annotations

import functools
import operator
from typing import Iterable

_COMBINE = {"max": max, "min": min, "sum": operator.add}


def reduction(name: str) -> str:
    """``"max"``, ``"min"`` or ``"sum"`` for the metric ``name``."""
    return "max" if name.endswith("_max") else "min" if name.endswith("_min") else "sum"


def combine(total: dict[str, float], shard: dict[str, float]) -> dict[str, float]:
    """``total`` with ``shard``'s values combined into it (in place; returned)."""
    for name, value in shard.items():
        value = float(value)
        total[name] = _COMBINE[reduction(name)](total[name], value) if name in total else value
    return total


def combine_all(shards: Iterable[dict[str, float]]) -> dict[str, float]:
    return functools.reduce(combine, shards, {})
