"""A group of Ray actors, one per engine rank, driven by the single controller.

The controller assigns each actor its ``rank`` and the ``world_size``, then a rendezvous address
(``MASTER_ADDR`` = 127.0.0.1 on one machine, rank 0's node address on a cluster, and a free port
found on rank 0's node). Workers subclass :class:`Worker` and know nothing about Ray.

No hangs: every wait has a timeout; results are awaited as they come (``ray.wait``), so the
first worker exception is seen at once, even while the other ranks sit blocked in a collective.
Any failure (an exception, a dead actor, a timeout) tears the whole group down (``ray.kill``
every actor, free the placement group) and is re-raised on the driver as :class:`WorkerError`
naming the rank, the method and the original traceback.
"""

from __future__ import annotations

import os
import re
import time
from typing import Any, Sequence

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from verl_lite.controller.resource_pool import ResourcePool
from verl_lite.utils.net import free_port
from verl_lite.utils.quiet import worker_env


def _strip_ansi(text: str) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


class WorkerError(RuntimeError):
    """A worker failed; the message names its rank, the method, and carries the worker's traceback."""

    exit_code, describe_prefix = 1, "the run stopped: "  # verl_lite.errors.describe (the traceback: the log only)

    def __init__(self, message: str, rank: int | None = None, method: str | None = None):
        super().__init__(message)
        self.rank = rank
        self.method = method


class Worker:
    """Base of every Ray worker role: remembers its rank and sets the torch.distributed env vars."""

    def __init__(self, rank: int, world_size: int):
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
    ):
        """``bundle_offset``/``share``: rank r runs on bundle ``bundle_offset + r`` of ``pool`` and
        takes ``share`` of it (roles colocated on the same bundles split them)."""
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.pool = pool or ResourcePool(world_size)
        self._owns_pool = pool is None
        self.actors: list = []
        self._alive = True
        env_vars = {
            # the group's ranks run at the same time: split the machine's cores between them (roles
            # of one job take turns, so each may use the cores its peers leave)
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world_size))),
            # quiet workers: library warnings and progress bars once per process add nothing
            **worker_env(),  # PYTHONWARNINGS, VLLM_LOGGING_LEVEL; all shown with --debug
            "TRANSFORMERS_VERBOSITY": os.environ.get("TRANSFORMERS_VERBOSITY", "error"),
            "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "TQDM_DISABLE": "1",
            **(env or {}),
        }
        remote_cls = ray.remote(worker_cls)
        try:
            for rank in range(world_size):
                opts = self.pool.actor_options(bundle_offset + rank, share)
                opts["runtime_env"] = {"env_vars": env_vars}
                opts["max_concurrency"] = 1
                self.actors.append(remote_cls.options(**opts).remote(rank, world_size, **(init_kwargs or {})))
            address, port = self._wait([self.actors[0].rendezvous_address.remote()], "rendezvous_address", [0])[0]
            if local if local is not None else not os.environ.get("RAY_ADDRESS"):
                address = "127.0.0.1"  # a local Ray: rendezvous over loopback only
            self.master_addr, self.master_port = address, port
            self.call_all("set_rendezvous", address, port)
        except BaseException:
            self.shutdown()
            raise

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
    ) -> list[Any]:
        """Call ``method`` on every rank with that rank's own arguments; results in rank order."""
        if not self._alive:
            raise WorkerError(f"the worker group was shut down; cannot call {method!r}", method=method)
        if len(args_per_rank) != self.world_size:
            raise ValueError(f"{method}: got arguments for {len(args_per_rank)} ranks, the group has {self.world_size}")
        kwargs_per_rank = kwargs_per_rank or [{}] * self.world_size
        refs = [
            getattr(actor, method).remote(*a, **kw) for actor, a, kw in zip(self.actors, args_per_rank, kwargs_per_rank)
        ]
        return self._wait(refs, method, list(range(self.world_size)), timeout_s)

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
                    raise WorkerError(
                        f"{method!r} did not finish within {timeout_s:.0f}s on worker rank(s) {waiting} "
                        f"(trainer.worker_timeout_s); the group was torn down",
                        rank=waiting[0],
                        method=method,
                    )
                ready, pending = ray.wait(pending, num_returns=1, timeout=min(remaining, 5.0))
                for ref in ready:
                    rank = rank_of[ref]
                    try:
                        results[rank] = ray.get(ref, timeout=max(1.0, deadline - time.monotonic()))
                    except RayTaskError as err:
                        cause = err.cause if isinstance(err.cause, BaseException) else None
                        raise WorkerError(
                            f"worker rank {rank} failed in {method!r}: "
                            f"{type(cause).__name__ if cause else 'error'}: {cause}\n"
                            f"--- worker rank {rank} traceback ---\n{_strip_ansi(str(err))}",
                            rank=rank,
                            method=method,
                        ) from cause
                    except RayActorError as err:
                        raise WorkerError(
                            f"worker rank {rank} died during {method!r} (process exited or was killed): {err}",
                            rank=rank,
                            method=method,
                        ) from None
                    except GetTimeoutError:
                        raise WorkerError(f"{method!r} on worker rank {rank} timed out", rank=rank, method=method)
        except BaseException:
            self.shutdown()
            raise
        return [results[r] for r in ranks]

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
