"""SIGINT / SIGTERM during a run: :class:`~verl_lite.errors.RunInterrupted` in the main thread, never in the
middle of a metrics line (``SIGNALS.deferred()``), and a watchdog that force-stops the run if its teardown overruns.

A library may install its own handler for a while (``ray.init``'s SIGTERM handler calls ``sys.exit(signum)``),
so :meth:`Signals.interruption` takes a ``SystemExit`` carrying a stop signal's number for that signal. Where
such a ``SystemExit`` is swallowed (an at-fork callback or a finalizer; its "Exception ignored" is silenced), the
wakeup fd still sees the signal: one no handler of this module saw within :data:`UNSEEN_GRACE_S` starts the
watchdog and is sent again once this module's handler is back.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from contextlib import contextmanager, suppress

from verl_lite.errors import RunInterrupted

STOP_GRACE_S = 10.0  # after SIGINT/SIGTERM the run is force-stopped if its teardown takes longer
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
UNSEEN_GRACE_S = 1.0  # a stop signal no handler of this module saw by then was swallowed by a library's handler


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
        self._raised = False  # this module's handler raised RunInterrupted once
        self._wakeup: tuple[int, int] | None = None  # (write end, the wakeup fd it replaced)
        self._unraisable_hook = None  # sys.unraisablehook before install()

    def install(self) -> None:
        self._raised = False
        for s in STOP_SIGNALS:
            self._previous[s] = signal.getsignal(s)
            signal.signal(s, self._handle)
        self._watch_deliveries()
        self._unraisable_hook = sys.unraisablehook
        sys.unraisablehook = self._silence_swallowed_stops

    def _silence_swallowed_stops(self, unraisable) -> None:
        """A stop signal's exception that Python could not raise (module docstring) is no traceback on stderr."""
        exc = unraisable.exc_value
        if isinstance(exc, RunInterrupted) or (isinstance(exc, SystemExit) and _signal_exit(exc) is not None):
            return
        (self._unraisable_hook or sys.__unraisablehook__)(unraisable)

    def restore(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous = {}
        self.received = None
        if self._unraisable_hook is not None:
            sys.unraisablehook, self._unraisable_hook = self._unraisable_hook, None
        if self._wakeup is not None:
            write_end, previous = self._wakeup
            self._wakeup = None
            with suppress(ValueError):
                signal.set_wakeup_fd(previous)
            os.close(write_end)  # the watcher reads the end and exits

    def _watch_deliveries(self) -> None:
        """Every delivered signal also lands on a wakeup fd, whichever Python handler is installed then; a
        watcher thread notices a stop signal that no handler of this module saw (module docstring)."""
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)
        try:
            previous = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        except ValueError:  # not the main thread
            os.close(read_end)
            os.close(write_end)
            return
        self._wakeup = (write_end, previous)
        threading.Thread(target=self._notice_unseen, args=(read_end,), name="verl_lite-signal-watch",
                         daemon=True).start()

    def _notice_unseen(self, read_end: int) -> None:
        with os.fdopen(read_end, "rb", buffering=0) as f:
            while data := f.read(64):
                for signum in data:
                    if signum in tuple(int(s) for s in STOP_SIGNALS) and self.received is None:
                        time.sleep(UNSEEN_GRACE_S)
                        if self.received is None:
                            self._stop_in(signum)
                            self._send_again_when_handled(signum)

    def _send_again_when_handled(self, signum: int) -> None:
        """Signal this process again as soon as this module's handler is installed again (a library's was)."""
        deadline = time.monotonic() + STOP_GRACE_S
        while time.monotonic() < deadline and not self._raised:
            if signal.getsignal(signum) == self._handle:
                os.kill(os.getpid(), signum)
                return
            time.sleep(0.05)

    def interruption(self, err: BaseException) -> BaseException:
        """What ``err`` means for the run: once a signal has arrived (or ``err`` is a library handler's
        ``SystemExit`` of one), :class:`RunInterrupted` chained to ``err``. Inside a Cython call (``ray.wait``)
        the handler's raise surfaces as a ``SystemError``; any error after the signal is the stop's consequence."""
        if self.received is None and (signum := _signal_exit(err)) is not None:
            self._stop_in(signum)
        if self.received is None or isinstance(err, RunInterrupted):
            return err
        stop = RunInterrupted(self.received)
        stop.__cause__ = err
        return stop

    def _handle(self, signum, frame) -> None:
        if self._raised:
            return  # a repeated signal: the first one is being handled, the watchdog bounds it
        self._raised = True
        if self.received is None:
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

        from verl_lite.utils.processes import kill_and_wait  # psutil: only when the watchdog acts

        procs = psutil.Process().children(recursive=True)
        kill_and_wait(procs, timeout_s=3.0)
        print(f"verl_lite: stopped by {signal.Signals(signum).name}; the run did not stop within {STOP_GRACE_S:.0f}s, "
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
