"""Runs the parity tests grouped by the world size of their layouts (one process pool per size, see
harness.run_in_pool), closes the last pool, and prints the worst error and time of each layout."""

from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _world(item) -> int:
    """The largest world size among the layouts a test uses: its parameters, and ``parity_layouts`` marks."""
    world_of = getattr(item.module, "layout_world", None)
    if world_of is None:
        return 0
    names = list(getattr(getattr(item, "callspec", None), "params", {}).values())
    for mark in item.iter_markers("parity_layouts"):
        names.extend(mark.args)
    return max((world_of(n) for n in names), default=0)


def pytest_configure(config):
    config.addinivalue_line("markers", "parity_layouts(*names): the parity layouts a test runs (test order)")


def pytest_collection_modifyitems(session, config, items):
    parity = [i for i in items if Path(str(i.fspath)).resolve().parent == HERE]
    if not parity:
        return
    order = {id(i): k for k, i in enumerate(items)}
    parity_ids = {id(i) for i in parity}
    ranked = sorted(parity, key=lambda i: (_world(i), order[id(i)]))  # stable: module order within a size
    it = iter(ranked)
    items[:] = [next(it) if id(i) in parity_ids else i for i in items]


@pytest.fixture(scope="session", autouse=True)
def _close_parity_pool():
    yield
    try:
        import harness
    except ImportError:
        return
    harness.close_pool()


def pytest_terminal_summary(terminalreporter):
    try:
        import harness
    except ImportError:
        return
    lines = harness.summary_lines()
    if lines:
        terminalreporter.section("parity layouts (worst over cells)")
        for line in lines:
            terminalreporter.write_line(line)
        terminalreporter.write_line(f"process pools started (world sizes): {harness.LAUNCHES}")
