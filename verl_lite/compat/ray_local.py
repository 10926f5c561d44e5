"""Ray 2.60 internals behind verl_lite's minimal, loopback-only local Ray (``controller/local_ray.py``).

- :func:`local_head_hooks`: while a local head starts, Ray's "single machine" flag (``ENABLE_RAY_CLUSTER``, read
  once at import) is off, so the node address stays 127.0.0.1; the API server and monitor start nothing; the wait
  for the raylet to register polls every ``REGISTER_POLL_S`` (Ray's sleeps a second); the dashboard agent's
  optional dependencies are found, not imported;
- :func:`init_local_head`: ``ray.init`` of that head with :data:`LOCAL_SYSTEM_CONFIG`;
- :func:`session_dir` / :func:`node_process_pids`: of the node this process started (``worker._global_node``).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib.machinery
import importlib.util
import time
from pathlib import Path

import ray

from verl_lite.compat import require

require("ray", "verl_lite.compat.ray_local")

# Ray's internal settings (``ray_config_def.h``) of the local head: workers at normal priority (Ray's niceness 15
# starved runs on a busy machine), no prestarted idle workers, a short raylet connect retry, no task events
LOCAL_SYSTEM_CONFIG = {"worker_niceness": 0, "enable_worker_prestart": False, "prestart_worker_first_driver": False,
                       "raylet_client_connect_timeout_milliseconds": 20, "raylet_client_num_connect_attempts": 500,
                       "task_events_report_interval_ms": 0}
LOCAL_NODE_IP = "127.0.0.1"
SKIPPED_HEAD_PROCESSES = ("start_api_server", "start_monitor")
REGISTER_POLL_S = 0.02  # how often the local head checks that its raylet has registered
REGISTER_WAIT_S = 30.0  # Ray's own bound for it (node.py's raylet_start_wait_time_s)


def _skip_head_process(self, *args, **kwargs) -> None:
    """Stands in for a ``ray._private.node.Node.start_*`` head process the local run does not need."""
    return None


def _polling_get_node(original):
    """``ray._private.services.get_node`` that first polls the GCS node table for the node (up to
    ``REGISTER_WAIT_S``), then asks Ray's own (which then answers at once, or waits and fails as it does)."""
    from ray._private import services, state

    def get_node(gcs_address, node_id):
        table = state.GlobalState()
        table._initialize_global_state(services._get_gcs_client_options(gcs_address))
        deadline = time.monotonic() + REGISTER_WAIT_S
        while time.monotonic() < deadline:
            if any(node.get("NodeID") == node_id and node.get("Alive") for node in table.node_table()):
                break
            time.sleep(REGISTER_POLL_S)
        return original(gcs_address, node_id)

    return get_node


@functools.lru_cache(maxsize=1)
def _dashboard_dependency_modules() -> tuple[str, ...]:
    """The modules ``ray.dashboard.optional_deps`` imports (Ray's list of the dashboard's optional dependencies),
    read from its source."""
    source = importlib.util.find_spec("ray.dashboard.optional_deps").origin
    names: list[str] = []
    for node in ast.parse(Path(source).read_text()).body:
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return tuple(dict.fromkeys(names))


def _findable(name: str) -> bool:
    """Whether module ``name`` can be found without running any package's code (a regular package's submodules are
    looked up in its directories; below a namespace package Python's own lookup takes over)."""
    parts = name.split(".")
    spec = importlib.util.find_spec(parts[0])
    for depth in range(2, len(parts) + 1):
        if spec is None or spec.submodule_search_locations is None:
            return False
        if spec.origin is None:  # a namespace package: importing it runs nothing
            return importlib.util.find_spec(name) is not None
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:depth]), list(spec.submodule_search_locations))
    return spec is not None


def _dependency_check_by_lookup(original):
    """``ray._private.utils.get_dashboard_dependency_error`` answering None (installed) when every module of Ray's
    list can be found; otherwise (or when the lookup fails) Ray's own check, which imports them."""

    def get_dashboard_dependency_error():
        try:
            if all(_findable(name) for name in _dashboard_dependency_modules()):
                return None
        except Exception:  # noqa: BLE001 - Ray's own check decides
            pass
        return original()

    return get_dashboard_dependency_error


@contextlib.contextmanager
def local_head_hooks(look_up_dependencies: bool = True):
    """Within the block a local ``ray.init`` keeps 127.0.0.1 and skips the unused head processes.
    ``look_up_dependencies=False`` leaves Ray's own dependency check (which imports them)."""
    from ray._private import node as ray_node
    from ray._private import ray_constants, services
    from ray._private import utils as ray_utils

    saved_flag = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    skipped = {name: getattr(ray_node.Node, name) for name in SKIPPED_HEAD_PROCESSES}
    for name in skipped:
        setattr(ray_node.Node, name, _skip_head_process)
    get_node, dependency_error = services.get_node, ray_utils.get_dashboard_dependency_error
    services.get_node = _polling_get_node(get_node)
    if look_up_dependencies:
        ray_utils.get_dashboard_dependency_error = _dependency_check_by_lookup(dependency_error)
    try:
        yield
    finally:
        services.get_node, ray_utils.get_dashboard_dependency_error = get_node, dependency_error
        for name, method in skipped.items():
            setattr(ray_node.Node, name, method)
        ray_constants.ENABLE_RAY_CLUSTER = saved_flag


def init_local_head(**options) -> None:
    """``ray.init(address="local", **options)`` with the node bound to :data:`LOCAL_NODE_IP` and Ray's internal
    settings :data:`LOCAL_SYSTEM_CONFIG` (call it inside :func:`local_head_hooks`, or Ray rewrites the address to the
    routable one)."""
    ray.init(address="local", _node_ip_address=LOCAL_NODE_IP, _system_config=dict(LOCAL_SYSTEM_CONFIG), **options)


def _global_node():
    return getattr(ray._private.worker, "_global_node", None)


def session_dir() -> str | None:
    """The session directory of the Ray node this process started or joined (None without one)."""
    node = _global_node()
    return None if node is None else node.get_session_dir_path()


def node_process_pids() -> list[int]:
    """Pids of the processes the Ray node of this process started (GCS, raylet, agents, ...)."""
    node = _global_node()
    if node is None:
        return []
    return [info.process.pid for infos in getattr(node, "all_processes", {}).values() for info in infos
            if getattr(info, "process", None) is not None]
