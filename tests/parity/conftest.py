"""Prints, at the end of a parity run, the worst error and the time of each layout launch."""


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
