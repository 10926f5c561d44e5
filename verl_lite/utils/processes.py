"""Stopping processes by pid (never by name: other users' and other runs' processes stay alone), and
starting user code (a reward file, a tool) as a guarded process tree that cannot outlive its starter."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil

GUARD = Path(__file__).with_name("process_guard.py")
GUARD_EXIT_S = 15.0  # the guard's kill loop is bounded by process_guard.KILL_WAIT_S; this waits past it


PR_SET_PDEATHSIG = 1  # linux/prctl.h
_pdeathsig_depth = 0  # > 0 while forked_children_die_with_parent() is active in this process


_forking_pid = 0  # set in the parent just before each fork; the child reads its copy


def _before_fork() -> None:
    global _forking_pid
    _forking_pid = os.getpid()


def _die_with_parent_in_child() -> None:
    """At-fork hook (child side): inside the block below, this child gets SIGKILL when its parent dies; a parent
    that died before the prctl took effect (the child already re-parented) ends the child here."""
    if _pdeathsig_depth > 0 and sys.platform == "linux":
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != _forking_pid:
            os._exit(1)


os.register_at_fork(before=_before_fork, after_in_child=_die_with_parent_in_child)


@contextlib.contextmanager
def forked_children_die_with_parent():
    """A process forked (``os.fork``, ``multiprocessing``'s fork context) while the block is active gets SIGKILL when
    the thread that forked it ends (Linux ``PR_SET_PDEATHSIG``; the process's death included), instead of living on
    as an orphan. For forks whose parent waits for them inside the block: megatron's checkpoint writers, which
    after their parent was killed block forever on their queue. fork+exec launches (``subprocess``) run no at-fork
    hook and are not affected."""
    global _pdeathsig_depth
    _pdeathsig_depth += 1
    try:
        yield
    finally:
        _pdeathsig_depth -= 1


def kill_and_wait(procs: list[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """SIGKILL every process of ``procs`` and wait up to ``timeout_s`` for them; returns those still alive."""
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    return alive


class GuardedProcess:
    """``argv`` run under a guard (``process_guard.py``): its whole tree is SIGKILLed when the child exits, at
    :meth:`stop`, or when this process dies (SIGKILL included), and held under ``memory_limit_bytes``.
    ``stdin`` / ``stdout`` (``Popen``'s) belong to the child; :attr:`proc` is the guard's ``Popen`` (its
    ``returncode`` is the child's)."""

    def __init__(self, argv: list[str], stdin=None, stdout=None, env: dict | None = None,
                 memory_limit_bytes: int | None = None):
        ours, theirs = socket.socketpair()
        limit = str(int(memory_limit_bytes)) if memory_limit_bytes else "-"
        try:
            self.proc = subprocess.Popen([sys.executable, "-S", str(GUARD), str(theirs.fileno()), limit, "--", *argv],
                                         stdin=stdin, stdout=stdout, env=env, pass_fds=(theirs.fileno(),),
                                         close_fds=True, start_new_session=True)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._lifeline = ours
        self._reports = b""

    @property
    def pid(self) -> int:
        return self.proc.pid

    def memory_used(self) -> int | None:
        """The bytes the tree used when the guard stopped it for its memory limit (None: it did not)."""
        if self._lifeline is not None:
            self._lifeline.setblocking(False)
            with contextlib.suppress(OSError):  # BlockingIOError: nothing more to read
                while chunk := self._lifeline.recv(4096):
                    self._reports += chunk
        for line in self._reports.decode(errors="replace").splitlines():
            if line.startswith("memory "):
                return int(line.split()[1])
        return None

    def stop(self) -> int | None:
        """End the whole tree and close the child's pipes (idempotent); the guard's exit status. A guard that does
        not exit in :data:`GUARD_EXIT_S` (it never hangs: a last resort) is SIGKILLed with its process group."""
        self.memory_used()  # keep a report that arrived before the end
        if self._lifeline is not None:
            self._lifeline.close()
            self._lifeline = None
        try:
            return self.proc.wait(timeout=GUARD_EXIT_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait()
        finally:
            for pipe in (self.proc.stdin, self.proc.stdout):
                with contextlib.suppress(OSError):
                    if pipe is not None:
                        pipe.close()
