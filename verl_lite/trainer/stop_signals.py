"""SIGINT / SIGTERM during a run: :class:`~verl_lite.errors.RunInterrupted` in the main thread, never in the
middle of a metrics line, and a watchdog that force-stops the run if its teardown overruns.

    SIGNALS.install()            # the CLI, around the run
    with SIGNALS.deferred(): ... # a block a signal must not cut (a metrics line)
    SIGNALS.restore()
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


class Signals:
    """SIGINT/SIGTERM -> :class:`RunInterrupted` in the main thread (deferred while a metrics line is
    written), plus a watchdog that SIGKILLs the run's processes and exits if teardown overruns."""

    def __init__(self):
        self.received: int | None = None
        self._deferring = 0
        self._pending: int | None = None
        self._previous: dict = {}

    def install(self) -> None:
        for s in (signal.SIGINT, signal.SIGTERM):
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
        with an exception set``, and any error after the signal is the stop's consequence anyway."""
        if self.received is None or isinstance(err, RunInterrupted):
            return err
        stop = RunInterrupted(self.received)
        stop.__cause__ = err
        return stop

    def _handle(self, signum, frame) -> None:
        if self.received is not None:
            return  # a repeated signal: the first one is being handled, the watchdog bounds it
        self.received = signum
        threading.Thread(target=self._watchdog, args=(signum,), name="verl_lite-stop-watchdog", daemon=True).start()
        if self._deferring:
            self._pending = signum
            return
        raise RunInterrupted(signum)

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
