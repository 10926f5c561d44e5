"""Where a step's rollouts come from: a *rollout source*, one interface for every setting, so the step never asks
which one runs (docs/async.md):

    batch, scores, extra = source.next(step, batches, metrics)    # the step's rollouts, scored
    source.after_update(step, metrics)                            # the actor was updated
    source.checkpoint_state(step)                                 # what a checkpoint saves of it (or None)
    source.close()

``open_rollout_source`` picks ``ColocatedRollouts`` (synchronous), ``PipelinedRollouts`` (one-step-off, a fixed
schedule), ``StreamedRollouts`` (``trainer.v1.trainer_mode=separate_async``, partial rollouts) or
``ColocatedStreamedRollouts`` (``colocate_async``: the same stream on the actor's workers).
"""

from __future__ import annotations

import time
from typing import Iterator

import torch

from verl_lite.agent.loop import AgentSpec, agent_rows
from verl_lite.agent.preflight import multi_turn_values
from verl_lite.controller import RoleGroup
from verl_lite.controller.pipeline import PipelineError, RolloutItem, RolloutPipeline
from verl_lite.controller.stream import StreamingPipeline, off_policy_metrics
from verl_lite.controller.worker_group import WorkerError
from verl_lite.protocol import Batch
from verl_lite.rollout.buckets import bucket_bytes_of
from verl_lite.trainer import metrics as M
from verl_lite.trainer.rollout_stage import Rollouts, round_uid_prefix
from verl_lite.utils.seeds import rollout_seed, stream_group_seed


class RolloutSource:
    """The interface (module docstring); by default nothing is sent after an update, a checkpoint saves nothing
    of the source and nothing runs between steps."""

    def __init__(self, rollouts: Rollouts):
        self.rollouts = rollouts

    def after_update(self, step: int, m: dict) -> None:
        pass

    def checkpoint_state(self, step: int) -> dict | None:
        return None

    def close(self) -> None:
        pass


class ColocatedRollouts(RolloutSource):
    """The actor's workers sample each step's rollouts from the next prompt batch of ``batches`` (DAPO's dynamic
    sampling pulls further ones); each worker reloads its rollout from its actor as it next samples."""

    def next(self, step: int, batches: Iterator[list[dict]], m: dict) -> tuple[Batch, torch.Tensor, dict]:
        return self.rollouts.generate_and_score(next(batches), lambda: next(batches), m, step)


class _PoolRollouts(RolloutSource):
    """A source over a rollout pool: each updated policy is exported once into Ray's object store and published
    to ``pipeline``, which loads it into every rollout worker; each weight call is bounded by
    ``async_training.weight_sync_timeout_s`` (else one PipelineError)."""

    def __init__(self, rollouts: Rollouts):
        super().__init__(rollouts)
        self.placement, self.cfg = rollouts.placement, rollouts.cfg
        self.bound = self.cfg.async_training.weight_sync_timeout_s
        self.export_s = self.load_s = 0.0  # the latest export's and the latest completed load's wall seconds

    def _publish(self, version: int, step: int) -> int:
        """Policy ``version``: the actor's weights after ``step`` RL steps, in the buckets its rank 0 put into the
        object store (``rollout.checkpoint_engine``); returns their bytes."""
        engine, started = self.cfg.actor_rollout_ref.rollout.checkpoint_engine, time.perf_counter()
        refs, nbytes = self._call(self.placement.actor, f"step {step + 1}: exporting the actor's weights for the "
                                  "rollout pool", "export_rollout_weights",
                                  bucket_bytes_of(engine.update_weights_bucket_megabytes))[0]
        self.export_s = time.perf_counter() - started
        self.pipeline.publish(version, refs)
        return nbytes

    def _load(self, weights, version: int) -> None:
        """Policy ``version`` into every rollout worker (the pipeline calls it; in the stream's publish, in the
        one-step-off pipeline's thread)."""
        started = time.perf_counter()
        self._call(self.placement.rollout, f"the weight sync of policy version {version} to the rollout pool",
                   "load_weights", weights, version)
        self.load_s = time.perf_counter() - started

    def _call(self, role: RoleGroup, what: str, method: str, *args) -> list:
        try:
            return role.call_all(method, *args, timeout_s=self.bound)
        except WorkerError as err:
            raise PipelineError(f"{what} failed or did not finish within async_training.weight_sync_timeout_s="
                                f"{self.bound:g}s ({err})",
                                "raise async_training.weight_sync_timeout_s, or check the rollout workers") from err

    def after_update(self, step: int, m: dict) -> None:
        """Policy version ``step + 1`` to the pipeline (a stream's running trajectories go on with it). Metrics:
        the policy's bytes, the export's seconds, the latest completed load's (into every rollout worker) and the
        bytes per second of the two together."""
        with M.timer(m, "sync_weights"):
            nbytes = self._publish(step + 1, step)
        m.update({"perf/weight_sync_bytes": nbytes, "perf/weight_sync_export_s": self.export_s,
                  "perf/weight_sync_load_s": self.load_s,
                  "perf/weight_sync_gb_per_s": nbytes / 1e9 / max(self.export_s + self.load_s, 1e-9)})


