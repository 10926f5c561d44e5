"""Ray worker group: rendezvous, real gloo collectives, dispatch, and failures that never hang."""

import os
import sys
import time

import psutil
import pytest
import ray
import torch

from verl_lite.controller import ResourcePool, Worker, WorkerError, WorkerGroup, start_ray, stop_ray
from verl_lite.controller.dispatch import collect_from_owners, make_layouts, per_rank_args, shard_evenly
from verl_lite.protocol import Batch

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class DummyWorker(Worker):
    """DP x TP layout (TP-major inside a DP rank), TP rank 0 owns the outputs."""

    def __init__(self, rank, world_size, tp=1):
        super().__init__(rank, world_size)
        self.tp = tp

    def layout(self):
        return {"dp_rank": self.rank // self.tp, "dp_size": self.world_size // self.tp,
                "is_output_owner": self.rank % self.tp == 0}

    def env(self):
        return {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}

    def all_reduce(self, value):
        import torch.distributed as dist
        if not dist.is_initialized():
            dist.init_process_group("gloo", rank=self.rank, world_size=self.world_size)
        t = torch.tensor([float(value)])
        dist.all_reduce(t)
        return t.item()

    def double(self, piece: Batch):
        return {"y": piece["x"] * 2 + self.rank % self.tp * 1000}  # non-owners return garbage

    def fail_on(self, bad_rank):
        if self.rank == bad_rank:
            raise ValueError(f"deliberate failure on rank {bad_rank}")
        self.all_reduce(1.0)  # the healthy ranks block in a collective that will never complete
        return "unreachable"

    def exit_on(self, bad_rank):
        if self.rank == bad_rank:
            os._exit(3)
        time.sleep(600)

    def sleep(self, s):
        time.sleep(s)

    def role_environment(self):
        import torch

        names = ("OMP_NUM_THREADS", "GLIBC_TUNABLES", "PYTHONWARNINGS", "TRANSFORMERS_VERBOSITY", "TQDM_DISABLE",
                 "VERL_LITE_DEBUG")
        return {name: os.environ.get(name) for name in names}, ray.get_runtime_context().runtime_env.get("env_vars")

    def mmapped_bytes_of_a_100mb_tensor(self):
        """Bytes glibc's malloc serves by mmap (``mallinfo2().hblkhd``) for a live 100 MB tensor."""
        import ctypes

        import torch

        class MallInfo2(ctypes.Structure):
            _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                             "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
        before = libc.mallinfo2().hblkhd
        tensor = torch.empty(25 * 2**20)
        grown = libc.mallinfo2().hblkhd - before
        del tensor
        return grown


@pytest.fixture(scope="module")
def ray_session():
    started = start_ray(num_cpus=2)
    yield
    if started:
        stop_ray()


def _alive(pids):
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def _wait_gone(pids, timeout=20):
    deadline = time.time() + timeout
    while _alive(pids) and time.time() < deadline:
        time.sleep(0.2)
    return _alive(pids)


def test_rendezvous_collectives_and_dispatch(ray_session):
    with WorkerGroup(DummyWorker, 4, init_kwargs={"tp": 2}, timeout_s=60) as group:
        envs = group.call_all("env")
        assert [e["RANK"] for e in envs] == ["0", "1", "2", "3"]
        assert {e["MASTER_ADDR"] for e in envs} == {"127.0.0.1"}
        assert len({e["MASTER_PORT"] for e in envs}) == 1
        assert group.call_per_rank("all_reduce", [(r + 1,) for r in range(4)]) == [10.0] * 4
        layouts = make_layouts(group.call_all("layout"))
        batch = Batch.from_dict({"x": torch.arange(8.0).reshape(8, 1)})
        shards = shard_evenly(batch, 2)
        results = group.call_per_rank("double", [(p,) for p in per_rank_args(shards.pieces, layouts)])
        out = shards.gather(collect_from_owners(results, layouts))["y"]
        assert torch.equal(out, batch["x"] * 2)


