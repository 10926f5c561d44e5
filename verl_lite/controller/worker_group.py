"""A group of Ray actors, one per engine rank, driven by the single controller.

The controller assigns each actor its ``rank`` and the ``world_size``, then a rendezvous address
(``MASTER_ADDR`` = 127.0.0.1 on one machine, rank 0's node address on a cluster, and a free port
found on rank 0's node). Workers subclass :class:`Worker` and know nothing about Ray.

No hangs: every wait has a timeout; results are awaited as they come (``ray.wait``), so the
first worker exception is seen at once, even while the other ranks sit blocked in a collective.
Any failure (an exception, a dead actor, a timeout) tears the whole group down (``ray.kill``
every actor, free the placement group) and is re-raised on the driver as :class:`WorkerError`
naming the rank, the method and the original traceback.

A lost node (its raylet died or stopped answering Ray's health checks; Ray then fails the calls of
every actor on it) is reported as ONE :class:`NodeLostError` naming the node, its address and the
roles and ranks it hosted (the pool records which role runs on which ranks), also when a surviving
rank fails first because its collective lost the connection to that node (it then waits up to
``PEER_LOSS_GRACE_S`` for Ray to say so). The bound: Ray's node health check
(``health_check_period_ms`` x ``health_check_failure_threshold``: tens of seconds with Ray's defaults), and
``trainer.worker_timeout_s`` for anything Ray never reports. A worker whose raylet
is gone exits by itself (:func:`exit_when_orphaned`): Ray's own workers outlive a killed raylet
while they run a task (or wait in a collective), and would be left behind on a node whose raylet
crashed.
"""

from __future__ import annotations

import os
import re
import threading
import time
from typing import Any, Sequence

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError

from verl_lite.controller.local_ray import inherited_worker_env
from verl_lite.controller.resource_pool import ResourcePool, node_address, node_alive
from verl_lite.controller.wire import wire
from verl_lite.controller.worker_env import role_env
from verl_lite.utils.net import free_port


