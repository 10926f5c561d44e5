"""Ending the CLI process without the interpreter's teardown (CPython freeing its modules, the C++ destructors of
torch, megatron-core and Ray's core worker: a noticeable share of a short job, for nothing). :func:`exit_now` runs
the ``atexit`` handlers (``atexit._run_exitfuncs``), flushes the standard streams and calls ``os._exit``; where
that function is missing (another interpreter) ``sys.exit`` runs instead.
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import Callable


def _exit_code(code) -> int:
    """``sys.exit``'s rules: None -> 0, an int as is, anything else printed to stderr -> 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def exit_now(main: Callable[[], int | None]) -> None:
    """Run ``main()`` and end the process with its exit code, skipping the interpreter's teardown.
    An exception other than ``SystemExit`` propagates as usual (Python prints it and exits 1)."""
    try:
        code = main()
    except SystemExit as err:
        code = err.code
    run_exit_handlers = getattr(atexit, "_run_exitfuncs", None)
    if run_exit_handlers is None:
        sys.exit(code)
    code = _exit_code(code)
    run_exit_handlers()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing more can be written anyway
            pass
    os._exit(code)
