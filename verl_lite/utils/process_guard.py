"""The guard of one user process tree (a reward file's process, a tool process): nothing that tree starts
outlives it, and its memory stays under a limit whatever kind of allocation it makes.

Run by path, standard library only (started by :class:`verl_lite.utils.processes.GuardedProcess`)::

    python -S process_guard.py LIFELINE_FD MEMORY_LIMIT_BYTES|- -- ARGV...

The guard makes itself a child subreaper (Linux ``PR_SET_CHILD_SUBREAPER``), spawns ``ARGV`` with its own
stdin/stdout/stderr, then lets go of stdin/stdout (so its starter sees the child's end of input and of output
as the child's own). Every process the child starts stays the guard's descendant: one that leaves the
process group or the session (``start_new_session=True``, a double fork) is re-parented to the guard when
its parent exits, never to init. The guard runs no user code, so it always answers:

- ``LIFELINE_FD`` is one end of a socket pair whose other end only the starter holds. Its end (the
  starter closed it, or the starter died however it died, SIGKILL included) makes the guard SIGKILL every
  descendant and exit.
- The child's exit makes the guard SIGKILL what is left of the tree and exit with the child's status (a
  signal death is repeated on itself), so the starter reads the child's own exit status.
- With a memory limit, every :data:`POLL_S` the guard sums the proportional set size (``Pss`` of
  ``/proc/PID/smaps_rollup``: private, shared and shared-anonymous pages, each page split among the
  processes that map it) of every descendant; over the limit, it writes ``memory USED_BYTES`` on the
  lifeline, then kills the tree and exits as killed by SIGKILL. A tree can pass the limit by what it
  allocates within one poll before it is stopped.
- SIGTERM or SIGHUP to the guard ends the tree as the lifeline's end does; SIGINT is ignored (a terminal's
  Ctrl-C reaches the starter, which ends the tree through the lifeline).
"""

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
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass


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
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) * 1024
                        break
        except OSError:
            try:
                with open(f"/proc/{pid}/statm") as f:
                    total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            except (OSError, IndexError, ValueError):
                continue
    return total


def _reap(child: int, status: list) -> None:
    """Collect every exited child of the guard; the main child's wait status goes into ``status``."""
    while True:
        try:
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid == child:
            status.append(wait_status)


def kill_tree(child: int, status: list) -> None:
    """SIGKILL every descendant, again for any a dying one left re-parented here, until none is left."""
    deadline = time.monotonic() + KILL_WAIT_S
    while time.monotonic() < deadline:
        pids = descendants(os.getpid())
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
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


def _on_stop_signal(signum, frame) -> None:
    _stop_signal.append(signum)


def _release_standard_streams() -> None:
    """Point the guard's stdin/stdout at /dev/null: the child's pipes then end with the child."""
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)


def watch(child: int, lifeline: socket.socket, limit: int | None) -> None:
    """Wait for the lifeline's end, a stop signal, the child's exit or the memory limit; then end the tree."""
    status: list = []
    while True:
        if _stop_signal:
            break
        try:
            ready, _, _ = select.select([lifeline], [], [], POLL_S)
        except InterruptedError:
            ready = []
        if ready:
            try:
                if not lifeline.recv(4096):
                    break  # the starter closed it or died
            except OSError:
                break
        _reap(child, status)
        if status:
            break
        if limit is not None:
            used = tree_memory(descendants(os.getpid()))
            if used > limit:
                try:
                    lifeline.sendall(f"memory {used}\n".encode())
                except OSError:
                    pass
                kill_tree(child, status)
                _exit_like(int(signal.SIGKILL))  # the wait status of a death by SIGKILL is the signal's number
    kill_tree(child, status)
    _exit_like(status[0] if status else None)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for s in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, _on_stop_signal)
    lifeline_fd, limit_arg = int(sys.argv[1]), sys.argv[2]
    argv = sys.argv[sys.argv.index("--") + 1:]
    os.set_inheritable(lifeline_fd, False)
    lifeline = socket.socket(fileno=lifeline_fd)
    become_subreaper()
    child = os.posix_spawn(argv[0], argv, os.environ)
    _release_standard_streams()
    watch(child, lifeline, None if limit_arg == "-" else int(limit_arg))


if __name__ == "__main__":
    main()
