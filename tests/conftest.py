"""How the suite shares two cores between two pytest processes when run with pytest-xdist
(``pytest -n 2 --dist loadgroup tests --ignore=tests/multinode``; ``make test`` runs one process:
README, "Tests", has the measured times of both).

Most tests launch the CLI or a Ray job and spend about half their wall time waiting (Ray's start-up
and shutdown, a reward's timeout, a signal's delay), so two of them side by side roughly halve it.
A few modules keep both cores busy computing in several ranks; two of those side by side gain
nothing and stretch their collective timeouts. So:

- every module is one scheduling unit (its module- and session-scoped fixtures are built once);
- the compute-bound modules (``COMPUTE_BOUND``) form a single unit, so at most one of them runs at a
  time, beside a waiting-bound one; the parity modules share their rank pools in it too;
- ``tests/multinode`` is left out of such a run: its local clusters run after, in a pytest of their
  own (``make test``), since their node-loss bounds are measured against a quiet machine.

Without xdist (plain ``pytest tests``) the markers are inert and everything runs in one process.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
COMPUTE_BOUND = (
    "parity/",
    "engine/test_real_model_configs.py",
    "engine/test_model_distributed.py",
    "engine/test_moe_checkpoint.py",
    "engine/test_bf16_engine.py",
    "engine/test_lora.py",
    "checkpoint/test_export.py",
    "checkpoint/test_engine_reshard.py",
)
COMPUTE_GROUP = "compute-bound"


def scheduling_group(relative_path: str) -> str:
    """The xdist group of a test module, given its path relative to ``tests/``."""
    return COMPUTE_GROUP if relative_path.startswith(COMPUTE_BOUND) else relative_path


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    for item in items:
        path = Path(str(item.fspath)).resolve()
        if HERE in path.parents:
            item.add_marker(pytest.mark.xdist_group(scheduling_group(path.relative_to(HERE).as_posix())))


@pytest.hookimpl(trylast=True)  # after xdist's hook: the groups must be in the test ids the scheduler reads
def pytest_collection_finish(session):
    """A worker of ``--dist loadgroup`` whose test ids carry no group stops the run: the scheduler
    would then spread every module over both processes (pytest-xdist 3.8 writes the group into
    ``item._nodeid``, which pytest 9 no longer reads; ``pyproject.toml`` pins pytest below 9)."""
    if not getattr(session.config.option, "loadgroup", False) or not session.items:
        return
    ungrouped = [item.nodeid for item in session.items if "@" not in item.nodeid]
    if ungrouped:
        raise pytest.UsageError(
            f"--dist loadgroup: {len(ungrouped)} test ids carry no xdist group (first: {ungrouped[0]}); "
            f"pytest {pytest.__version__} with this pytest-xdist does not apply groups")