def _strip_ansi(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


class WorkerError(RuntimeError):
    """A worker failed; the message names its rank, the method, and carries the worker's traceback."""

    exit_code, describe_prefix = 1, "the run stopped: "  # verl_lite.errors.describe (the traceback: the log only)

    def __init__(self, message: str, rank: int | None = None, method: str | None = None):
        super().__init__(message)
        self.rank = rank
        self.method = method


class WorkerTimeout(WorkerError):
    """A call did not finish within its bound (the group's ``timeout_s`` or the call's own); the group was torn down."""


class NodeLostError(WorkerError):
    """A Ray node of the run was lost; the message names it and the roles (and ranks) it hosted."""

    def __init__(self, message: str, node_id: str, roles: dict[str, list[int]], rank: int | None = None,
                 method: str | None = None):
        super().__init__(message, rank=rank, method=method)
        self.node_id, self.roles = node_id, roles


ORPHAN_CHECK_S = 1.0
PEER_LOSS_GRACE_S = 60.0  # how long a failure that may be a node loss (a rank's lost connection, a worker's death on
# another node) waits for Ray's health check to say the node was lost
_PEER_LOSS = re.compile(r"connection (reset|closed|refused)|broken pipe|remote process exited|network error|"
                        r"DistNetworkError|socket", re.I)


def _is_peer_loss(cause) -> bool:
    """Whether a worker's exception looks like a collective losing its connection to a peer."""
    return cause is not None and bool(_PEER_LOSS.search(f"{type(cause).__name__}: {cause}"))


def exit_when_orphaned(interval_s: float = ORPHAN_CHECK_S) -> None:
    """In a Ray actor: exit this process (and its descendants) once the raylet that started it (its parent) is gone."""
    parent = os.getppid()

    def watch():
        while True:
            time.sleep(interval_s)
            if os.getppid() != parent:
                _kill_descendants()
                os._exit(1)

    threading.Thread(target=watch, name="verl-lite-orphan-watch", daemon=True).start()


def _kill_descendants() -> None:
    """SIGKILL this process's descendants (e.g. multiprocessing helpers), which ``os._exit`` would orphan."""
    import psutil

    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        return
    for c in children:
        try:
            c.kill()
        except psutil.Error:
            pass


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
        self.rank = rank
        self.world_size = world_size
        os.environ["RANK"] = str(rank)
        os.environ["WORLD_SIZE"] = str(world_size)
        os.environ.setdefault("LOCAL_RANK", "0")  # Ray gives each GPU actor its own visible device

    def rendezvous_address(self) -> tuple[str, int]:
        """(address, free port) on this worker's node: called on rank 0 only."""
        address = ray.util.get_node_ip_address()
        return address, free_port(address)

    def set_rendezvous(self, master_addr: str, master_port: int) -> None:
        self.master_addr, self.master_port = master_addr, master_port
        os.environ["MASTER_ADDR"] = master_addr
        os.environ["MASTER_PORT"] = str(master_port)

    def layout(self) -> dict:
        """This rank's place for dispatch: its DP rank, DP size, and whether its outputs are collected.

        Subclasses with a parallel engine override this after the engine is built.
        """
        return {"dp_rank": self.rank, "dp_size": self.world_size, "is_output_owner": True}

    def pid(self) -> int:
        return os.getpid()

    def call_wired(self, method: str, *args, **kwargs) -> Any:
        """``method(*args, **kwargs)`` with its result sent back in wire form (``controller/wire.py``: tensors as
        raw bytes, not ``torch.save``); the driver receives the result itself."""
        return wire(getattr(self, method)(*args, **kwargs))

    def node_id(self) -> str:
        """The Ray node this worker runs on."""
        return ray.get_runtime_context().get_node_id()


class WorkerGroup:
    """``world_size`` Ray actors of ``worker_cls`` (a :class:`Worker` subclass) on a :class:`ResourcePool`."""

    def __init__(
        self,
        worker_cls: type,
        world_size: int,
        init_kwargs: dict | None = None,
        pool: ResourcePool | None = None,
        *,
        timeout_s: float,
        env: dict[str, str] | None = None,
        local: bool | None = None,
        bundle_offset: int = 0,
        share: float = 1.0,
        name: str | None = None,
        concurrent_ranks: int | None = None,
    ):
        """``bundle_offset``/``share``: rank r runs on pool rank ``bundle_offset + r`` of ``pool`` and
        takes ``share`` of it (roles colocated on the same ranks split them). ``name``: the role, as
        errors name it (default: the worker class's name). ``concurrent_ranks``: how many worker
        processes compute at the same time as these (default: this group's ranks; split placement adds
        the rollout pool's); each gets ``cores // concurrent_ranks`` threads, at most an inherited
        ``OMP_NUM_THREADS``."""
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.name = name or worker_cls.__name__
        self.pool = pool or ResourcePool(world_size)
        self._owns_pool = pool is None
        self.bundle_offset = bundle_offset
        self.pool.place(self.name, bundle_offset, world_size)
        self.actors: list = []
        self._alive = True
        self._rendezvous = None  # rank 0's rendezvous_address call, until connect() has awaited it
        env_vars = role_env(concurrent_ranks or world_size, env)
        inherit = env_vars == inherited_worker_env()  # the local Ray's workers have it already: no runtime_env
        remote_cls = ray.remote(worker_cls)
        self._loopback = local if local is not None else not os.environ.get("RAY_ADDRESS")
        try:
            for rank in range(world_size):
                opts = self.pool.actor_options(bundle_offset + rank, share)
                if not inherit:
                    opts["runtime_env"] = {"env_vars": env_vars}
                opts["max_concurrency"] = 1
                self.actors.append(remote_cls.options(**opts).remote(rank, world_size, **(init_kwargs or {})))
            self._rendezvous = self.actors[0].rendezvous_address.remote()  # awaited by connect()
        except BaseException:
            self.shutdown()
            raise

    def connect(self) -> None:
        """Wait for rank 0's rendezvous address (its process is up) and give it to every rank; idempotent,
        done by the first call. Until then the actors start in the background, so several groups created
        one after the other start their processes at the same time."""
        if self._rendezvous is None:
            return
        ref, self._rendezvous = self._rendezvous, None
        address, port = self._wait([ref], "rendezvous_address", [0])[0]
        if self._loopback:
            address = "127.0.0.1"  # a local Ray: rendezvous over loopback only
        self.master_addr, self.master_port = address, port
        self.call_all("set_rendezvous", address, port)

    # ------------------------------------------------------------------ calls
    def call_all(self, method: str, *args, timeout_s: float | None = None, **kwargs) -> list[Any]:
        """Call ``method(*args, **kwargs)`` on every rank; results in rank order."""
        return self.call_per_rank(method, [args] * self.world_size, [kwargs] * self.world_size, timeout_s=timeout_s)

    def call_per_rank(
        self,
        method: str,
        args_per_rank: Sequence[Sequence],
        kwargs_per_rank: Sequence[dict] | None = None,
        timeout_s: float | None = None,
        wired_results: bool = False,
    ) -> list[Any]:
        """Call ``method`` on every rank with that rank's own arguments; results in rank order.

        ``wired_results``: the workers send their results in wire form (``Worker.call_wired``: tensors as raw
        bytes, for results that hold tensors); the caller receives the same results either way."""
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
        """Start ``method`` on every rank with that rank's arguments (connecting first); the calls' refs, rank order."""
        if not self._alive:
            raise WorkerError(f"the worker group was shut down; cannot call {method!r}", method=method)
        self.connect()
        if len(args_per_rank) != self.world_size:
            raise ValueError(f"{method}: got arguments for {len(args_per_rank)} ranks, the group has {self.world_size}")
        kwargs_per_rank = kwargs_per_rank or [{}] * self.world_size
        if wired_results:
            return [actor.call_wired.remote(method, *a, **kw)
                    for actor, a, kw in zip(self.actors, args_per_rank, kwargs_per_rank)]
        return [getattr(actor, method).remote(*a, **kw) for actor, a, kw in zip(self.actors, args_per_rank, kwargs_per_rank)]

    def broadcast(self, method: str, *args, timeout_s: float | None = None, **kwargs) -> list[Any]:
        """:meth:`call_all` for large arguments every rank receives whole (weights): each put in the object
        store once, in wire form (``controller/wire.py``), and fetched by every rank, where Ray would store
        a copy per call of an argument over 100 KiB. The ranks receive the arguments themselves."""
        refs = [ray.put(wire(a)) for a in args]
        return self.call_all(method, *refs, timeout_s=timeout_s, **kwargs)

    def _wait(self, refs: list, method: str, ranks: list[int], timeout_s: float | None = None) -> list[Any]:
        """Gather ``refs`` as they finish; on the first failure tear the group down and raise."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        rank_of = {ref: rank for ref, rank in zip(refs, ranks)}
        results: dict[int, Any] = {}
        pending = list(refs)
        try:
            while pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    waiting = sorted(rank_of[r] for r in pending)
                    raise WorkerTimeout(
                        f"{method!r} did not finish within {timeout_s:.0f}s on worker rank(s) {waiting} "
                        f"(trainer.worker_timeout_s); the group was torn down",
                        rank=waiting[0],
                        method=method,
                    )
                ready, pending = ray.wait(pending, num_returns=1, timeout=min(remaining, 5.0))
                if ready and pending:  # sweep up every other result that is already in: one wait, one get
                    more, pending = ray.wait(pending, num_returns=len(pending), timeout=0)
                    ready += more
                if not ready:
                    continue
                try:
                    values = ray.get(ready, timeout=max(1.0, deadline - time.monotonic()))
                except RayError:
                    values = None  # one of them failed: find which, one by one, below
                if values is not None:
                    results.update((rank_of[ref], v) for ref, v in zip(ready, values))
                    continue
                for ref in ready:
                    rank = rank_of[ref]
                    try:
                        results[rank] = ray.get(ref, timeout=max(1.0, deadline - time.monotonic()))
                    except RayTaskError as err:
                        cause = err.cause if isinstance(err.cause, BaseException) else None
                        lost = self._peer_lost(cause, rank_of, pending, method, deadline)
                        if lost is not None:  # this rank only saw its peer go: report the lost node
                            raise lost from None
                        raise WorkerError(
                            f"worker rank {rank} failed in {method!r}: "
                            f"{type(cause).__name__ if cause else 'error'}: {cause}\n"
                            f"--- worker rank {rank} traceback ---\n{_strip_ansi(str(err))}",
                            rank=rank,
                            method=method,
                        ) from cause
                    except RayActorError as err:
                        lost = self._await_node_loss([rank], method, deadline)
                        if lost is not None:
                            raise lost from None
                        raise WorkerError(
                            f"worker rank {rank} died during {method!r} (process exited or was killed): {err}",
                            rank=rank,
                            method=method,
                        ) from None
                    except GetTimeoutError:
                        raise WorkerTimeout(f"{method!r} on worker rank {rank} timed out", rank=rank, method=method)
        except BaseException:
            self.shutdown()
            raise
        return [results[r] for r in ranks]

    def _peer_lost(self, cause, rank_of: dict, pending: list, method: str, deadline: float) -> NodeLostError | None:
        """After a rank failed with ``cause``: the :class:`NodeLostError` of a node of this group that is
        dead, or that Ray reports dead within :data:`PEER_LOSS_GRACE_S` when ``cause`` is a lost
        connection to a peer (a collective sees its peer's node go before Ray's health check does)."""
        ranks = sorted(set(rank_of.values()))
        here = ray.get_runtime_context().get_node_id()
        on_other_nodes = any(self.pool.node_of(self.bundle_offset + r) not in (None, here) for r in ranks)
        wait = on_other_nodes and _is_peer_loss(cause)  # a node of the driver's own machine is not lost alone
        grace_end = min(deadline, time.monotonic() + (PEER_LOSS_GRACE_S if wait else 0.0))
        while True:
            lost = self._dead_node_of(ranks, method)
            if lost is not None:
                return lost
            if time.monotonic() >= grace_end:
                return None  # no node was lost
            died = self._died_ranks(pending, rank_of)
            if died:  # a worker died: on a lost node, Ray says so within its health check; else its error is the cause
                return self._await_node_loss(died, method, deadline)
            time.sleep(0.25)

    def _dead_node_of(self, ranks: list[int], method: str) -> NodeLostError | None:
        """The :class:`NodeLostError` of the first of ``ranks`` whose node Ray reports dead now."""
        alive = {n.get("NodeID") for n in ray.nodes() if n.get("Alive")}
        for r in ranks:
            node = self.pool.node_of(self.bundle_offset + r)
            if node is not None and node not in alive:
                return self._lost_node(r, method)
        return None

    def _await_node_loss(self, died: list[int], method: str, deadline: float) -> NodeLostError | None:
        """After the workers of ranks ``died`` died: a worker's death reaches the driver before Ray's health
        check declares its node dead, so for a worker on another node wait up to :data:`PEER_LOSS_GRACE_S`
        for that. None: the node is alive (or the worker was on the driver's node), the death is the error."""
        here = ray.get_runtime_context().get_node_id()
        remote = [r for r in died if self.pool.node_of(self.bundle_offset + r) not in (None, here)]
        if not remote:  # the driver's own node (or one Ray does not name) is alive: the death is the error
            return None
        end = min(deadline, time.monotonic() + PEER_LOSS_GRACE_S)
        while True:
            lost = self._dead_node_of(remote, method)
            if lost is not None or time.monotonic() >= end:
                return lost
            time.sleep(0.25)

    @staticmethod
    def _died_ranks(pending: list, rank_of: dict) -> list[int]:
        """The ranks of the ``pending`` calls that have failed because their worker died (one short ``ray.wait``)."""
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

    def _lost_node(self, rank: int, method: str) -> NodeLostError | None:
        """The :class:`NodeLostError` for rank ``rank`` when its node is dead; None when the node is alive."""
        node = self.pool.node_of(self.bundle_offset + rank)
        if node is None or node_alive(node):
            return None
        roles = self.pool.roles_on(node)
        hosted = ", ".join(f"{role} rank{'s' if len(r) > 1 else ''} {r}" for role, r in roles.items())
        return NodeLostError(
            f"node {node[:12]} ({node_address(node) or 'unknown address'}) was lost during {self.name}'s "
            f"{method!r}: it hosted {hosted}; every worker was stopped. Resume from the last complete checkpoint "
            f"(trainer.resume_mode=auto) on the nodes left, with a trainer.nnodes and layout that fit them",
            node_id=node, roles=roles, rank=rank, method=method)

    # --------------------------------------------------------------- teardown
    def shutdown(self) -> None:
        """Kill every actor and free the placement group (idempotent; never blocks)."""
        self._alive = False
        for actor in self.actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass
        self.actors = []
        if self._owns_pool:
            self.pool.remove()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
