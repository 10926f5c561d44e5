"""A group of Ray actors, one per engine rank, driven by the single controller. Workers subclass :class:`Worker`
and know nothing about Ray; each gets its rank, the world size and rank 0's rendezvous address.

No hangs: every wait has a timeout and results are awaited as they come (``ray.wait``), so the first worker
exception is seen at once. Any failure tears the whole group down and is raised as :class:`WorkerError` naming
the rank, the method and the worker's traceback; a lost node is ONE :class:`NodeLostError` naming the node and
the roles and ranks it hosted, also when a surviving rank fails first (the driver waits up to
``PEER_LOSS_GRACE_S`` for Ray's health check). A worker whose raylet is gone exits by itself.
"""

from __future__ import annotations

import contextlib
import os
import re
import threading
import time
from typing import Any, Sequence

import psutil
import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError

from verl_lite.controller.local_ray import inherited_worker_env
from verl_lite.controller.resource_pool import ResourcePool, node_address
from verl_lite.controller.wire import wire
from verl_lite.controller.worker_env import role_env
from verl_lite.utils.net import free_port
from verl_lite.utils.processes import kill_and_wait

ORPHAN_CHECK_S = 1.0
PEER_LOSS_GRACE_S = 60.0  # how long a failure that may be a node loss waits for Ray's health check to say so
_PEER_LOSS = re.compile(r"connection (reset|closed|refused)|broken pipe|remote process exited|network error|"
                        r"DistNetworkError|socket", re.I)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class WorkerError(RuntimeError):
    """A worker failed; the message names its rank, the method, and carries the worker's traceback."""

    exit_code, describe_prefix = 1, "the run stopped: "  # verl_lite.errors.describe (the traceback: the log only)

    def __init__(self, message: str, rank: int | None = None, method: str | None = None):
        super().__init__(message)
        self.rank, self.method = rank, method


class WorkerTimeout(WorkerError):
    """A call did not finish within its bound (the group's ``timeout_s`` or the call's own); the group was torn down."""


class NodeLostError(WorkerError):
    """A Ray node of the run was lost; the message names it and the roles (and ranks) it hosted."""

    def __init__(self, message: str, node_id: str, roles: dict[str, list[int]], rank: int | None = None,
                 method: str | None = None):
        super().__init__(message, rank=rank, method=method)
        self.node_id, self.roles = node_id, roles


def exit_when_orphaned(interval_s: float = ORPHAN_CHECK_S) -> None:
    """In a Ray actor: once its raylet (its parent) is gone, SIGKILL this process's descendants and exit."""
    parent = os.getppid()

    def watch():
        while os.getppid() == parent:
            time.sleep(interval_s)
        with contextlib.suppress(psutil.Error):
            kill_and_wait(psutil.Process().children(recursive=True), timeout_s=0)
        os._exit(1)

    threading.Thread(target=watch, name="verl-lite-orphan-watch", daemon=True).start()


def _in_ray_actor() -> bool:
    try:
        return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None
    except Exception:
        return False


class Worker:
    """Base of every Ray worker role: remembers its rank and sets the torch.distributed env vars."""

    def __init__(self, rank: int, world_size: int):
        if _in_ray_actor():
            exit_when_orphaned()
        self.rank, self.world_size = rank, world_size
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size))
        os.environ.setdefault("LOCAL_RANK", "0")  # Ray gives each GPU actor its own visible device

    def rendezvous_address(self) -> tuple[str, int]:
        """(address, free port) on this worker's node: called on rank 0 only."""
        address = ray.util.get_node_ip_address()
        return address, free_port(address)

    def set_rendezvous(self, master_addr: str, master_port: int) -> None:
        self.master_addr, self.master_port = master_addr, master_port
        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))

    def layout(self) -> dict:
        """This rank's place for dispatch (``dispatch.RankLayout``); engine roles override it."""
        return {"dp_rank": self.rank, "dp_size": self.world_size, "is_output_owner": True}

    def pid(self) -> int:
        return os.getpid()

    def call_wired(self, method: str, *args, **kwargs) -> Any:
        """``method(*args, **kwargs)`` with its result sent back in wire form (``controller/wire.py``)."""
        return wire(getattr(self, method)(*args, **kwargs))

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()


