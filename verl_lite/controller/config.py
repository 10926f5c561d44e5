"""The ``async_training`` section (the rollout/training pipeline of split placement) and the placement rules
(``actor_rollout_ref.hybrid_engine``, the rollout pool, ``trainer.nnodes``): fields, defaults and rules, stated
once here. One line per problem, naming the key and the fix."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass


def placement_problems(nnodes) -> list[str]:
    """``trainer.nnodes`` > 1 needs a cluster to join: without ``RAY_ADDRESS`` (and no Ray already connected
    in this process) the driver starts a local Ray, which is one node."""
    ray = sys.modules.get("ray")
    joined = os.environ.get("RAY_ADDRESS") or (ray is not None and ray.is_initialized())
    if isinstance(nnodes, int) and nnodes > 1 and not joined:
        return [f"trainer.nnodes={nnodes} needs a Ray cluster of {nnodes} nodes, but RAY_ADDRESS is not set, so the "
                f"driver would start a local Ray of one node; start Ray on every node and set RAY_ADDRESS to the "
                f"head (or submit with `ray job submit`, docs/cluster.md), or use trainer.nnodes=1"]
    return []


@dataclass
class AsyncTrainingConfig:
    """The rollout/training pipeline of split placement (hybrid_engine=false; docs/async.md)."""

    staleness_threshold: int = 0  # policy versions a trained batch may lag: 0 = synchronous, 1 = one-step-off, k bounds the lag
    weight_sync_timeout_s: float = 120.0  # bound on one actor -> rollout weight sync (export + load on every rollout worker)
    queue_timeout_s: float = 1800.0  # bound on the trainer's wait for the next rollout batch (a starving queue stops the run)
    partial_rollout: bool = False  # continue generations interrupted by a weight update: not built (true is rejected)

    def problems(self, arr, alg) -> list[str]:
        """This section with the placement it needs: ``arr`` = the ``actor_rollout_ref`` section, ``alg`` = the
        ``algorithm`` section (what split placement does not build)."""
        R, K = "actor_rollout_ref.rollout", "async_training"
        out: list[str] = []
        if self.partial_rollout:
            out.append(f"{K}.partial_rollout=true: continuing a generation interrupted by a weight update is not "
                       f"built; every batch is generated whole by one policy version (set it false)")
        if not isinstance(self.staleness_threshold, int) or self.staleness_threshold < 0:
            out.append(f"{K}.staleness_threshold={self.staleness_threshold} must be an integer >= 0 (0 = synchronous, "
                       f"1 = one-step-off)")
        for key in ("weight_sync_timeout_s", "queue_timeout_s"):
            if not getattr(self, key) > 0:
                out.append(f"{K}.{key}={getattr(self, key)} must be > 0 (seconds)")
        for key in ("n_gpus_per_node", "nnodes"):
            if not isinstance(getattr(arr.rollout, key), int) or getattr(arr.rollout, key) < 1:
                out.append(f"{R}.{key}={getattr(arr.rollout, key)} must be an integer >= 1")
        if arr.hybrid_engine:
            if self.staleness_threshold:
                out.append(f"{K}.staleness_threshold={self.staleness_threshold} needs rollout workers of their own: "
                           f"set actor_rollout_ref.hybrid_engine=false (colocated rollout and training cannot overlap)")
            return out
        if arr.rollout.nnodes > 1:
            out.append(f"{R}.nnodes={arr.rollout.nnodes}: a rollout pool spanning nodes is not built; use 1")
        why = "is not built with split placement (actor_rollout_ref.hybrid_engine=false)"
        if arr.rollout.multi_turn.enable:
            out.append(f"{R}.multi_turn.enable=true {why}: agent loops run on the colocated rollout; set "
                       f"hybrid_engine=true")
        if alg.filter_groups.enable:
            out.append(f"algorithm.filter_groups.enable=true (DAPO dynamic sampling) {why}: its extra generation "
                       f"rounds depend on the step's scores; set hybrid_engine=true")
        if alg.adv_estimator == "remax":
            out.append(f"algorithm.adv_estimator=remax {why}: its greedy baseline must come from the batch's own "
                       f"policy version; set hybrid_engine=true")
        return out
