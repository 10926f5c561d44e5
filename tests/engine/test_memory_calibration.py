"""The memory estimate (engine/memory.py) within 15% of the measured peak on two points of bench/memory_grid.py's
calibration grid (the bench runs the whole grid; docs/memory.md's Calibration section has its table).

Each point is measured as the bench measures it: a fresh process per rank, the resident set's growth from right
before the engine is built to its high-water mark over two train steps, with glibc's allocations of 1 MiB or more
mapped on their own (the resident set follows what is allocated). The points: full fine-tuning of the
compute-bound model in fp32 on one process, and in bf16 on two DP ranks with the distributed optimizer (whose
gradient reduce-scatter, on gloo, copies the whole fp32 gradient buffer)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "memory_grid.py"
POINTS = ("wide-full-fp32-s", "wide-full-bf16-dp2-distopt")


def _bench():
    spec = importlib.util.spec_from_file_location("memory_grid", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("memory_grid", module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    return _bench(), str(tmp_path_factory.mktemp("calibration"))


@pytest.mark.parametrize("name", POINTS)
def test_the_estimate_is_within_15_percent_of_the_measured_peak(grid, name):
    bench, tmp = grid
    point = next(p for p in bench.GRID if p.name == name)
    row = bench.run_point(point, bench.model_dir_for(point, tmp))
    # the counted state is what grew, not the runtime's few tens of MB
    assert row["growth"] > 500e6, bench.format_row(row)
    assert abs(row["ratio"] - 1) <= bench.TOLERANCE, bench.format_row(row)
