"""The guard of one user process tree (a reward file's process, a tool process): nothing that tree starts
outlives it, and its memory stays under a limit whatever kind of allocation it makes. Run by path, standard
library only (by :class:`verl_lite.utils.processes.GuardedProcess`)::

    python -S process_guard.py LIFELINE_FD MEMORY_LIMIT_BYTES|- -- ARGV...

The guard is a child subreaper, so every process the child starts stays its descendant, also one that leaves
the session. It spawns ``ARGV`` with its own stdin/stdout/stderr and lets go of stdin/stdout. It runs no user
code, so it always answers; it SIGKILLs every descendant and exits when

- the lifeline (a socket pair whose other end only the starter holds) ends: the starter closed it or died,
  SIGKILL included; or at SIGTERM / SIGHUP (SIGINT is ignored: a Ctrl-C reaches the starter, which ends the
  tree through the lifeline);
- the child exits: with the child's status (a signal death is repeated on itself);
- the tree's proportional set size (``Pss``: shared memory included), summed every :data:`POLL_S`, passes the
  limit: it writes ``memory USED_BYTES`` on the lifeline and exits as killed by SIGKILL.
"""

import contextlib
import ctypes
import os
import select
import signal
import socket
import sys
import time

PR_SET_CHILD_SUBREAPER = 36
POLL_S = 0.1  # how often the child's exit and the tree's memory are checked between lifeline events
KILL_WAIT_S = 10.0  # the kill loop ends as soon as no descendant is left; the bound only matters under load
_stop_signal: list = []


def become_subreaper() -> None:
    """Orphaned descendants are re-parented to this process (Linux; elsewhere nothing happens)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _children(pid: int) -> list[int]:
    """The direct children of ``pid`` (every thread's), from ``/proc/PID/task/TID/children``."""
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found += [int(c) for c in f.read().split()]
        except OSError:
            continue
    return found


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def descendants(root: int) -> list[int]:
    """Every live (non-zombie) descendant of ``root``, parents before their children."""
    out, queue = [], _children(root)
    while queue:
        pid = queue.pop(0)
        if not _is_zombie(pid):
            out.append(pid)
        queue += _children(pid)
    return out


def tree_memory(pids: list[int]) -> int:
    """Bytes of the proportional set size of ``pids`` (resident size where smaps_rollup is missing)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                total += next((int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:")), 0)
        except OSError:
            try:
                with open(f"/proc/{pid}/statm") as f:
                    total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            except (OSError, IndexError, ValueError):
                continue
    return total


def _reap(child: int, status: list) -> None:
    """Collect every exited child of the guard; the main child's wait status goes into ``status``."""
    with contextlib.suppress(ChildProcessError):  # no child left
        while (reaped := os.waitpid(-1, os.WNOHANG))[0]:
            if reaped[0] == child:
                status.append(reaped[1])


def kill_tree(child: int, status: list) -> None:
    """SIGKILL every descendant, again for any a dying one left re-parented here, until none is left."""
    deadline = time.monotonic() + KILL_WAIT_S
    while time.monotonic() < deadline:
        pids = descendants(os.getpid())
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.005)
        _reap(child, status)
    _reap(child, status)


def _exit_like(wait_status: int | None) -> None:
    """End the guard with the child's exit status (a signal death is repeated on the guard itself)."""
    sys.stderr.flush()
    if wait_status is None:
        os._exit(0)
    if os.WIFSIGNALED(wait_status):
        sig = os.WTERMSIG(wait_status)
        if sig != signal.SIGKILL:
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        os._exit(128 + sig)
    os._exit(os.WEXITSTATUS(wait_status))


def watch(child: int, lifeline: socket.socket, limit: int | None) -> None:
    """Wait for the lifeline's end, a stop signal, the child's exit or the memory limit; then end the tree."""
    status: list = []
    while not _stop_signal:
        try:
            ready, _, _ = select.select([lifeline], [], [], POLL_S)
        except InterruptedError:
            ready = []
        try:
            if ready and not lifeline.recv(4096):
                break  # the starter closed it or died
        except OSError:
            break
        _reap(child, status)
        if status:
            break
        if limit is not None and (used := tree_memory(descendants(os.getpid()))) > limit:
            with contextlib.suppress(OSError):
                lifeline.sendall(f"memory {used}\n".encode())
            kill_tree(child, status)
            _exit_like(int(signal.SIGKILL))  # the wait status of a death by SIGKILL is the signal's number
    kill_tree(child, status)
    _exit_like(status[0] if status else None)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, lambda signum, frame: _stop_signal.append(signum))
    lifeline_fd, limit_arg = int(sys.argv[1]), sys.argv[2]
    argv = sys.argv[sys.argv.index("--") + 1:]
    os.set_inheritable(lifeline_fd, False)
    lifeline = socket.socket(fileno=lifeline_fd)
    become_subreaper()
    child = os.posix_spawn(argv[0], argv, os.environ)
    null = os.open(os.devnull, os.O_RDWR)  # the child's pipes end with the child, not with the guard
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    watch(child, lifeline, None if limit_arg == "-" else int(limit_arg))


if __name__ == "__main__":
    main()
