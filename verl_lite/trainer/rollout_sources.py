"""Where a step's rollouts come from: a *rollout source*, one interface for every setting, so the step never asks
which one runs (docs/async.md):

    batch, scores, extra = source.next(step, batches, metrics)    # the step's rollouts, scored
    source.after_update(step, metrics)                            # the actor was updated
    source.checkpoint_state(step)                                 # what a checkpoint saves of it (or None)
    source.close()

``open_rollout_source`` picks ``ColocatedRollouts`` (synchronous), ``PipelinedRollouts`` (one-step-off, a fixed
schedule) or ``StreamedRollouts`` (``trainer.v1.trainer_mode=separate_async``, partial rollouts).
"""

from __future__ import annotations

from typing import Iterator

import torch

from verl_lite.agent.loop import AgentSpec, agent_rows
from verl_lite.agent.preflight import multi_turn_values
from verl_lite.controller import RoleGroup
from verl_lite.controller.pipeline import PipelineError, RolloutItem, RolloutPipeline
from verl_lite.controller.stream import StreamingPipeline, off_policy_metrics
from verl_lite.controller.wire import wire
from verl_lite.controller.worker_group import WorkerError
from verl_lite.protocol import Batch
from verl_lite.trainer import metrics as M
from verl_lite.trainer.rollout_stage import Rollouts
from verl_lite.utils.seeds import rollout_seed, stream_group_seed


class WeightSync:
    """The actor's weights to a rollout pool: exported once into Ray's object store, loaded by every rollout
    worker; each call bounded by ``async_training.weight_sync_timeout_s`` (else one PipelineError)."""

    def __init__(self, rollouts: Rollouts):
        self.placement, self.bound = rollouts.placement, rollouts.cfg.async_training.weight_sync_timeout_s

    def export(self, step: int):
        """The actor's weights after ``step`` RL steps (an ObjectRef the rollout workers resolve)."""
        import ray

        exported = self._call(self.placement.actor, f"step {step + 1}: exporting the actor's weights for the "
                              "rollout pool", "export_rollout_weights")
        return ray.put(wire(exported[0]))  # tensors as raw bytes, as WorkerGroup.broadcast sends them

    def load(self, weights, version: int) -> None:
        """Policy ``version`` into every rollout worker."""
        self._call(self.placement.rollout, f"the weight sync of policy version {version} to the rollout pool",
                   "load_weights", weights, version)

    def _call(self, role: RoleGroup, what: str, method: str, *args) -> list:
        try:
            return role.call_all(method, *args, timeout_s=self.bound)
        except WorkerError as err:
            raise PipelineError(f"{what} failed or did not finish within async_training.weight_sync_timeout_s="
                                f"{self.bound:g}s ({err})",
                                "raise async_training.weight_sync_timeout_s, or check the rollout workers") from err


class ColocatedRollouts:
    """The actor's workers sample each step's rollouts from the next prompt batch of ``batches`` (DAPO's
    dynamic sampling pulls further ones)."""

    def __init__(self, rollouts: Rollouts):
        self.rollouts = rollouts

    def next(self, step: int, batches: Iterator[list[dict]], m: dict) -> tuple[Batch, torch.Tensor, dict]:
        return self.rollouts.generate_and_score(next(batches), lambda: next(batches), m, step)

    def after_update(self, step: int, m: dict) -> None:
        """Nothing to send: each worker reloads its rollout from its actor as it next samples."""

    def checkpoint_state(self, step: int) -> None:
        """Nothing beyond the model: the next step's rollouts are sampled after the resume."""

    def close(self) -> None:
        """Nothing runs between steps."""