class PipelinedRollouts(_PoolRollouts):
    """Split placement (``hybrid_engine=false``): the rollout pool samples ahead of the trainer, at most
    ``async_training.staleness_threshold`` policy versions behind (``controller.pipeline``); the driver scores
    each batch as the step takes it; the pipeline loads a policy before the first batch that version samples."""

    def __init__(self, rollouts: Rollouts, batches: Iterator[list[dict]], step: int, total_steps: int,
                 resumed_state: dict | None):
        """From RL step ``step`` over the data cursor ``batches``; resumed: the checkpoint's in-flight batches first."""
        super().__init__(rollouts)
        a = self.cfg.async_training
        self.pipeline = RolloutPipeline(
            self._generate, self._load, lambda: next(batches), staleness=a.staleness_threshold,
            queue_timeout_s=a.queue_timeout_s, first_index=step, end_index=total_steps,
            loaded_version=None if step > 0 else 0, ready=(resumed_state or {}).get("in_flight", []))
        if step > 0:
            self._publish(step, step)
        self.pipeline.start()

    def next(self, step: int, batches, m: dict) -> tuple[Batch, torch.Tensor, dict]:
        """Step ``step``'s batch (generated already, tagged with its policy version), scored here."""
        item = self.pipeline.next(step)
        scores, extra = self.rollouts.shaped_scores(item.batch, m, step)
        m.update(item.metrics)
        return item.batch, scores, extra

    def checkpoint_state(self, step: int) -> dict:
        """The policy version and the batches generated ahead (sampled by older versions: saved, not regenerated)."""
        return {"policy_version": step, "in_flight": self.pipeline.in_flight()}

    def close(self) -> None:
        self.pipeline.close()

    def _generate(self, rows: list[dict], step: int) -> Batch:
        """The rollouts of RL step ``step`` on the rollout pool (the pipeline's thread calls it)."""
        r, cfg = self.rollouts, self.cfg
        return r.generate(rows, cfg.actor_rollout_ref.rollout.n, r.training_sampling(),
                          rollout_seed(cfg.trainer.seed, step), step, role=self.placement.rollout)


