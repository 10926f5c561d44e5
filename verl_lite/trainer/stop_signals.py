"""SIGINT / SIGTERM during a run: :class:`~verl_lite.errors.RunInterrupted` in the main thread, never in the
middle of a metrics line, and a watchdog that force-stops the run if its teardown overruns.

    exit_on_early_signals()      # the CLI's first statement: nothing started yet, a signal ends it with one line
    SIGNALS.install()            # the CLI, around the run
    with SIGNALS.deferred(): ... # a block a signal must not cut (a metrics line)
    SIGNALS.restore()

A library may install its own handler for a while: ``ray.init`` installs one for SIGTERM that calls
``sys.exit(signum)`` for the whole of its start-up. :meth:`Signals.interruption` therefore takes a
``SystemExit`` carrying SIGINT's or SIGTERM's number for that signal, so SIGTERM at any moment of
start-up ends the run as :class:`RunInterrupted` (exit 143, one line), as later.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from contextlib import contextmanager

from verl_lite.errors import RunInterrupted

STOP_GRACE_S = 10.0  # after SIGINT/SIGTERM the run is force-stopped if its teardown takes longer
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _exit_at_once(signum, frame) -> None:
    os.write(2, f"verl_lite: stopped by {signal.Signals(signum).name}\n".encode())
    os._exit(128 + signum)


def exit_on_early_signals() -> None:
    """Until :meth:`Signals.install`: SIGINT/SIGTERM print the stop line and exit 128 + signal at once (nothing of
    the run exists yet to be stopped)."""
    for s in STOP_SIGNALS:
        signal.signal(s, _exit_at_once)


def _signal_exit(err: BaseException) -> int | None:
    """The signal number a library's handler carried in a ``SystemExit`` in ``err``'s chain (None: none did)."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, SystemExit) and err.code in tuple(int(s) for s in STOP_SIGNALS):
            return int(err.code)
        err = err.__cause__ or err.__context__
    return None


class Signals:
    """SIGINT/SIGTERM -> :class:`RunInterrupted` in the main thread (deferred while a metrics line is
    written), plus a watchdog that SIGKILLs the run's processes and exits if teardown overruns."""

    def __init__(self):
        self.received: int | None = None
        self._deferring = 0
        self._pending: int | None = None
        self._previous: dict = {}

    def install(self) -> None:
        for s in STOP_SIGNALS:
            self._previous[s] = signal.getsignal(s)
            signal.signal(s, self._handle)

    def restore(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous = {}
        self.received = None

    def interruption(self, err: BaseException) -> BaseException:
        """What ``err`` means for the run: once a signal has arrived, :class:`RunInterrupted` (chained
        to ``err``). The handler raises wherever the main thread is; inside a Cython call (``ray.wait``,
        ``ray.get``) that surfaces as ``SystemError: <cyfunction CoreWorker.wait> returned a result
        with an exception set``, and any error after the signal is the stop's consequence anyway. A
        ``SystemExit`` carrying SIGINT's or SIGTERM's number is that signal, handled by a library's handler
        (module docstring): also :class:`RunInterrupted`, and the watchdog bounds what is left of the stop."""
        if self.received is None and (signum := _signal_exit(err)) is not None:
            self._stop_in(signum)
        if self.received is None or isinstance(err, RunInterrupted):
            return err
        stop = RunInterrupted(self.received)
        stop.__cause__ = err
        return stop

    def _handle(self, signum, frame) -> None:
        if self.received is not None:
            return  # a repeated signal: the first one is being handled, the watchdog bounds it
        self._stop_in(signum)
        if self._deferring:
            self._pending = signum
            return
        raise RunInterrupted(signum)

    def _stop_in(self, signum: int) -> None:
        """Record the stop and start the watchdog that bounds the teardown."""
        self.received = signum
        threading.Thread(target=self._watchdog, args=(signum,), name="verl_lite-stop-watchdog", daemon=True).start()

    @staticmethod
    def _watchdog(signum: int) -> None:
        time.sleep(STOP_GRACE_S)
        import psutil

        from verl_lite.utils.processes import kill_and_wait

        procs = psutil.Process().children(recursive=True)
        kill_and_wait(procs, timeout_s=3.0)
        print(f"verl_lite: stopped by {signal.Signals(signum).name}; teardown overran {STOP_GRACE_S:.0f}s, "
              f"{len(procs)} process(es) of the run were killed", file=sys.stderr, flush=True)
        os._exit(128 + signum)

    @contextmanager
    def deferred(self):
        """A signal arriving inside the block is raised when the block ends (never mid-line)."""
        self._deferring += 1
        try:
            yield
        finally:
            self._deferring -= 1
            if not self._deferring and self._pending is not None:
                signum, self._pending = self._pending, None
                raise RunInterrupted(signum)


SIGNALS = Signals()