class PipelinedRollouts:
    """Split placement (``hybrid_engine=false``): the rollout pool samples ahead of the trainer, at most
    ``async_training.staleness_threshold`` policy versions behind (``controller.pipeline``); the driver scores
    each batch as the step takes it. Each updated policy is exported once and published to the pipeline, which
    loads it into the rollout pool before the first batch that version samples."""

    def __init__(self, rollouts: Rollouts, batches: Iterator[list[dict]], step: int, total_steps: int,
                 resumed_state: dict | None):
        """From RL step ``step`` over the data cursor ``batches``; resumed: the checkpoint's in-flight batches first."""
        self.rollouts, self.placement, a = rollouts, rollouts.placement, rollouts.cfg.async_training
        self.weights = WeightSync(rollouts)
        self.pipeline = RolloutPipeline(
            self._generate, self.weights.load, lambda: next(batches), staleness=a.staleness_threshold,
            queue_timeout_s=a.queue_timeout_s, first_index=step, end_index=total_steps,
            loaded_version=None if step > 0 else 0, ready=(resumed_state or {}).get("in_flight", []))
        if step > 0:
            self.pipeline.publish(step, self.weights.export(step))
        self.pipeline.start()

    def next(self, step: int, batches, m: dict) -> tuple[Batch, torch.Tensor, dict]:
        """Step ``step``'s batch (generated already, tagged with its policy version), scored here."""
        item = self.pipeline.next(step)
        scores, extra = self.rollouts.shaped_scores(item.batch, m, step)
        m.update(item.metrics)
        return item.batch, scores, extra

    def after_update(self, step: int, m: dict) -> None:
        """Policy version ``step + 1`` to the pipeline."""
        with M.timer(m, "sync_weights"):
            self.pipeline.publish(step + 1, self.weights.export(step))

    def checkpoint_state(self, step: int) -> dict:
        """The policy version and the batches generated ahead (sampled by older versions: saved, not regenerated)."""
        return {"policy_version": step, "in_flight": self.pipeline.in_flight()}

    def close(self) -> None:
        self.pipeline.close()

    def _generate(self, rows: list[dict], step: int) -> Batch:
        """The rollouts of RL step ``step`` on the rollout pool (the pipeline's thread calls it)."""
        r, cfg = self.rollouts, self.rollouts.cfg
        return r.generate(rows, cfg.actor_rollout_ref.rollout.n, r.training_sampling(),
                          rollout_seed(cfg.trainer.seed, step), step, role=self.placement.rollout)


class StreamedRollouts:
    """Rollout workers run their trajectory streams continuously (single-turn rows through the single-turn agent
    loop); each step takes the oldest complete prompt groups within the off-policy bound (``controller.stream``).
    Each updated policy cuts the running generation short and trajectories in flight go on with it (partial
    rollouts, ``agent.loop.VersionedRollout``). A checkpoint saves the prompt rows pulled and not yet trained; a resumed run submits them first."""

    def __init__(self, rollouts: Rollouts, batches: Iterator[list[dict]], step: int, total_steps: int,
                 resumed_state: dict | None):
        cfg = rollouts.cfg
        self.rollouts, self.cfg, self.n = rollouts, cfg, cfg.actor_rollout_ref.rollout.n
        self.weights = WeightSync(rollouts)
        role, v1, a = rollouts.placement.rollout, cfg.trainer.v1, cfg.async_training
        role.call_all("stream_start", self._spec(), dict(rollouts.training_sampling(), n=self.n))
        resubmit = [row for item in (resumed_state or {}).get("in_flight", []) for row in item.rows]
        self.pipe = StreamingPipeline(
            role, lambda: agent_rows(next(batches)), self.n, cfg.data.train_batch_size,
            v1.separate_async.num_warmup_batches, v1.sampler.max_off_policy_threshold,
            v1.sampler.max_off_policy_strategy, lambda gid: stream_group_seed(cfg.trainer.seed, step, gid),
            a.queue_timeout_s, self.weights.load, resubmit=resubmit)
        if step > 0:
            self.pipe.publish(step, self.weights.export(step))

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
            rows, outputs, metrics = self.pipe.next(step, groups_needed)
            taken.extend(outputs)
            waited += metrics["timing_s/wait_rollout"]
            evicted += metrics["training/off_policy/evicted_samples"]
            m["async/queue_size"] = metrics["async/queue_size"]
            return self.rollouts.batch_of(rows, outputs, self.n, step, uid_prefix=f"r{round_index}-" if round_index else "")

        batch, scores, extra = self.rollouts.scored_rounds(generation_round, m, step)
        m.update({"timing_s/wait_rollout": waited, "training/off_policy/evicted_samples": evicted,
                  **off_policy_metrics([o["segment_versions"] for o in taken], step + 1)})
        return batch, scores, extra

    def after_update(self, step: int, m: dict) -> None:
        """Policy version ``step + 1`` into every rollout worker (trajectories running go on with it)."""
        with M.timer(m, "sync_weights"):
            self.pipe.publish(step + 1, self.weights.export(step))

    def checkpoint_state(self, step: int) -> dict:
        return {"policy_version": step, "in_flight": [RolloutItem(step, self.pipe.outstanding_rows(), step)]}

    def close(self) -> None:
        pass  # the streams end with their workers


def open_rollout_source(rollouts: Rollouts, batches: Iterator[list[dict]], step: int, total_steps: int,
                        resumed_state: dict | None):
    """The run's rollout source: colocated without a rollout pool; with one, the stream under
    ``trainer.v1.trainer_mode=separate_async``, else the fixed schedule."""
    if rollouts.placement.rollout is None:
        return ColocatedRollouts(rollouts)
    if rollouts.cfg.trainer.v1.trainer_mode == "separate_async":
        return StreamedRollouts(rollouts, batches, step, total_steps, resumed_state)
    return PipelinedRollouts(rollouts, batches, step, total_steps, resumed_state)
