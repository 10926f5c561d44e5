"""Starting and stopping Ray for one run: a minimal loopback-only local Ray, or joining a cluster.

:func:`start_ray` either joins the cluster named by ``RAY_ADDRESS`` (multi-node) or starts a
local Ray that:

- listens on 127.0.0.1 only: every server of the run (GCS, raylet, object manager, the
  driver's and the workers' core-worker ports, the dashboard/runtime-env agents) binds the
  node address, and Ray rewrites ``_node_ip_address="127.0.0.1"`` to the routable address
  unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (Ray's "single-machine" switch) is set while
  it starts; this module sets it for the start only;
- starts its raylet with a one-process role's worker environment (``worker_env.role_env``), which every
  worker inherits: a role whose environment is that one needs no ``runtime_env`` (no runtime-env set-up per actor start);
- runs its workers at normal priority (Ray's default ``worker_niceness`` is 15, which starved
  runs on a busy machine) and has no dashboard, no usage-stats reporting;
- starts only what the run needs: no prestarted idle workers (Ray starts ``num_cpus`` of them,
  each importing Ray, and the run's actors cannot use them: their ``runtime_env`` differs), no
  API-server process (Ray starts it even without the dashboard, for job submission / the state
  API / usage stats, none of which a local run uses, and ``ray.init`` waits for it), no
  autoscaler monitor (a fixed one-node cluster). On a small machine these lengthen ``ray.init``
  and take CPU from the run's own start;
- has its raylet try to connect to its own object store at a short interval, many times (the
  ``raylet_client_connect_*`` settings of ``compat.ray_local.LOCAL_SYSTEM_CONFIG``; Ray's default: once a
  second, up to 10 times; the store starts in a thread of the raylet, and when its socket is not there at the
  first try the raylet slept a whole second, which happened in about half of the starts on the 2-core machine);
- reports no task events (``task_events_report_interval_ms: 0``: the state API's task list and timeline, which
  nothing of a local run reads; flushing them at the end lengthened ``ray.shutdown``);
- is retried a bounded number of times (``ray.init`` times out under load: "The current node
  timed out during startup"), then fails with :class:`RayStartError` saying what to try.

Multi-node users start Ray themselves (``ray start --head --node-ip-address=<routable ip>`` on
the head, ``ray start --address=<head>:6379`` on the others) and set ``RAY_ADDRESS``; nothing
here then changes Ray's networking.

- dies with its driver: a reaper process (``ray_reaper.py``, started before Ray) SIGKILLs every
  process of this Ray session when the driver exits without stopping Ray, however it died
  (SIGKILL included). Ray itself ties only the GCS and the raylet to the driver; the raylet's
  dashboard and runtime-env agents outlived a killed driver. Ray 2.60's raylet cannot run without
  them (it refuses an empty agent command and exits when an agent does), and the runtime-env agent
  serves the actors' ``runtime_env``, so they are started, and reaped. The session's processes
  are found by an environment marker (``VERL_LITE_RAY_SESSION``) set only while ``ray.init``
  spawns them: other Ray instances on the machine are never touched.

:func:`stop_ray` shuts down what :func:`start_ray` started, SIGKILLs any process of that Ray
that outlives the shutdown (found by pid: the processes Ray's node started and their
descendants), and removes the run's Ray session directory (``VERL_LITE_KEEP_RAY_SESSION=1``
keeps it for debugging).
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
SESSION_MARKER_ENV = "VERL_LITE_RAY_SESSION"  # carried by every process of the local Ray this process started
REAPER = Path(__file__).with_name("ray_reaper.py")

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


def _tell_reaper(line: str) -> None:
    if _reaper is not None:
        try:
            _reaper.stdin.write(f"{line}\n".encode())
            _reaper.stdin.flush()
        except OSError:
            pass


def _stop_reaper(timeout_s: float = 10.0) -> None:
    """Tell the reaper Ray was stopped by this process, let it sweep what is left of the session, reap it."""
    global _reaper
    reaper, _reaper = _reaper, None
    if reaper is None:
        return
    try:
        reaper.stdin.write(b"stop\n")
        reaper.stdin.close()
    except OSError:
        pass
    try:
        reaper.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        reaper.kill()
        reaper.wait()


def _quiet() -> dict:
    return dict(logging_level=logging.WARNING, log_to_driver=True, configure_logging=True)


@contextlib.contextmanager
def _spawn_environment(values: dict[str, str]):
    """``values`` in this process's environment within the block (the processes Ray spawns inherit them)."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def inherited_worker_env() -> dict[str, str] | None:
    """The environment every worker of the local Ray this process started inherits (None: no such Ray)."""
    return _worker_env if started_locally() else None


