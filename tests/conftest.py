"""How ``make test`` shares two cores: two phases (docs/testing.md; docs/performance.md has the measured times).

Most tests launch the CLI or a Ray job and spend about half their wall time waiting (Ray's start-up
and shutdown, a worker's import, a reward's timeout, a signal's delay): one such run keeps about one
core busy. Other modules keep both cores busy computing in several ranks (the parity matrices, the
multi-rank engine and end-to-end layouts); beside anything else they gain nothing and stretch their
collective timeouts. So:

- phase 1, ``pytest -n 2 --dist loadgroup -m "not serial"``: the waiting-bound modules, two at a time
  (pytest-xdist); every module is one scheduling unit (its module- and session-scoped fixtures are
  built once, in one process);
- phase 2, ``pytest -m serial``: the compute-bound modules (``SERIAL``, marked ``serial`` here), one
  process, one test at a time; in a ``-n 2`` run of everything they would form one scheduling unit
  together, so at most one of them runs at a time;
- ``tests/multinode`` runs after, in a pytest of its own: its local clusters' node-loss bounds are
  measured against a quiet machine.

Plain ``pytest tests`` runs everything in one process (the markers are then inert).
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
SERIAL = (
    "parity/",
    "engine/",
    "e2e/",
    "checkpoint/test_export.py",
    "checkpoint/test_engine_reshard.py",
)
SERIAL_GROUP = "serial"


def scheduling_group(relative_path: str) -> str:
    """The xdist group of a test module, given its path relative to ``tests/``."""
    return SERIAL_GROUP if relative_path.startswith(SERIAL) else relative_path


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook (it reads the groups into the test ids) and -m
def pytest_collection_modifyitems(config, items):
    for item in items:
        path = Path(str(item.fspath)).resolve()
        if HERE in path.parents:
            group = scheduling_group(path.relative_to(HERE).as_posix())
            item.add_marker(pytest.mark.xdist_group(group))
            if group == SERIAL_GROUP:
                item.add_marker(pytest.mark.serial)


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
