"""The ``async_training`` section (the rollout/training pipeline of split placement) and the placement rules
(``actor_rollout_ref.hybrid_engine``, the rollout pool, ``trainer.nnodes``): fields, defaults and rules, stated
once here. One line per problem, naming the key and the fix."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Optional

TRAINER_MODES = ("sync", "colocate_async", "separate_async")  # verl's trainer.v1.trainer_mode values
STREAMED_MODES = ("colocate_async", "separate_async")  # the trajectory stream (controller/stream.py) runs
OFF_POLICY_STRATEGIES = ("drop", "wait")


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
class V1SamplerConfig:
    """``trainer.v1.sampler`` (verl's v1 trainer). A trajectory's age at training is the steps since its prompt was
    submitted, plus one; here the schedule never submits a prompt that would pass the bound, so ``drop`` evicts
    nothing and ``wait`` never waits beyond the schedule (both accepted, the bound enforced either way)."""

    max_off_policy_threshold: int = 8  # policy versions a trained trajectory may span since its prompt was submitted
    max_off_policy_strategy: str = "drop"  # drop | wait (verl's meanings; see the class docstring)


@dataclass
class SeparateAsyncConfig:
    """``trainer.v1.separate_async``: rollout workers of their own, running ``num_warmup_batches`` ahead."""

    num_warmup_batches: int = 1  # batches generated ahead of the trainer: the policy lag (async_training.staleness_threshold)
    parameter_sync_step: Optional[int] = None  # mini-batches per step (one weight sync per step); null = train_batch_size / ppo_mini_batch_size


@dataclass
class ColocateAsyncConfig:
    """``trainer.v1.colocate_async``: the actor's own workers stream trajectories ``num_warmup_batches`` ahead,
    paused while their engine computes (docs/async.md, "Colocated streaming")."""

    num_warmup_batches: int = 1  # batches of prompt groups in flight ahead of the trainer (as separate_async's)


@dataclass
class V1Config:
    """verl's ``trainer.v1`` section: which of the pipeline's settings a verl v1 script asks for."""

    trainer_mode: str = "sync"  # sync (rollout and training take turns) | colocate_async (the actor's workers stream ahead, paused while they train) | separate_async (a rollout pool streaming ahead)
    sampler: V1SamplerConfig = field(default_factory=V1SamplerConfig)
    colocate_async: ColocateAsyncConfig = field(default_factory=ColocateAsyncConfig)
    separate_async: SeparateAsyncConfig = field(default_factory=SeparateAsyncConfig)

    def warmup_batches(self) -> int:
        """Batches of prompt groups the stream runs ahead of the trainer (0 when it does not stream)."""
        mode = {"colocate_async": self.colocate_async, "separate_async": self.separate_async}.get(self.trainer_mode)
        return 0 if mode is None else mode.num_warmup_batches

    def problems(self, data, actor, rollout) -> list[str]:
        K, out = "trainer.v1", []
        if self.trainer_mode not in TRAINER_MODES:
            out.append(f"{K}.trainer_mode={self.trainer_mode!r} is unknown; choose one of {list(TRAINER_MODES)}")
        sampler = self.sampler
        if not (isinstance(sampler.max_off_policy_threshold, int) and sampler.max_off_policy_threshold > 0):
            out.append(f"{K}.sampler.max_off_policy_threshold={sampler.max_off_policy_threshold} must be an integer > 0")
        if sampler.max_off_policy_strategy not in OFF_POLICY_STRATEGIES:
            out.append(f"{K}.sampler.max_off_policy_strategy={sampler.max_off_policy_strategy!r} is unknown; choose "
                       f"one of {list(OFF_POLICY_STRATEGIES)}")
        if self.trainer_mode == "colocate_async" and rollout.batch_invariant:
            out.append(f"{K}.trainer_mode=colocate_async with actor_rollout_ref.rollout.batch_invariant=true: the "
                       f"actor's engine would generate beside its own updates, a collective call per rank; use sync")
        if self.trainer_mode not in STREAMED_MODES:
            return out
        sa, S = getattr(self, self.trainer_mode), f"{K}.{self.trainer_mode}"
        if not (isinstance(sa.num_warmup_batches, int) and sa.num_warmup_batches >= 0):
            out.append(f"{S}.num_warmup_batches={sa.num_warmup_batches} must be an integer >= 0")
        elif isinstance(sampler.max_off_policy_threshold, int) and sa.num_warmup_batches + 1 > sampler.max_off_policy_threshold:
            out.append(f"{S}.num_warmup_batches={sa.num_warmup_batches}: batches that far ahead are trained "
                       f"{sa.num_warmup_batches + 1} versions after their prompts were submitted, past "
                       f"{K}.sampler.max_off_policy_threshold={sampler.max_off_policy_threshold}; lower the first or "
                       f"raise the second")
        step = getattr(sa, "parameter_sync_step", None)
        if step is not None and data.train_batch_size != step * actor.ppo_mini_batch_size:
            out.append(f"{S}.parameter_sync_step={step}: data.train_batch_size={data.train_batch_size} must equal "
                       f"parameter_sync_step x actor_rollout_ref.actor.ppo_mini_batch_size={actor.ppo_mini_batch_size} "
                       f"(verl's rule: one weight sync per step of parameter_sync_step mini-batches)")
        return out


def resolve_placement(cfg) -> None:
    """The placement and the policy lag a config asks for, set in place (idempotent); the one rule for both:
    ``trainer.v1.trainer_mode=separate_async``: rollout workers of their own (``hybrid_engine=false``), lag
    ``trainer.v1.separate_async.num_warmup_batches``; ``colocate_async``: the actor's workers (``hybrid_engine=true``),
    lag ``trainer.v1.colocate_async.num_warmup_batches``; ``actor_rollout_ref.hybrid_engine=false`` alone: verl's
    one-step-off recipe, lag 1; otherwise colocated and synchronous, lag 0. An explicit
    ``async_training.staleness_threshold`` wins over the derived lag."""
    v1, at = cfg.trainer.v1, cfg.async_training
    if v1.trainer_mode in STREAMED_MODES:
        cfg.actor_rollout_ref.hybrid_engine = v1.trainer_mode == "colocate_async"
    if at.staleness_threshold is None:
        if v1.trainer_mode in STREAMED_MODES:
            at.staleness_threshold = v1.warmup_batches()
        else:
            at.staleness_threshold = 0 if cfg.actor_rollout_ref.hybrid_engine else 1


@dataclass
class AsyncTrainingConfig:
    """The rollout/training pipeline of split placement (hybrid_engine=false; docs/async.md)."""

    staleness_threshold: Optional[int] = None  # policy versions a trained batch lags: 0 = synchronous, 1 = one-step-off; null = from the placement (resolve_placement)
    weight_sync_timeout_s: float = 120.0  # bound on one actor -> rollout weight sync (export + load on every rollout worker)
    queue_timeout_s: float = 1800.0  # bound on the trainer's wait for the next rollout batch (a starving queue stops the run)
    partial_rollout: Optional[bool] = None  # null = the setting's own: streaming (separate_async) continues running trajectories on new weights (true), one-step-off generates whole batches (false); the other value is refused

    def problems(self, arr, alg, trainer_mode: str = "sync") -> list[str]:
        """This section with the placement it needs: ``arr`` = the ``actor_rollout_ref`` section, ``alg`` = the
        ``algorithm`` section (what split placement does not build), ``trainer_mode`` = ``trainer.v1.trainer_mode``."""
        R, K = "actor_rollout_ref.rollout", "async_training"
        out: list[str] = []
        streamed = trainer_mode in STREAMED_MODES
        if self.partial_rollout is True and not streamed:
            out.append(f"{K}.partial_rollout=true: the one-step-off schedule generates every batch whole by one policy "
                       f"version; partial rollouts (weights landing while a trajectory runs) are the streamed modes' "
                       f"(trainer.v1.trainer_mode=colocate_async or separate_async): use one, or drop this key")
        if self.partial_rollout is False and streamed:
            out.append(f"{K}.partial_rollout=false: streaming (trainer.v1.trainer_mode={trainer_mode}) always continues "
                       f"running trajectories on the new weights; holding each weight sync until every running "
                       f"trajectory has finished is not built: drop this key")
        if isinstance(self.staleness_threshold, float) and 0 < self.staleness_threshold < 1:
            out.append(f"{K}.staleness_threshold={self.staleness_threshold}: here it counts policy versions (an integer "
                       f">= 0: 0 = synchronous, 1 = one-step-off); verl's fully_async recipe uses this key for a share of "
                       f"extra samples, a different meaning: use trainer.v1.trainer_mode=separate_async with "
                       f"trainer.v1.sampler.max_off_policy_threshold, or an integer lag")
        elif self.staleness_threshold is not None and (not isinstance(self.staleness_threshold, int)
                                                       or self.staleness_threshold < 0):
            out.append(f"{K}.staleness_threshold={self.staleness_threshold} must be an integer >= 0 (0 = synchronous, "
                       f"1 = one-step-off)")
        for key in ("weight_sync_timeout_s", "queue_timeout_s"):
            if not getattr(self, key) > 0:
                out.append(f"{K}.{key}={getattr(self, key)} must be > 0 (seconds)")
        for key in ("n_gpus_per_node", "nnodes"):
            if not isinstance(getattr(arr.rollout, key), int) or getattr(arr.rollout, key) < 1:
                out.append(f"{R}.{key}={getattr(arr.rollout, key)} must be an integer >= 1")
        if trainer_mode == "colocate_async" and alg.adv_estimator == "remax":
            out.append("algorithm.adv_estimator=remax with trainer.v1.trainer_mode=colocate_async: its greedy baseline "
                       "must come from the batch's own policy version; use sync")
        if arr.hybrid_engine:
            if self.staleness_threshold and trainer_mode != "colocate_async":
                out.append(f"{K}.staleness_threshold={self.staleness_threshold} needs rollout workers of their own: "
                           f"set actor_rollout_ref.hybrid_engine=false, or stream on the actor's workers "
                           f"(trainer.v1.trainer_mode=colocate_async)")
            return out
        if arr.rollout.nnodes > 1:
            out.append(f"{R}.nnodes={arr.rollout.nnodes}: a rollout pool spanning nodes is not built; use 1")
        why = "is not built with split placement (actor_rollout_ref.hybrid_engine=false)"
        if alg.filter_groups.enable and trainer_mode != "separate_async":
            out.append(f"algorithm.filter_groups.enable=true (DAPO dynamic sampling) {why} on the one-step-off "
                       f"schedule (its extra generation rounds depend on the step's scores): set hybrid_engine=true, "
                       f"or stream (trainer.v1.trainer_mode=separate_async), which takes further complete groups")
        if alg.adv_estimator == "remax":
            out.append(f"algorithm.adv_estimator=remax {why}: its greedy baseline must come from the batch's own "
                       f"policy version; set hybrid_engine=true")
        return out