def _init_local(num_cpus: int | None, num_gpus: int | None, marker: str, first_attempt: bool) -> None:
    global _worker_env
    workers = role_env(concurrent_ranks=1)
    # the loopback switch and the session marker (the reaper finds this session's processes by it) likewise
    with _spawn_environment({**workers, _LOOPBACK_ENV: "0", SESSION_MARKER_ENV: marker}):
        # this process read the loopback switch at import time; a retry checks the dashboard's dependencies Ray's way
        with ray_local.local_head_hooks(look_up_dependencies=first_attempt):
            ray_local.init_local_head(  # Ray's settings: ray_local.LOCAL_SYSTEM_CONFIG (the module doc says why)
                include_dashboard=False,
                num_cpus=num_cpus if num_cpus is not None else (os.cpu_count() or 1),
                num_gpus=num_gpus,
                **_quiet(),
            )
    _worker_env = workers


def start_ray(num_cpus: int | None = None, num_gpus: int | None = None, attempts: int = RAY_START_ATTEMPTS) -> bool:
    """Start (or join) Ray; return True when this call started or joined Ray and the caller must stop it.

    Leaves the process's SIGINT/SIGTERM handlers as they were (``ray.init`` replaces SIGTERM's).
    """
    global _session_dir
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage report leaves the machine
    address = os.environ.get("RAY_ADDRESS")
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    last: BaseException | None = None
    for attempt in range(1, attempts + 1):
        try:
            if address:
                ray.init(address=address, **_quiet())
            else:
                _init_local(num_cpus, num_gpus, _start_reaper(), first_attempt=attempt == 1)
                _session_dir = ray_local.session_dir()
                _tell_reaper(f"session {_session_dir}")
            last = None
            break
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
    if last is not None:
        where = f"join the Ray cluster at RAY_ADDRESS={address}" if address else "start a local Ray"
        fix = (
            "check that the cluster is up (`ray status`) and reachable from this machine"
            if address else
            "the machine may be overloaded or short of memory or /tmp space: check `uptime`, `free -h`, `df -h /tmp`, "
            "stop stray Ray instances (`ray stop`), then retry"
        )
        raise RayStartError(f"could not {where} after {attempts} attempts: {type(last).__name__}: "
                            f"{str(last).splitlines()[0] if str(last) else ''}", fix) from last
    return True


def started_locally() -> bool:
    """Whether the Ray this process is connected to is a local one it started (which cannot grow: no node
    joins it, no autoscaler adds one)."""
    return _session_dir is not None and ray.is_initialized()


def _ray_process_tree() -> list[psutil.Process]:
    """The processes the local Ray node of this process started, and their descendants (by pid)."""
    procs: dict[int, psutil.Process] = {}
    for pid in ray_local.node_process_pids():
        try:
            p = psutil.Process(pid)
            procs[p.pid] = p
            for c in p.children(recursive=True):
                procs[c.pid] = c
        except psutil.Error:
            pass
    return list(procs.values())


def _shutdown_quietly() -> None:
    try:
        ray.shutdown()
    except Exception:
        pass


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