def test_workers_get_their_role_environment_inherited_or_as_their_own(ray_session, monkeypatch):
    """The local Ray's workers inherit a one-process role's environment from its raylet (no runtime_env: ~0.3 s
    less per actor start); a role with another environment (two processes on 2 cores: 1 thread each, or a variable
    changed since Ray started) gets it as its actors' runtime_env. Every worker sees its role's values."""
    from verl_lite.controller.local_ray import inherited_worker_env
    from verl_lite.controller.worker_env import role_env

    inherited = inherited_worker_env()
    assert inherited == role_env(1)
    with WorkerGroup(DummyWorker, 1, timeout_s=60) as group:
        [(env, given)] = group.call_all("role_environment")
        assert given is None and env == {k: inherited[k] for k in env}
        # glibc's heap settings took effect: a 100 MB tensor comes from the heap (reused after a free), not
        # from a fresh mmap that is unmapped at free and page-faulted in again at the next allocation
        if "GLIBC_TUNABLES" not in os.environ:
            assert group.call_all("mmapped_bytes_of_a_100mb_tensor") == [0]
    two = role_env(2)  # on 2 cores: 1 thread each
    with WorkerGroup(DummyWorker, 2, timeout_s=60) as group:
        for env, given in group.call_all("role_environment"):
            assert given == (None if two == inherited else two)
            assert env["OMP_NUM_THREADS"] == two["OMP_NUM_THREADS"] and env["PYTHONWARNINGS"] == two["PYTHONWARNINGS"]
    monkeypatch.setenv("TRANSFORMERS_VERBOSITY", "info")
    with WorkerGroup(DummyWorker, 1, timeout_s=60) as group:
        [(env, given)] = group.call_all("role_environment")
        assert given["TRANSFORMERS_VERBOSITY"] == env["TRANSFORMERS_VERBOSITY"] == "info"


def test_worker_exception_names_rank_and_tears_down(ray_session):
    group = WorkerGroup(DummyWorker, 4, timeout_s=60)
    pids = group.call_all("pid")
    t0 = time.time()
    with pytest.raises(WorkerError) as info:
        group.call_all("fail_on", 2)
    assert time.time() - t0 < 30, "the failure must surface without waiting for the blocked ranks"
    msg = str(info.value)
    assert info.value.rank == 2 and "worker rank 2" in msg and "fail_on" in msg
    assert "deliberate failure on rank 2" in msg and "in fail_on" in msg and "raise ValueError" in msg  # traceback
    assert _wait_gone(pids) == [], "every worker process must be killed"
    with pytest.raises(WorkerError, match="shut down"):
        group.call_all("pid")


def test_dead_worker_becomes_an_error(ray_session):
    group = WorkerGroup(DummyWorker, 2, timeout_s=60)
    pids = group.call_all("pid")
    with pytest.raises(WorkerError, match="worker rank 1 died"):
        group.call_all("exit_on", 1)
    assert _wait_gone(pids) == []


def test_timeout_becomes_an_error(ray_session):
    group = WorkerGroup(DummyWorker, 2, timeout_s=60)
    pids = group.call_all("pid")
    with pytest.raises(WorkerError, match=r"did not finish within 2s on worker rank\(s\) \[0, 1\]"):
        group.call_all("sleep", 30, timeout_s=2)
    assert _wait_gone(pids) == []


def test_a_pool_the_local_ray_can_never_hold_fails_at_once(ray_session):
    """A one-GPU machine asked for a second GPU (the one-step-off recipe's rollout pool beside the actor's)
    waited out the placement bound (120 s) before the error; a local Ray cannot grow, so the pool now
    fails at once, naming what was asked and what the cluster has. Here: GPU bundles on a CPU-only Ray,
    and more CPU than the machine has."""
    from verl_lite.controller.resource_pool import ClusterTooSmall, shortfall

    started = time.monotonic()
    with pytest.raises(ClusterTooSmall, match=r"2 GPU asked for, the cluster has 0.*n_gpus_per_node"):
        ResourcePool(2, use_gpu=True, timeout_s=120)
    assert time.monotonic() - started < 10
    assert ray.util.placement_group_table() == {} or all(
        pg["state"] == "REMOVED" for pg in ray.util.placement_group_table().values())  # nothing reserved
    pool = ResourcePool(2)  # what fits is still placed
    pool.remove()
    nodes = [{"Resources": {"CPU": 2.0, "GPU": 1.0}}, {"Resources": {"CPU": 2.0}}]
    assert shortfall([{"CPU": 1.0, "GPU": 1.0}], nodes) is None
    assert shortfall([{"GPU": 1.0}, {"GPU": 1.0}], nodes) == "2 GPU asked for, the cluster has 1"
    assert shortfall([{"CPU": 3.0}], nodes) == "one bundle asks for 3 CPU, the largest node has 2"


@pytest.mark.parametrize("cores, concurrent, inherited, expected", [
    (2, 1, None, 2),   # the default colocated job: one worker takes both cores
    (2, 2, None, 1),   # split placement on 2 cores: the rollout worker beside a 1-rank actor gets 1 thread
    (2, 2, "2", 1),    # an inherited OMP_NUM_THREADS is an upper bound, never a reason to oversubscribe
    (16, 2, "4", 4),   # ... and caps a process that could take more
    (2, 8, None, 1),   # more ranks than cores: at least one thread
    (2, 1, "junk", 2),  # an unreadable value is ignored
])
def test_worker_threads_split_the_cores_between_busy_processes(monkeypatch, cores, concurrent, inherited, expected):
    from verl_lite.controller.worker_env import worker_threads

    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    if inherited is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", inherited)
    assert worker_threads(concurrent) == expected
