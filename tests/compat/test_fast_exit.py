"""compat.fast_exit: the CLI ends with main's exit code, after every atexit handler and with its output
flushed, but without the interpreter's teardown (a module-level finaliser never runs)."""

import subprocess
import sys

import pytest

PROGRAM = """
import atexit, sys
from verl_lite.compat.fast_exit import exit_now

class Teardown:  # freed only by the interpreter's teardown, which exit_now skips
    def __del__(self):
        print("teardown ran", flush=True)

keep = Teardown()
atexit.register(lambda: print("atexit ran"))

def main():
    print("buffered output", end="")  # not flushed by main: exit_now must flush it
    {body}

exit_now(main)
"""


@pytest.mark.parametrize("body, code, stderr", [
    ("return 3", 3, ""),
    ("return None", 0, ""),
    ("raise SystemExit(130)", 130, ""),
    ("raise SystemExit('one clear line')", 1, "one clear line"),
])
def test_exit_code_atexit_and_flushed_output_without_teardown(body, code, stderr):
    proc = subprocess.run([sys.executable, "-c", PROGRAM.format(body=body)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == code, proc.stderr
    assert proc.stdout.startswith("buffered output")
    assert "atexit ran" in proc.stdout
    assert "teardown ran" not in proc.stdout
    assert stderr in proc.stderr


def test_an_unexpected_exception_propagates_as_python_reports_it():
    proc = subprocess.run([sys.executable, "-c", PROGRAM.format(body="raise ValueError('boom')")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "ValueError: boom" in proc.stderr
