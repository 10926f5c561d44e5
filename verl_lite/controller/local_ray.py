"""Starting and stopping Ray for one run: joining the cluster at ``RAY_ADDRESS`` (docs/cluster.md), or a minimal
local Ray that listens on 127.0.0.1 only; whose raylet has a one-process role's environment (``worker_env.role_env``,
inherited by every worker: such a role needs no per-actor ``runtime_env``); that starts only what a local run
needs (``compat.ray_local.LOCAL_SYSTEM_CONFIG``); is retried a bounded number of times (then
:class:`RayStartError`); and dies with its driver, however it dies: a reaper (``ray_reaper.py``, started before Ray)
SIGKILLs every process marked by ``VERL_LITE_RAY_SESSION`` in its environment.

:func:`stop_ray` shuts down what :func:`start_ray` started, SIGKILLs what outlives the shutdown (by pid) and
removes the session directory (``VERL_LITE_KEEP_RAY_SESSION=1`` keeps it).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import ray

from verl_lite.compat import ray_local
from verl_lite.controller.worker_env import role_env
from verl_lite.errors import RayStartError
from verl_lite.utils.processes import kill_and_wait

RAY_START_ATTEMPTS = 3
_LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
SESSION_MARKER_ENV = "VERL_LITE_RAY_SESSION"
REAPER = Path(__file__).with_name("ray_reaper.py")
_QUIET = dict(logging_level=logging.WARNING, log_to_driver=True, configure_logging=True)

_session_dir: str | None = None  # the session directory of the local Ray this process started
_reaper: subprocess.Popen | None = None  # kills that Ray's processes if this process dies
_worker_env: dict[str, str] | None = None  # the environment that Ray's workers inherit from its raylet


def _start_reaper() -> str:
    """Start the reaper of the next local Ray session; returns the marker value its processes must carry."""
    global _reaper
    token = uuid.uuid4().hex
    _reaper = subprocess.Popen([sys.executable, "-S", str(REAPER), str(os.getpid()), f"{SESSION_MARKER_ENV}={token}"],
                               stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, close_fds=True)
    return token


def _tell_reaper(line: str, close: bool = False) -> None:
    with contextlib.suppress(OSError):
        _reaper.stdin.write(f"{line}\n".encode())
        _reaper.stdin.flush()
        if close:
            _reaper.stdin.close()


def _stop_reaper(timeout_s: float = 10.0) -> None:
    """Tell the reaper Ray was stopped by this process, let it sweep what is left of the session, reap it."""
    global _reaper
    if _reaper is None:
        return
    _tell_reaper("stop", close=True)
    reaper, _reaper = _reaper, None
    try:
        reaper.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        reaper.kill()
        reaper.wait()


@contextlib.contextmanager
def _spawn_environment(values: dict[str, str]):
    """``values`` in this process's environment within the block (the processes Ray spawns inherit them)."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.update({name: value for name, value in saved.items() if value is not None})
        for name in [name for name, value in saved.items() if value is None]:
            os.environ.pop(name, None)


def inherited_worker_env() -> dict[str, str] | None:
    """The environment every worker of the local Ray this process started inherits (None: no such Ray)."""
    return _worker_env if started_locally() else None


def _init_local(num_cpus: int | None, num_gpus: int | None, first_attempt: bool) -> None:
    global _worker_env, _session_dir
    workers = role_env(concurrent_ranks=1)
    with _spawn_environment({**workers, _LOOPBACK_ENV: "0", SESSION_MARKER_ENV: _start_reaper()}):
        # this process read the loopback switch at import time; a retry checks the dashboard's dependencies Ray's way
        with ray_local.local_head_hooks(look_up_dependencies=first_attempt):
            ray_local.init_local_head(include_dashboard=False, num_gpus=num_gpus,
                                      num_cpus=num_cpus if num_cpus is not None else (os.cpu_count() or 1), **_QUIET)
    _worker_env, _session_dir = workers, ray_local.session_dir()
    _tell_reaper(f"session {_session_dir}")


def start_ray(num_cpus: int | None = None, num_gpus: int | None = None, attempts: int = RAY_START_ATTEMPTS) -> bool:
    """Start (or join) Ray; return True when this call started or joined Ray and the caller must stop it.
    Leaves the process's SIGINT/SIGTERM handlers as they were (``ray.init`` replaces SIGTERM's)."""
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    address = os.environ.get("RAY_ADDRESS")
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for attempt in range(1, attempts + 1):
        try:
            if address:
                ray.init(address=address, **_QUIET)
            else:
                _init_local(num_cpus, num_gpus, first_attempt=attempt == 1)
            return True
        except Exception as err:  # Ray raises plain Exception / ConnectionError / TimeoutError here
            last = err
            _shutdown_quietly()
            _stop_reaper()
            if attempt < attempts:
                time.sleep(2.0 * attempt)
        finally:
            for s, h in handlers.items():
                if h is not None:
                    signal.signal(s, h)
    where = f"join the Ray cluster at RAY_ADDRESS={address}" if address else "start a local Ray"
    fix = ("check that the cluster is up (`ray status`) and reachable from this machine" if address else
           "the machine may be overloaded or short of memory or /tmp space: check `uptime`, `free -h`, `df -h /tmp`, "
           "stop stray Ray instances (`ray stop`), then retry")
    raise RayStartError(f"could not {where} after {attempts} attempts: {type(last).__name__}: "
                        f"{str(last).splitlines()[0] if str(last) else ''}", fix) from last


def started_locally() -> bool:
    """Whether the Ray this process is connected to is a local one it started (no node can join it)."""
    return _session_dir is not None and ray.is_initialized()


def _ray_process_tree() -> list[psutil.Process]:
    """The processes the local Ray node of this process started, and their descendants (by pid)."""
    procs: dict[int, psutil.Process] = {}
    for pid in ray_local.node_process_pids():
        with contextlib.suppress(psutil.Error):
            p = procs[pid] = psutil.Process(pid)
            procs.update({c.pid: c for c in p.children(recursive=True)})
    return list(procs.values())


def _shutdown_quietly() -> None:
    with contextlib.suppress(Exception):
        ray.shutdown()


def stop_ray(grace_s: float = 5.0) -> None:
    """Shut Ray down; SIGKILL what survives of the local Ray this process started; drop its session dir."""
    global _session_dir, _worker_env
    if not ray.is_initialized():
        return
    tree = _ray_process_tree()
    _shutdown_quietly()
    _, alive = psutil.wait_procs(tree, timeout=grace_s)
    kill_and_wait(alive, timeout_s=2.0)
    _stop_reaper()
    if _session_dir and not os.environ.get("VERL_LITE_KEEP_RAY_SESSION"):
        shutil.rmtree(_session_dir, ignore_errors=True)
    _session_dir = _worker_env = None