class StreamedRollouts(_PoolRollouts):
    """Rollout workers run their trajectory streams continuously (single-turn rows through the single-turn agent
    loop); each step takes the oldest complete prompt groups within the off-policy bound (``controller.stream``).
    Each updated policy cuts the running generation short and trajectories in flight go on with it (partial
    rollouts, ``agent.loop.VersionedRollout``). A checkpoint saves the prompt rows pulled and not yet trained; a
    resumed run submits them first. The streams end with their workers."""

    def __init__(self, rollouts: Rollouts, batches: Iterator[list[dict]], step: int, total_steps: int,
                 resumed_state: dict | None):
        super().__init__(rollouts)
        cfg = self.cfg
        self.n = cfg.actor_rollout_ref.rollout.n
        v1, a = cfg.trainer.v1, cfg.async_training
        self._start_streams(step)
        resubmit = [row for item in (resumed_state or {}).get("in_flight", []) for row in item.rows]
        self.pipeline = StreamingPipeline(
            self.role, lambda: agent_rows(next(batches)), self.n, cfg.data.train_batch_size, v1.warmup_batches(),
            v1.sampler.max_off_policy_threshold, v1.sampler.max_off_policy_strategy,
            lambda gid: stream_group_seed(cfg.trainer.seed, step, gid), a.queue_timeout_s, self._load,
            resubmit=resubmit)
        if step > 0:
            self._resumed_policy(step)

    def _start_streams(self, step: int) -> None:
        """The rollout pool's streams (``self.role``)."""
        self.role = self.placement.rollout
        self.role.call_all("stream_start", self._spec(), dict(self.rollouts.training_sampling(), n=self.n))

    def _resumed_policy(self, step: int) -> None:
        """A resumed run's policy (version ``step``) to the pool."""
        self._publish(step, step)

    def _spec(self) -> AgentSpec:
        """The agent spec of a multi-turn run, else the single-turn loop's."""
        if self.rollouts.agent is not None:
            return self.rollouts.agent
        rollout = self.cfg.actor_rollout_ref.rollout
        return AgentSpec(multi_turn=multi_turn_values(rollout.multi_turn), default_agent_loop="single_turn_agent",
                         max_response_length=self.cfg.data.max_response_length)

    def next(self, step: int, batches, m: dict) -> tuple[Batch, torch.Tensor, dict]:
        """The step's complete groups, scored; DAPO's dynamic sampling takes further complete groups in place of
        those its filter drops. The off-policy metrics are over every trajectory the step took."""
        taken, waited, evicted = [], 0.0, 0

        def generation_round(round_index: int, groups_needed: int) -> Batch:
            nonlocal waited, evicted
            rows, outputs, metrics = self.pipeline.next(step, groups_needed)
            taken.extend(outputs)
            waited += metrics["timing_s/wait_rollout"]
            evicted += metrics["training/off_policy/evicted_samples"]
            m["async/queue_size"] = metrics["async/queue_size"]
            return self.rollouts.batch_of(rows, outputs, self.n, step, uid_prefix=round_uid_prefix(round_index))

        batch, scores, extra = self.rollouts.scored_rounds(generation_round, m, step)
        m.update({"timing_s/wait_rollout": waited, "training/off_policy/evicted_samples": evicted,
                  **off_policy_metrics([o["segment_versions"] for o in taken], step + 1)})
        return batch, scores, extra

    def checkpoint_state(self, step: int) -> dict:
        return {"policy_version": step, "in_flight": [RolloutItem(step, self.pipeline.outstanding_rows(), step)]}


class ColocatedStreamedRollouts(StreamedRollouts):
    """``trainer.v1.trainer_mode=colocate_async``: :class:`StreamedRollouts` on the actor's own workers. Their
    streams pause while the engine computes; a step's update ends with each worker loading its actor's weights
    into its rollout as the next version, and the stream goes on with them (``ActorRolloutRefWorker.update_actor``):
    no export, no object store, nothing to send after the update."""

    def _start_streams(self, step: int) -> None:
        """The actor's streams, on the policy its workers hold (version ``step``: a resumed run loaded it)."""
        self.role = self.placement.actor
        self.role.call_all("stream_start", self._spec(), dict(self.rollouts.training_sampling(), n=self.n), step)

    def _resumed_policy(self, step: int) -> None:
        pass  # the actor's workers loaded it from the checkpoint, their rollouts with it

    def after_update(self, step: int, m: dict) -> None:
        pass


def open_rollout_source(rollouts: Rollouts, batches: Iterator[list[dict]], step: int, total_steps: int,
                        resumed_state: dict | None):
    """The run's rollout source by ``trainer.v1.trainer_mode``: the actor's streams (colocate_async), the rollout
    pool's (separate_async); else without a rollout pool colocated, with one the fixed schedule."""
    mode = rollouts.cfg.trainer.v1.trainer_mode
    if mode == "colocate_async":
        return ColocatedStreamedRollouts(rollouts, batches, step, total_steps, resumed_state)
    if mode == "separate_async":
        return StreamedRollouts(rollouts, batches, step, total_steps, resumed_state)
    if rollouts.placement.rollout is None:
        return ColocatedRollouts(rollouts)
    return PipelinedRollouts(rollouts, batches, step, total_steps, resumed_state)