class WorkerGroup:
    """``world_size`` Ray actors of ``worker_cls`` (a :class:`Worker` subclass). Rank r runs on pool rank
    ``bundle_offset + r``, taking ``share`` of it (colocated roles split it). ``name``: the role, as errors name
    it. ``concurrent_ranks``: worker processes computing at the same time as these, for their thread count."""

    def __init__(self, worker_cls: type, world_size: int, init_kwargs: dict | None = None,
                 pool: ResourcePool | None = None, *, timeout_s: float, bundle_offset: int = 0, share: float = 1.0,
                 name: str | None = None, concurrent_ranks: int | None = None):
        self.world_size, self.timeout_s = world_size, timeout_s
        self.name = name or worker_cls.__name__
        self.pool = pool or ResourcePool(world_size)
        self._owns_pool = pool is None
        self.bundle_offset = bundle_offset
        self.pool.place(self.name, bundle_offset, world_size)
        self.actors: list = []
        self._alive = True
        self._rendezvous = None  # rank 0's rendezvous_address call, until connect() has awaited it
        self._loopback = not os.environ.get("RAY_ADDRESS")  # a local Ray: rendezvous over loopback only
        env_vars = role_env(concurrent_ranks or world_size)
        inherit = env_vars == inherited_worker_env()  # the local Ray's workers have it already: no runtime_env
        remote_cls = ray.remote(worker_cls)
        try:
            for rank in range(world_size):
                opts = {**self.pool.actor_options(bundle_offset + rank, share), "max_concurrency": 1}
                if not inherit:
                    opts["runtime_env"] = {"env_vars": env_vars}
                self.actors.append(remote_cls.options(**opts).remote(rank, world_size, **(init_kwargs or {})))
            self._rendezvous = self.actors[0].rendezvous_address.remote()
        except BaseException:
            self.shutdown()
            raise

    def connect(self) -> None:
        """Give every rank rank 0's rendezvous address, once, at the first call (until then the actors start in
        the background, so groups created one after another start at the same time)."""
        if self._rendezvous is None:
            return
        ref, self._rendezvous = self._rendezvous, None
        address, port = self._wait([ref], "rendezvous_address", [0])[0]
        if self._loopback:
            address = "127.0.0.1"
        self.master_addr, self.master_port = address, port
        self.call_all("set_rendezvous", address, port)

    def call_all(self, method: str, *args, timeout_s: float | None = None, **kwargs) -> list[Any]:
        """Call ``method(*args, **kwargs)`` on every rank; results in rank order."""
        return self.call_per_rank(method, [args] * self.world_size, [kwargs] * self.world_size, timeout_s=timeout_s)

    def call_per_rank(self, method: str, args_per_rank: Sequence[Sequence],
                      kwargs_per_rank: Sequence[dict] | None = None, timeout_s: float | None = None,
                      wired_results: bool = False) -> list[Any]:
        """Call ``method`` on every rank with that rank's own arguments; results in rank order (``wired_results``:
        sent back in wire form, for results that hold tensors)."""
        refs = self._submit(method, args_per_rank, kwargs_per_rank, wired_results)
        return self._wait(refs, method, list(range(self.world_size)), timeout_s)

    def submit_all(self, method: str, *args, **kwargs) -> list:
        """:meth:`call_all`'s calls, not awaited: :meth:`gather` awaits them (and bounds the wait)."""
        return self._submit(method, [args] * self.world_size, [kwargs] * self.world_size)

    def gather(self, refs: list, method: str) -> list[Any]:
        """The results of :meth:`submit_all`'s calls, in rank order, as :meth:`call_all` awaits them."""
        return self._wait(refs, method, list(range(self.world_size)))

    def _submit(self, method: str, args_per_rank: Sequence[Sequence], kwargs_per_rank: Sequence[dict] | None = None,
                wired_results: bool = False) -> list:
        if not self._alive:
            raise WorkerError(f"the worker group was shut down; cannot call {method!r}", method=method)
        self.connect()
        if len(args_per_rank) != self.world_size:
            raise ValueError(f"{method}: got arguments for {len(args_per_rank)} ranks, the group has {self.world_size}")
        calls = zip(self.actors, args_per_rank, kwargs_per_rank or [{}] * self.world_size)
        if wired_results:
            return [actor.call_wired.remote(method, *a, **kw) for actor, a, kw in calls]
        return [getattr(actor, method).remote(*a, **kw) for actor, a, kw in calls]

    def broadcast(self, method: str, *args, timeout_s: float | None = None, **kwargs) -> list[Any]:
        """:meth:`call_all` for large arguments (weights): each put in the object store once, in wire form."""
        refs = [ray.put(wire(a)) for a in args]
        return self.call_all(method, *refs, timeout_s=timeout_s, **kwargs)

    def _wait(self, refs: list, method: str, ranks: list[int], timeout_s: float | None = None) -> list[Any]:
        """Gather ``refs`` as they finish; on the first failure tear the group down and raise."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        rank_of = dict(zip(refs, ranks))
        results: dict[int, Any] = {}
        pending = list(refs)
        try:
            while pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    waiting = sorted(rank_of[r] for r in pending)
                    raise WorkerTimeout(f"{method!r} did not finish within {timeout_s:.0f}s on worker rank(s) "
                                        f"{waiting} (trainer.worker_timeout_s); the group was torn down",
                                        rank=waiting[0], method=method)
                ready, pending = ray.wait(pending, num_returns=1, timeout=min(remaining, 5.0))
                if ready and pending:  # sweep up every other result that is already in: one wait, one get
                    more, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
                    ready += more
                if not ready:
                    continue
                try:
                    values = ray.get(ready, timeout=max(1.0, deadline - time.monotonic()))
                except RayError:  # one of them failed: find which, one by one
                    values = [self._get_one(ref, rank_of, pending, method, deadline) for ref in ready]
                results.update((rank_of[ref], v) for ref, v in zip(ready, values))
        except BaseException:
            self.shutdown()
            raise
        return [results[r] for r in ranks]

    def _get_one(self, ref, rank_of: dict, pending: list, method: str, deadline: float) -> Any:
        rank = rank_of[ref]
        try:
            return ray.get(ref, timeout=max(1.0, deadline - time.monotonic()))
        except RayTaskError as err:
            cause = err.cause if isinstance(err.cause, BaseException) else None
            ranks = sorted(set(rank_of.values()))
            # a collective sees its peer's node go before Ray's health check does: wait for Ray's verdict
            peer_loss = cause is not None and bool(_PEER_LOSS.search(f"{type(cause).__name__}: {cause}"))
            grace_s = PEER_LOSS_GRACE_S if peer_loss and self._remote_ranks(ranks) else 0.0
            lost = self._node_loss(ranks, method, deadline, grace_s, pending, rank_of)
            if lost is not None:  # this rank only saw its peer go: report the lost node
                raise lost from None
            raise WorkerError(f"worker rank {rank} failed in {method!r}: "
                              f"{type(cause).__name__ if cause else 'error'}: {cause}\n"
                              f"--- worker rank {rank} traceback ---\n{_ANSI.sub('', str(err))}",
                              rank=rank, method=method) from cause
        except RayActorError as err:
            lost = self._worker_node_loss([rank], method, deadline)
            if lost is not None:
                raise lost from None
            raise WorkerError(f"worker rank {rank} died during {method!r} (process exited or was killed): {err}",
                              rank=rank, method=method) from None
        except GetTimeoutError:
            raise WorkerTimeout(f"{method!r} on worker rank {rank} timed out", rank=rank, method=method)

    def _remote_ranks(self, ranks: list[int]) -> list[int]:
        """Those of ``ranks`` on a node Ray names other than the driver's (which is not lost alone)."""
        here = ray.get_runtime_context().get_node_id()
        return [r for r in ranks if self.pool.node_of(self.bundle_offset + r) not in (None, here)]

    def _node_loss(self, ranks: list[int], method: str, deadline: float, grace_s: float, pending: list = (),
                   rank_of: dict | None = None) -> NodeLostError | None:
        """The :class:`NodeLostError` of a node of ``ranks`` that Ray reports dead within ``grace_s`` (None: none
        is); a ``pending`` call whose worker dies meanwhile narrows the wait to that worker's node."""
        end = min(deadline, time.monotonic() + grace_s)
        while True:
            lost = self._dead_node_of(ranks, method)
            if lost is not None or time.monotonic() >= end:
                return lost
            died = self._died_ranks(pending, rank_of)
            if died:  # on a lost node, Ray says so within its health check; else the death is the error
                return self._worker_node_loss(died, method, deadline)
            time.sleep(0.25)

    def _worker_node_loss(self, died: list[int], method: str, deadline: float) -> NodeLostError | None:
        """The node loss behind the deaths of ranks ``died`` (their death reaches the driver before Ray's health
        check: for those on another node wait up to :data:`PEER_LOSS_GRACE_S`)."""
        remote = self._remote_ranks(died)
        return self._node_loss(remote, method, deadline, PEER_LOSS_GRACE_S) if remote else None

    @staticmethod
    def _died_ranks(pending: list, rank_of: dict) -> list[int]:
        """The ranks of the ``pending`` calls whose worker died (one short ``ray.wait``)."""
        ready, _ = ray.wait(pending, num_returns=len(pending), timeout=0.25) if pending else ([], [])
        died = []
        for ref in ready:
            try:
                ray.get(ref, timeout=1.0)
            except RayActorError:
                died.append(rank_of[ref])
            except Exception:
                pass
        return died

    def _dead_node_of(self, ranks: list[int], method: str) -> NodeLostError | None:
        alive = {n.get("NodeID") for n in ray.nodes() if n.get("Alive")}
        for rank in ranks:
            node = self.pool.node_of(self.bundle_offset + rank)
            if node is None or node in alive:
                continue
            roles = self.pool.roles_on(node)
            hosted = ", ".join(f"{role} rank{'s' if len(r) > 1 else ''} {r}" for role, r in roles.items())
            return NodeLostError(
                f"node {node[:12]} ({node_address(node) or 'unknown address'}) was lost during {self.name}'s "
                f"{method!r}: it hosted {hosted}; every worker was stopped. Resume from the last complete "
                f"checkpoint (trainer.resume_mode=auto) on the nodes left, with a trainer.nnodes and layout that "
                f"fit them", node_id=node, roles=roles, rank=rank, method=method)
        return None

    def shutdown(self) -> None:
        """Kill every actor and free the placement group (idempotent, never blocks)."""
        self._alive = False
        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)
        self.actors = []
        if self._owns_pool:
            self.pool.remove()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
