"""A rollout worker of split placement (``actor_rollout_ref.hybrid_engine=false``): a generation model and
nothing else, on bundles of its own. It holds one policy version at a time: ``load_weights`` replaces the
whole model, then sets the version; the worker runs one call at a time, so every batch is sampled by exactly
one version, which ``generate`` reports with its outputs (``policy_version``).
"""

from __future__ import annotations

import ray

from verl_lite.controller.worker_group import Worker
from verl_lite.rollout.buckets import bucket_tensors
from verl_lite.workers.actor_rollout_ref import ActorRolloutRefWorker, RolloutWorkerConfig, StreamHost


class RolloutWorker(StreamHost, Worker):
    def __init__(self, rank: int, world_size: int, cfg: RolloutWorkerConfig):
        super().__init__(rank, world_size)
        self.cfg = self.rollout_cfg = cfg
        self.rollout = self.agent = None

    def init_model(self) -> None:
        self.rollout = self.cfg.build()

    def _tagged(self, outputs: list[dict]) -> list[dict]:
        return [dict(o, policy_version=self.version) for o in outputs]

    def generate(self, prompt_ids: list[list[int]], seeds: list[int] | None, sampling: dict) -> list[dict]:
        """``ActorRolloutRefWorker.sample``'s outputs, each tagged with the policy version that sampled it."""
        return self._tagged(ActorRolloutRefWorker.sample(self, prompt_ids, seeds, sampling))

    init_agent = ActorRolloutRefWorker.init_agent  # multi-turn: the same agent runner over this worker's rollout

    def generate_agent(self, rows: list[dict], seeds: list[int] | None, sampling: dict) -> list[dict]:
        """``ActorRolloutRefWorker._run_agent``'s trajectories, each tagged with the version that sampled it."""
        return self._tagged(ActorRolloutRefWorker._run_agent(self, rows, seeds, sampling))

    def load_weights(self, bucket_refs: list, version: int) -> int:
        """The policy of ``version`` (the actor's whole export: ObjectRefs of its ``WeightBucket``s, fetched one at a
        time as the backend loads them), then the version; with a stream running, applied between two of its backend
        calls (``agent.loop.VersionedRollout``)."""
        named_tensors = (pair for ref in bucket_refs for pair in bucket_tensors(ray.get(ref)))
        stream = self.stream
        n = stream.runner.rollout.load(named_tensors, version) if stream else self.rollout.load_weights(named_tensors)
        self.version = int(version)
        return n
