"""Ray resources for every worker rank: one GPU when the cluster has GPUs, otherwise a share of a CPU (Ray
resources are logical: 4-8 workers share a 2-core machine's cores).

``nnodes == 1``: one bundle per rank, packed on as few nodes as possible. ``nnodes > 1`` (``trainer.nnodes``):
as verl does, G = ``world_size / nnodes`` ranks on each of ``nnodes`` distinct nodes, one bundle per NODE
(``STRICT_SPREAD``), rank ``r`` on bundle ``r // G``, so rank 0's node is the rendezvous node.
:meth:`ResourcePool.node_of` / :meth:`ResourcePool.roles_on` name a lost node's ranks and roles.
"""

from __future__ import annotations

import contextlib

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from verl_lite.controller.local_ray import started_locally
from verl_lite.errors import RunFailure


class ClusterTooSmall(RunFailure, RuntimeError):
    """The Ray cluster has fewer nodes or resources than the job's placement asks for (exit 1, one line)."""


def node_address(node_id: str) -> str | None:
    """The address (``NodeManagerAddress``) of Ray node ``node_id``, dead or alive (None if unknown)."""
    return next((n.get("NodeManagerAddress") for n in ray.nodes() if n.get("NodeID") == node_id), None)


def shortfall(bundles: list[dict], nodes: list[dict]) -> str | None:
    """Why ``bundles`` can never be reserved on ``nodes`` as they are now (None if they might): a resource
    asked for in all beyond the nodes' total, or one bundle beyond the largest node's."""
    for k in sorted({k for b in bundles for k in b}):
        asked, total = sum(b.get(k, 0.0) for b in bundles), sum(n.get("Resources", {}).get(k, 0.0) for n in nodes)
        if asked > total + 1e-9:
            return f"{asked:g} {k} asked for, the cluster has {total:g}"
        largest = max((n.get("Resources", {}).get(k, 0.0) for n in nodes), default=0.0)
        biggest = max(b.get(k, 0.0) for b in bundles)
        if biggest > largest + 1e-9:
            return f"one bundle asks for {biggest:g} {k}, the largest node has {largest:g}"
    return None


def _cpu_share(cpus: float, ranks: int) -> float:
    """A rank's CPU on a node of ``cpus`` CPUs for ``ranks`` ranks: at most 1, rounded down to 1/100 (to fit)."""
    return max(0.01, min(1.0, int(100 * cpus / ranks) / 100))


class ResourcePool:
    """``world_size`` ranks on ``nnodes`` nodes; see the module docstring."""

    def __init__(self, world_size: int, use_gpu: bool | None = None, timeout_s: float = 120.0, nnodes: int = 1):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if nnodes < 1 or world_size % nnodes:
            raise ValueError(f"{world_size} workers cannot be split evenly over trainer.nnodes={nnodes} nodes")
        self.world_size = world_size
        self._ranks_per_bundle = world_size // nnodes if nnodes > 1 else 1  # a bundle per node, or per rank
        self.use_gpu = ray.cluster_resources().get("GPU", 0) >= 1 if use_gpu is None else use_gpu
        nodes = [n for n in ray.nodes() if n.get("Alive")]
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
            self.rank_resources = {"CPU": _cpu_share(max(cpus, 0.01), self._ranks_per_bundle)}
        bundle = {k: v * self._ranks_per_bundle for k, v in self.rank_resources.items()}
        bundles = [dict(bundle) for _ in range(world_size // self._ranks_per_bundle)]
        short = shortfall(bundles, nodes)
        if short and started_locally():  # a Ray this process started cannot grow: waiting cannot help
            raise ClusterTooSmall(
                f"cannot reserve {world_size} x {self.rank_resources} in the local Ray: {short}; use fewer workers "
                f"(trainer.n_gpus_per_node, and actor_rollout_ref.rollout.n_gpus_per_node where "
                f"actor_rollout_ref.hybrid_engine=false) or a bigger machine")
        self.placement_group = placement_group(bundles, strategy="STRICT_SPREAD" if nnodes > 1 else "PACK")
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
        ranks = {role: [r for r in range(n) if self.node_of(first + r) == node_id]
                 for role, (first, n) in self._roles.items()}
        return {role: r for role, r in ranks.items() if r}

    def bundle_index(self, rank: int) -> int:
        """The placement-group bundle rank ``rank`` runs on."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the pool's {self.world_size} ranks")
        return rank // self._ranks_per_bundle

    def node_of(self, rank: int) -> str | None:
        """The Ray node id rank ``rank`` is placed on (None if Ray does not say)."""
        return self._bundle_nodes.get(self.bundle_index(rank))

    def actor_options(self, rank: int, share: float = 1.0) -> dict:
        """``ray.remote(...).options(**)`` that place rank ``rank`` on its bundle, taking ``share`` of its
        resources (0 < share <= 1: roles colocated on one rank split it)."""
        if not 0 < share <= 1:
            raise ValueError(f"share must lie in (0, 1], got {share}")
        return dict(num_cpus=self.rank_resources["CPU"] * share, num_gpus=self.rank_resources.get("GPU", 0) * share,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self.placement_group, placement_group_bundle_index=self.bundle_index(rank)))

    def remove(self) -> None:
        with contextlib.suppress(Exception):  # Ray already shut down
            remove_placement_group(self.placement_group)
