"""Reserving one bundle of resources per worker rank (Ray itself is started by ``local_ray``).

:class:`ResourcePool` is a placement group with one bundle per rank: one GPU per bundle when
GPUs exist, otherwise a fraction of a CPU, so that 4-8 workers fit on a 2-core machine (Ray
resources are logical; the workers then share the cores).
"""

from __future__ import annotations

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


def cluster_has_gpus() -> bool:
    return ray.cluster_resources().get("GPU", 0) >= 1


class ResourcePool:
    """One placement-group bundle per worker rank, packed on as few nodes as possible."""

    def __init__(self, world_size: int, use_gpu: bool | None = None, timeout_s: float = 120.0):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self.use_gpu = cluster_has_gpus() if use_gpu is None else use_gpu
        if self.use_gpu:
            self.bundle = {"CPU": 1.0, "GPU": 1.0}
        else:
            cpus = ray.cluster_resources().get("CPU", 1.0)
            # Round down to a multiple of 1/100 so the bundles always fit.
            self.bundle = {"CPU": max(0.01, min(1.0, int(100 * cpus / world_size) / 100))}
        self.placement_group = placement_group([dict(self.bundle) for _ in range(world_size)], strategy="PACK")
        try:
            ray.get(self.placement_group.ready(), timeout=timeout_s)
        except Exception as err:
            remove_placement_group(self.placement_group)
            raise RuntimeError(
                f"could not reserve {world_size} x {self.bundle} in the Ray cluster within {timeout_s}s "
                f"(cluster has {ray.cluster_resources()}); use fewer workers or a bigger cluster"
            ) from err

    def actor_options(self, rank: int, share: float = 1.0) -> dict:
        """``ray.remote(...).options(**)`` that place rank ``rank`` on its bundle, taking ``share``
        of it (0 < share <= 1: roles colocated on one bundle split it)."""
        if not 0 < share <= 1:
            raise ValueError(f"share must lie in (0, 1], got {share}")
        return dict(
            num_cpus=self.bundle["CPU"] * share,
            num_gpus=self.bundle.get("GPU", 0) * share,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                self.placement_group, placement_group_bundle_index=rank
            ),
        )

    def remove(self) -> None:
        try:
            remove_placement_group(self.placement_group)
        except Exception:  # Ray already shut down
            pass
