"""The local Ray's reaper: kills every process of one local Ray session when the driver that started it dies (Ray
ties its GCS and raylet to the driver, but the raylet's agents outlived a SIGKILLed driver). Started by
``local_ray.start_ray`` BEFORE Ray, by path (standard library only)::

    python ray_reaper.py DRIVER_PID MARKER_NAME=MARKER_VALUE

The session's processes carry the marker in their start-up environment; Ray's Python processes, which overwrite
it with their title, are found by a file open under the session directory with this interpreter as executable.
The driver holds the reaper's stdin: ``session DIR`` names the session directory (until then it is read from a
marked process's ``--session-dir``), ``stop`` says the driver stopped Ray itself. At EOF, or when its parent is no
longer the driver, the reaper SIGKILLs every marked process (bounded), removes DIR unless told ``stop`` (or
``VERL_LITE_KEEP_RAY_SESSION`` is set), and exits. It ignores SIGINT/SIGTERM/SIGHUP (a terminal's Ctrl-C).
"""

import contextlib
import os
import select
import shutil
import signal
import sys
import time

POLL_S = 0.5  # how often the parent pid is checked while stdin stays open
KILL_WAIT_S = 15.0  # the loop ends as soon as none is left; the bound only matters on a loaded machine
SESSION_ARGS = ("--session-dir=", "--session_dir=")  # how Ray passes the session directory to GCS and raylet


def _read_proc(pid, name: str, link: bool = False):
    """``/proc/PID/NAME`` (its bytes, or with ``link`` its link target); None when it cannot be read."""
    try:
        if link:
            return os.readlink(f"/proc/{pid}/{name}")
        with open(f"/proc/{pid}/{name}", "rb") as f:
            return f.read()
    except OSError:
        return None


def _uses_dir(pid: str, directory: str) -> bool:
    """Whether the process has a file under ``directory`` open (Ray points every process's logs there)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    return any((_read_proc(pid, f"fd/{fd}", link=True) or "").startswith(directory) for fd in fds)


def session_pids(needle: bytes, session_dir: str | None, driver_pid: int) -> list[int]:
    """Pids of the session (module docstring), other than this process and the driver (which logs there too)."""
    me, my_exe, found = {str(os.getpid()), str(driver_pid)}, _read_proc("self", "exe", link=True), []
    prefix = session_dir.rstrip("/") + "/" if session_dir else None
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or pid in me:
            continue
        if needle in (_read_proc(pid, "environ") or b"").split(b"\0") or (
                prefix and _read_proc(pid, "exe", link=True) == my_exe and _uses_dir(pid, prefix)):
            found.append(int(pid))
    return found


def find_session_dir(needle: bytes, driver_pid: int) -> str | None:
    """The session directory, from a marked process's (the GCS's or the raylet's) command line."""
    for pid in session_pids(needle, None, driver_pid):
        for arg in (_read_proc(pid, "cmdline") or b"").decode(errors="replace").split("\0"):
            if arg.startswith(SESSION_ARGS):
                return arg.split("=", 1)[1]
    return None


def _alive(pid: int) -> bool:
    try:
        return _read_proc(pid, "stat").decode(errors="replace").rsplit(")", 1)[1].split()[0] != "Z"
    except (AttributeError, IndexError):
        return False


def kill_session(needle: bytes, session_dir: str | None, driver_pid: int) -> None:
    """SIGKILL every process of the session, again for any a dying one started, until none is left (bounded)."""
    deadline = time.monotonic() + KILL_WAIT_S
    while time.monotonic() < deadline:
        pids = [p for p in session_pids(needle, session_dir, driver_pid) if _alive(p)]
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def wait_for_driver(driver_pid: int, needle: bytes) -> tuple[str | None, bool]:
    """Block until the driver is gone or closes the pipe; returns (session dir, whether the driver died)."""
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
