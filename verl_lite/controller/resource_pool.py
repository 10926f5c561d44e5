"""Reserving one bundle of resources per worker rank (Ray itself is started by ``local_ray``).

:class:`ResourcePool` places ``world_size`` worker ranks: one GPU per rank when GPUs exist,
otherwise a fraction of a CPU, so that 4-8 workers fit on a 2-core machine (Ray resources are
logical; the workers then share the cores).

- ``nnodes == 1``: one placement group with one bundle per rank, packed on as few nodes as
  possible (``PACK``).
- ``nnodes > 1`` (``trainer.nnodes``): as verl does, ``world_size / nnodes`` ranks on each of
  ``nnodes`` distinct nodes. One placement group with one bundle per NODE (``STRICT_SPREAD``: no two
  bundles share a node), each holding that node's ranks' resources; rank ``r`` runs on bundle
  ``r // ranks_per_node``, so ranks are ordered node by node (ranks 0..G-1 on the first node, G..2G-1
  on the second, ...) and rank 0's node is the rendezvous node (``WorkerGroup``).

:meth:`ResourcePool.node_of` says which Ray node (id, address) a rank runs on; the worker group
uses it to name the node, and the roles it hosted, when a node is lost.
"""

from __future__ import annotations

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from verl_lite.controller.local_ray import started_locally
from verl_lite.errors import RunFailure


class ClusterTooSmall(RunFailure, RuntimeError):
    """The Ray cluster has fewer nodes or resources than the job's placement asks for (exit 1, one line)."""


def cluster_has_gpus() -> bool:
    return ray.cluster_resources().get("GPU", 0) >= 1


def alive_nodes() -> list[dict]:
    """``ray.nodes()`` entries of the nodes that are alive now."""
    return [n for n in ray.nodes() if n.get("Alive")]


def node_address(node_id: str) -> str | None:
    """The address (``NodeManagerAddress``) of Ray node ``node_id``, dead or alive (None if unknown)."""
    for n in ray.nodes():
        if n.get("NodeID") == node_id:
            return n.get("NodeManagerAddress")
    return None


def node_alive(node_id: str) -> bool:
    """Whether Ray reports node ``node_id`` alive (an unknown node counts as dead)."""
    return any(n.get("NodeID") == node_id and n.get("Alive") for n in ray.nodes())


def shortfall(bundles: list[dict], nodes: list[dict]) -> str | None:
    """Why ``bundles`` can never be reserved on ``nodes`` as they are now (None if they might): a resource
    asked for in all beyond the nodes' total, or one bundle beyond the largest node's."""
    totals: dict[str, float] = {}
    for n in nodes:
        for k, v in n.get("Resources", {}).items():
            totals[k] = totals.get(k, 0.0) + v
    for k in sorted({k for b in bundles for k in b}):
        asked = sum(b.get(k, 0.0) for b in bundles)
        if asked > totals.get(k, 0.0) + 1e-9:
            return f"{asked:g} {k} asked for, the cluster has {totals.get(k, 0.0):g}"
        largest = max((n.get("Resources", {}).get(k, 0.0) for n in nodes), default=0.0)
        biggest = max(b.get(k, 0.0) for b in bundles)
        if biggest > largest + 1e-9:
            return f"one bundle asks for {biggest:g} {k}, the largest node has {largest:g}"
    return None


def _cpu_share(cpus: float, ranks: int) -> float:
    """A rank's CPU on a node of ``cpus`` CPUs holding ``ranks`` ranks: at most 1, rounded down to 1/100
    so the bundles always fit."""
    return max(0.01, min(1.0, int(100 * cpus / ranks) / 100))


