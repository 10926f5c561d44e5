"""A local multi-node Ray cluster on this one machine, for the multi-node tests.

:class:`LocalCluster` starts a head and worker nodes with ``ray.cluster_utils.Cluster`` (each node a
raylet of its own with ``num_cpus=1``), in a temp dir of its own, on 127.0.0.1 only (Ray's
"single machine" switch is off while the nodes start, every port is a free loopback port, no
dashboard, no API server). It is stopped by the pids of its own nodes' processes and their
descendants (never ``ray stop``, which would stop every Ray on the machine).

A job joins it as a user's job joins a real cluster: ``RAY_ADDRESS=<the head's GCS address>``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time

import psutil
import pytest

from tests.e2e.conftest import tiny_assets, tiny_overrides  # noqa: F401  (fixture re-exported)
from verl_lite.utils.net import free_port

LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")
# node death is noticed within ~2 s (Ray's default: ~15-30 s; a real cluster keeps it)
CLUSTER_SYSTEM_CONFIG = {"health_check_initial_delay_ms": 500, "health_check_period_ms": 500,
                     "health_check_timeout_ms": 500, "health_check_failure_threshold": 3,
                     "enable_worker_prestart": False}  # no idle workers: every worker process is a job's


_HANDED_OUT: set[int] = set()  # ports given to a node this session (a node may bind its ports late)


def _free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports, none handed to an earlier node this session (a node may bind
    its ports late)."""
    ports: list[int] = []
    while len(ports) < count:
        ports.append(free_port(exclude=_HANDED_OUT | set(ports)))
    _HANDED_OUT.update(ports)
    return ports


NODE_PORT_KEYS = ("dashboard_agent_listen_port", "metrics_export_port", "runtime_env_agent_port", "object_manager_port")


def _node_ports(*extra_keys: str) -> dict:
    keys = NODE_PORT_KEYS + extra_keys
    return dict(zip(keys, _free_ports(len(keys))))


class LocalCluster:
    """Head + worker nodes on loopback; see the module docstring."""

    def __init__(self, n_workers: int = 1, num_cpus: float = 1):
        from ray.cluster_utils import Cluster

        from verl_lite.compat import ray_local

        self.temp_dir = tempfile.mkdtemp(prefix="vlmn", dir="/tmp")  # short: socket paths have a length limit
        self.num_cpus = num_cpus
        self._cluster_cls = Cluster
        self._hooks = ray_local.local_head_hooks
        self.cluster = None
        self.workers: list = []
        with self._single_machine():
            self.cluster = Cluster(initialize_head=True, shutdown_at_exit=True, head_node_args=dict(
                num_cpus=num_cpus, node_ip_address="127.0.0.1", include_dashboard=False, temp_dir=self.temp_dir,
                _system_config=dict(CLUSTER_SYSTEM_CONFIG), **_node_ports("gcs_server_port")))
        for _ in range(n_workers):
            self.add_worker()

    @contextlib.contextmanager
    def _single_machine(self):
        saved = os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
        os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # inherited by the nodes' processes
        try:
            with self._hooks():
                yield
        finally:
            if saved is None:
                os.environ.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
            else:
                os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = saved

    def add_worker(self):
        with self._single_machine():
            node = self.cluster.add_node(num_cpus=self.num_cpus, node_ip_address="127.0.0.1",
                                         temp_dir=self.temp_dir, **_node_ports())
        self.workers.append(node)
        return node

    @property
    def address(self) -> str:
        return self.cluster.address

    @staticmethod
    def node_pids(node) -> list[int]:
        """The node's processes (raylet, agents, store, GCS on the head) and their descendants (the workers)."""
        pids = set()
        for infos in node.all_processes.values():
            for info in infos:
                if info.process is None:
                    continue
                pids.add(info.process.pid)
                with contextlib.suppress(psutil.Error):
                    pids.update(c.pid for c in psutil.Process(info.process.pid).children(recursive=True))
        return sorted(pids)

    def all_pids(self) -> list[int]:
        nodes = [self.cluster.head_node, *self.workers]
        return sorted({p for n in nodes if n is not None for p in self.node_pids(n)})

    @staticmethod
    def raylet_pid(node) -> int:
        return node.all_processes["raylet"][0].process.pid

    def listening(self) -> dict:
        """(ip, port) -> command of every listening TCP socket of the cluster's processes."""
        out = {}
        for pid in self.all_pids():
            with contextlib.suppress(psutil.Error):
                p = psutil.Process(pid)
                for c in p.net_connections(kind="tcp"):
                    if c.status == psutil.CONN_LISTEN:
                        out[(c.laddr.ip, c.laddr.port)] = " ".join(p.cmdline())[:100]
        return out

    def stop(self) -> None:
        """SIGKILL every process of the cluster (by pid), wait for them, drop the temp dir."""
        procs = []
        for pid in self.all_pids():
            with contextlib.suppress(psutil.Error):
                procs.append(psutil.Process(pid))
        for p in procs:
            with contextlib.suppress(psutil.Error):
                p.kill()
        psutil.wait_procs(procs, timeout=10)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def alive(pids) -> list[int]:
    out = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
    return out


def wait_gone(pids, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and alive(pids):
        time.sleep(0.2)
    return alive(pids)


@pytest.fixture(scope="module")
def cluster(monkeypatch_module):
    """A head and one worker node (1 CPU each); jobs join it through RAY_ADDRESS."""
    from ray._private import ray_constants

    from verl_lite.controller import stop_ray

    stop_ray()  # a local Ray an earlier module left up (a shared_ray) would take the jobs instead of the cluster
    c = LocalCluster(n_workers=1)
    monkeypatch_module.setenv("RAY_ADDRESS", c.address)
    # the driver (this process) keeps 127.0.0.1 as a job on the cluster does (it inherits the nodes' switch)
    monkeypatch_module.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    monkeypatch_module.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
    try:
        yield c
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        pids = c.all_pids()
        c.stop()
        left = wait_gone(pids, 10)
        assert not left, f"processes of the local cluster left: {left}"


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()
