"""The local Ray's reaper: kills every process of one local Ray session when the driver that started it dies.

Ray ties its GCS and raylet to the driver (``PR_SET_PDEATHSIG``), but the raylet's agents
(``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``) only poll for their parent and then try to
report to the (dead) GCS, so a SIGKILLed driver left them running. This process is started by
:func:`verl_lite.controller.local_ray.start_ray` BEFORE Ray, and run by path (standard library
only: nothing of Ray, torch or verl_lite is imported)::

    python ray_reaper.py DRIVER_PID MARKER_NAME=MARKER_VALUE

Every process of that Ray session carries ``MARKER_NAME=MARKER_VALUE`` in the environment it was
started with (the driver sets it only while ``ray.init`` spawns the GCS and the raylet; the
agents and workers inherit the raylet's). Ray's Python processes overwrite that memory with their
title (``ray::DashboardAgent``), so they are also found by a file open under the session
directory (their logs) together with this interpreter as executable. Other Ray instances on the
machine, other runs and the driver's later children are left alone.

The driver holds the write end of the reaper's stdin. A line ``session DIR`` names the session
directory (until it does, the reaper reads it from the ``--session-dir`` of a marked GCS or raylet, so a
driver stopped inside ``ray.init`` leaves no agent behind either); a line ``stop`` says the driver stopped Ray itself. When stdin reaches EOF (the driver
exited, however it died, or it closed the pipe after its own clean stop) or the reaper's parent
is no longer the driver, the reaper SIGKILLs every marked process, waits for them to go
(bounded), removes DIR unless the driver said ``stop`` (or ``VERL_LITE_KEEP_RAY_SESSION`` is
set), and exits. It ignores SIGINT/SIGTERM/SIGHUP: a Ctrl-C
sent to the terminal's process group must not take it down before the driver.
"""

import os
import select
import shutil
import signal
import sys
import time

POLL_S = 0.5  # how often the parent pid is checked while stdin stays open
KILL_WAIT_S = 15.0  # the loop ends as soon as none is left; the bound only matters on a loaded machine


def _environ_has(pid: str, needle: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return needle in f.read().split(b"\0")
    except OSError:
        return False


def _uses_dir(pid: str, directory: str) -> bool:
    """Whether the process has a file under ``directory`` open (Ray points every process's logs there)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}").startswith(directory):
                return True
        except OSError:
            continue
    return False


def _exe(pid: str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return None


def session_pids(needle: bytes, session_dir: str | None, driver_pid: int) -> list[int]:
    """Pids (other than this process and the driver, which logs into the session directory too) of
    the session: the marker in their start-up environment, or, for the Python processes of Ray that
    overwrite that memory with their title (``ray::...``), an open file under the session directory
    and this interpreter as their executable."""
    me, my_exe, found = {str(os.getpid()), str(driver_pid)}, _exe("self"), []
    prefix = session_dir.rstrip("/") + "/" if session_dir else None
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or pid in me:
            continue
        if _environ_has(pid, needle) or (prefix and _exe(pid) == my_exe and _uses_dir(pid, prefix)):
            found.append(int(pid))
    return found


SESSION_ARGS = ("--session-dir=", "--session_dir=")  # how Ray passes the session directory to GCS and raylet


def find_session_dir(needle: bytes, driver_pid: int) -> str | None:
    """The session directory, read from a marked process's command line (the GCS's or the raylet's), so the
    session's Python processes can be found before the driver names the directory (a driver stopped inside
    ``ray.init`` never does)."""
    for pid in session_pids(needle, None, driver_pid):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        for arg in args:
            if arg.startswith(SESSION_ARGS):
                return arg.split("=", 1)[1]
    return None


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def kill_session(needle: bytes, session_dir: str | None, driver_pid: int) -> int:
    """SIGKILL every process of the session (again, for any that a dying one started) until none is
    left or :data:`KILL_WAIT_S` passes; returns how many were signalled."""
    seen: set[int] = set()
    deadline = time.monotonic() + KILL_WAIT_S
    while time.monotonic() < deadline:
        pids = [p for p in session_pids(needle, session_dir, driver_pid) if _alive(p)]
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                seen.add(pid)
            except OSError:
                pass
        time.sleep(0.1)
    return len(seen)


def wait_for_driver(driver_pid: int, needle: bytes) -> tuple[str | None, bool]:
    """Block until the driver is gone or closes the pipe; returns (session dir, whether the driver died). The
    session dir is the one the driver names, or, until it does, the one its Ray's first processes were given."""
    session_dir, stopped, buffer = None, False, b""
    fd = sys.stdin.fileno()
    while True:
        if os.getppid() != driver_pid:
            return session_dir, True
        ready, _, _ = select.select([fd], [], [], POLL_S)
        if not ready:
            session_dir = session_dir or find_session_dir(needle, driver_pid)
            continue
        chunk = os.read(fd, 4096)
        if not chunk:
            return session_dir, not stopped
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            if line.startswith(b"session "):
                session_dir = line[len(b"session "):].decode()
            elif line == b"stop":
                stopped = True


def main() -> None:
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)
    driver_pid, needle = int(sys.argv[1]), sys.argv[2].encode()
    session_dir, driver_died = wait_for_driver(driver_pid, needle)
    session_dir = session_dir or find_session_dir(needle, driver_pid)
    kill_session(needle, session_dir, driver_pid)
    if driver_died and session_dir and not os.environ.get("VERL_LITE_KEEP_RAY_SESSION"):
        shutil.rmtree(session_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