class ResourcePool:
    """``world_size`` ranks on ``nnodes`` nodes; see the module docstring."""

    def __init__(self, world_size: int, use_gpu: bool | None = None, timeout_s: float = 120.0, nnodes: int = 1):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if nnodes < 1 or world_size % nnodes:
            raise ValueError(f"{world_size} workers cannot be split evenly over trainer.nnodes={nnodes} nodes")
        self.world_size, self.nnodes = world_size, nnodes
        self.ranks_per_node = world_size // nnodes if nnodes > 1 else world_size
        self.use_gpu = cluster_has_gpus() if use_gpu is None else use_gpu
        nodes = alive_nodes()
        if nnodes > len(nodes):
            raise ClusterTooSmall(
                f"trainer.nnodes={nnodes} but the Ray cluster has {len(nodes)} alive node(s); start Ray on every "
                f"node (docs/cluster.md) or lower trainer.nnodes")
        if self.use_gpu:
            self.rank_resources = {"CPU": 1.0, "GPU": 1.0}
        elif nnodes == 1:
            self.rank_resources = {"CPU": _cpu_share(ray.cluster_resources().get("CPU", 1.0), world_size)}
        else:  # every node must hold its ranks: size them by the smallest of the nodes that can be chosen
            cpus = sorted((n.get("Resources", {}).get("CPU", 0.0) for n in nodes), reverse=True)[nnodes - 1]
            self.rank_resources = {"CPU": _cpu_share(max(cpus, 0.01), self.ranks_per_node)}
        self.bundle = dict(self.rank_resources)  # one rank's resources (the name older callers read)
        if nnodes == 1:
            bundles, strategy = [dict(self.rank_resources) for _ in range(world_size)], "PACK"
        else:
            per_node = {k: v * self.ranks_per_node for k, v in self.rank_resources.items()}
            bundles, strategy = [dict(per_node) for _ in range(nnodes)], "STRICT_SPREAD"
        short = shortfall(bundles, nodes)
        if short and started_locally():  # a Ray this process started cannot grow: waiting cannot help
            raise ClusterTooSmall(
                f"cannot reserve {world_size} x {self.rank_resources} in the local Ray: {short}; use fewer workers "
                f"(trainer.n_gpus_per_node, and actor_rollout_ref.rollout.n_gpus_per_node where "
                f"actor_rollout_ref.hybrid_engine=false) or a bigger machine")
        self.placement_group = placement_group(bundles, strategy=strategy)
        try:
            ray.get(self.placement_group.ready(), timeout=timeout_s)
        except Exception as err:
            remove_placement_group(self.placement_group)
            where = f" on {nnodes} distinct nodes" if nnodes > 1 else ""
            raise ClusterTooSmall(
                f"could not reserve {world_size} x {self.rank_resources}{where} in the Ray cluster within "
                f"{timeout_s}s (cluster has {ray.cluster_resources()} on {len(nodes)} node(s)); use fewer workers "
                f"or a bigger cluster"
            ) from err
        self._bundle_nodes = placement_group_table(self.placement_group).get("bundles_to_node_id", {})
        self._roles: dict[str, tuple[int, int]] = {}  # role -> (first pool rank, number of ranks)

    def place(self, role: str, first_rank: int, world_size: int) -> None:
        """Record that ``role``'s ranks 0..world_size-1 run on pool ranks ``first_rank``... (for :meth:`roles_on`)."""
        if first_rank < 0 or first_rank + world_size > self.world_size:
            raise ValueError(f"{role}: pool ranks {first_rank}..{first_rank + world_size - 1} are outside the pool's "
                             f"{self.world_size} ranks")
        self._roles[role] = (first_rank, world_size)

    def roles_on(self, node_id: str) -> dict[str, list[int]]:
        """role -> its ranks placed on node ``node_id`` (roles with none left out)."""
        out = {}
        for role, (first, n) in self._roles.items():
            ranks = [r for r in range(n) if self.node_of(first + r) == node_id]
            if ranks:
                out[role] = ranks
        return out

    def bundle_index(self, rank: int) -> int:
        """The placement-group bundle rank ``rank`` runs on."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the pool's {self.world_size} ranks")
        return rank // self.ranks_per_node if self.nnodes > 1 else rank

    def node_of(self, rank: int) -> str | None:
        """The Ray node id rank ``rank`` is placed on (None if Ray does not say)."""
        return self._bundle_nodes.get(self.bundle_index(rank))

    def actor_options(self, rank: int, share: float = 1.0) -> dict:
        """``ray.remote(...).options(**)`` that place rank ``rank`` on its bundle, taking ``share``
        of its resources (0 < share <= 1: roles colocated on one rank split it)."""
        if not 0 < share <= 1:
            raise ValueError(f"share must lie in (0, 1], got {share}")
        return dict(
            num_cpus=self.rank_resources["CPU"] * share,
            num_gpus=self.rank_resources.get("GPU", 0) * share,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.placement_group, placement_group_bundle_index=self.bundle_index(rank)
            ),
        )

    def remove(self) -> None:
        try:
            remove_placement_group(self.placement_group)
        except Exception:  # Ray already shut down
            pass
