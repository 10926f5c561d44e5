"""Actor + rollout + reference policy in ONE process per rank (one Ray actor per engine rank): the actor a
trainable ``MegatronEngine`` shard; the ref a frozen forward-only one on the same process groups (only when a
KL needs it; with LoRA, the actor with its adapters off); the rollout a full generation model, loaded with the
actor's weights after an update before it next samples (no call from the controller). Under
``trainer.v1.trainer_mode=colocate_async`` the rollout runs a trajectory stream (``agent.stream``) beside the
engine: every call that computes on the engine or samples for the controller pauses it, and a step's update keeps
it paused until it has loaded the new policy into the rollout. Thin shells: the rows, micro-batches, normalization plan
and token counts come from the controller; no RL math here.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from functools import partial

import ray

from verl_lite.agent.loop import AgentRunner, VersionedRollout
from verl_lite.agent.stream import TrajectoryStream
from verl_lite.algorithms import actor_loss
from verl_lite.algorithms.distillation import STUDENT_TOPK_LOG_PROBS_KEY, TEACHER_KEYS, TEACHER_TOPK_IDS_KEY, uses_topk
from verl_lite.compat.cpu_adapter import suspended
from verl_lite.controller.wire import wire
from verl_lite.engine.engine import MegatronEngine
from verl_lite.protocol import Batch
from verl_lite.rollout import make_rollout
from verl_lite.rollout.buckets import weight_buckets
from verl_lite.rollout.engine_rollout import EngineRollout
from verl_lite.workers.engine_worker import EngineWorker, EngineWorkerConfig, sequence_batch

ACTOR_LOSS_KEYS = ("response_mask", "old_log_probs", "advantages", "ref_log_probs", "is_weights", "cov_mask",
                   "rollout_log_probs") + TEACHER_KEYS


@dataclass
class RolloutWorkerConfig:
    """A generation model: its directory, its tokenizer's, and the backend with its settings (``make_rollout``);
    ``on_engine`` > 0: the actor's own batch-invariant engine generates instead (``rollout.engine_rollout``), in
    forwards of at most that many tokens."""

    model_path: str
    tokenizer_path: str
    rollout_name: str
    rollout_kwargs: dict
    on_engine: int = 0

    def tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.tokenizer_path)

    def build(self):
        return make_rollout(self.rollout_name, self.model_path, self.tokenizer(), **self.rollout_kwargs)


@dataclass
class WorkerConfig(EngineWorkerConfig):
    """The actor's engine layout plus what the colocated ref and rollout need."""

    need_ref: bool
    rollout: RolloutWorkerConfig
    router_replay: str = "disabled"  # R2: the old-log-prob pass records the routing the update replays; R3: both replay the rollout's


def stream_paused(method):
    """``method`` runs with this worker's trajectory stream paused, if one runs (and is not held already)."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        if not self.hold_stream():
            return method(self, *args, **kwargs)
        try:
            return method(self, *args, **kwargs)
        finally:
            self.release_stream()

    return run


class StreamHost:
    """A worker's trajectory stream (the streamed modes, ``controller.stream``): ``self.rollout`` driven by agent
    loops on a thread of its own, fed and drained by the controller."""

    stream = None
    version = 0  # the policy version the rollout holds
    stream_held = False  # this worker holds its stream paused (an engine call or a step's update runs)

    def stream_start(self, spec, sampling: dict, version: int | None = None) -> None:
        """Start the stream with an agent spec (``verl_lite.agent.AgentSpec``) and the sampling; the rollout holds
        policy ``version`` (default: the last one loaded)."""
        self.version = self.version if version is None else int(version)
        runner = AgentRunner(VersionedRollout(self.rollout, self.version), self.rollout_cfg.tokenizer(), spec)
        self.stream = TrajectoryStream(runner, sampling)

    def hold_stream(self) -> bool:
        """Pause the stream (its running call cut short, none started) unless none runs or it is held already;
        True when this call paused it."""
        if self.stream is None or self.stream_held:
            return False
        self.stream.runner.rollout.pause()
        self.stream_held = True
        return True

    def release_stream(self, version: int | None = None) -> None:
        """Let the held stream go on (as policy ``version`` from now, when given)."""
        if version is not None:
            self.version = int(version)
        self.stream_held = False
        self.stream.runner.rollout.resume(version)

    def stream_submit(self, jobs: list[dict]) -> None:
        self.stream.submit(jobs)

    def stream_collect(self, wait_s: float = 0.0) -> list[dict]:
        """The trajectories finished since the last call, waiting up to ``wait_s`` for one."""
        return self.stream.collect(wait_s)


class ActorRolloutRefWorker(StreamHost, EngineWorker):
    def __init__(self, rank: int, world_size: int, cfg: WorkerConfig):
        super().__init__(rank, world_size, cfg)
        self.rollout_cfg = cfg.rollout
        self.actor = self.ref = self.rollout = self.agent = None
        self.rollout_behind = False  # the actor was updated since the rollout last loaded its weights

    @property
    def engine(self):
        return self.actor

    def init_model(self) -> None:
        engine = self._init_world()
        self.actor = MegatronEngine(engine)
        if self.cfg.need_ref and engine.lora is None:
            self.ref = MegatronEngine(engine.forward_only_twin())
        if self.rollout_cfg.on_engine:
            record = bool(self.rollout_cfg.rollout_kwargs.get("record_routing"))
            self.rollout = EngineRollout(self.actor, self.rollout_cfg.tokenizer(), record_routing=record,
                                         max_tokens_per_forward=self.rollout_cfg.on_engine)
        else:
            self.rollout = self.rollout_cfg.build()

    def _ref_is_actor_without_adapters(self) -> bool:
        return bool(self.cfg.need_ref and self.actor.cfg.lora is not None)

    def engines(self) -> dict:
        """The engines this worker holds and their parameter bytes: {"actor": n, "ref": n or None}."""
        def size(engine):
            return None if engine is None else sum(p.numel() * p.element_size() for c in engine.chunks
                                                   for p in c.parameters())

        return {"actor": size(self.actor), "ref": size(self.ref),
                "ref_is_actor_without_adapters": self._ref_is_actor_without_adapters()}

    @stream_paused
    def generate(self, prompt_ids: list[list[int]], seeds: list[int] | None, sampling: dict) -> list[dict]:
        """:meth:`sample` from the actor's current weights (the rollout catches up first)."""
        self._catch_up_rollout()
        return self.sample(prompt_ids, seeds, sampling)

    def sample(self, prompt_ids: list[list[int]], seeds: list[int] | None, sampling: dict) -> list[dict]:
        """``sampling['n']`` responses per prompt from the rollout as loaded, prompt-major. With ``seeds`` (one per
        prompt) a sample depends on its seed, index and position only, not on how prompts were split over
        workers. ``log_probs`` come back as lists of floats (exact fp32 values, without torch's pickling cost)."""
        if not prompt_ids:
            return []
        if seeds is None:
            out = self.rollout.generate(prompt_ids, **sampling)
        elif "seeds" in inspect.signature(self.rollout.generate).parameters:
            out = self.rollout.generate(prompt_ids, seeds=list(seeds), **sampling)
        else:
            out = [o for prompt, seed in zip(prompt_ids, seeds)
                   for o in self.rollout.generate([prompt], seed=seed, **sampling)]
        return [dict(o, log_probs=o["log_probs"].tolist()) for o in out]

    def init_agent(self, spec) -> None:
        """Build this worker's agent runner (multi-turn rollouts) from a ``verl_lite.agent.AgentSpec``."""
        self.agent = AgentRunner(self.rollout, self.rollout_cfg.tokenizer(), spec)

    @stream_paused
    def generate_agent(self, rows: list[dict], seeds: list[int] | None, sampling: dict) -> list[dict]:
        """:meth:`_run_agent` from the actor's current weights (the rollout catches up first)."""
        self._catch_up_rollout()
        return self._run_agent(rows, seeds, sampling)

    def _run_agent(self, rows: list[dict], seeds: list[int] | None, sampling: dict) -> list[dict]:
        """``sampling['n']`` multi-turn trajectories per agent row (``verl_lite.agent.loop.agent_rows``),
        prompt-major; each turn of all of them is one batched rollout call (``AgentRunner.run``)."""
        if self.agent is None:
            raise RuntimeError("generate_agent: init_agent was not called (multi_turn.enable needs it)")
        return self.agent.run(rows, seeds, sampling) if rows else []

    @stream_paused
    def sync_rollout_weights(self) -> int:
        """Copy the actor's current weights (LoRA: merged into the base) into the rollout model. Collective."""
        self.rollout_behind = False
        if getattr(self.rollout, "shares_trainer_weights", False):
            return 0
        with suspended():  # reading, gathering and copying tensors: no CUDA->CPU rewriting on the way
            return self.rollout.load_weights(self.actor.export_merged_hf())

    def _catch_up_rollout(self) -> None:
        """Load the actor's weights into the rollout if an update came since its last load. Collective: every rank
        receives each generation call (empty pieces included) and took part in the update."""
        if self.rollout_behind:
            self.sync_rollout_weights()

    @stream_paused
    def export_rollout_weights(self, bucket_bytes: int) -> tuple[list, int] | None:
        """Split placement: the actor's weights (LoRA merged) in flat buckets of at most ``bucket_bytes``, each put
        into Ray's object store by rank 0, which returns (the buckets' ObjectRefs, their bytes). Collective."""
        with suspended():
            tensors = self.actor.export_merged_hf()
            if self.rank != 0:
                for _ in tensors:  # the gathers are collective: every rank takes part
                    pass
                return None
            refs, nbytes = [], 0
            for bucket in weight_buckets(tensors, bucket_bytes):  # each into the store as packed: one in memory
                refs.append(ray.put(wire(bucket)))
                nbytes += bucket.data.numel()
        return refs, nbytes

    @stream_paused
    def compute_log_prob(self, piece: Batch, micro_batches: list[list[int]], temperature: float) -> dict | None:
        """Old log-probs and entropy [n, W] of this DP rank's piece (None off the output owner)."""
        mode = self.cfg.router_replay
        return self.actor.infer(sequence_batch(piece, routing=mode == "R3"), micro_batches, temperature,
                                outputs=("log_probs", "entropy"), record_routing=mode == "R2")

    @stream_paused
    def compute_ref_log_prob(self, piece: Batch, micro_batches: list[list[int]], temperature: float) -> dict | None:
        """Reference log-probs [n, W]: the reference engine's, or with LoRA the actor's with its adapters off."""
        if self._ref_is_actor_without_adapters():
            with self.actor.adapters_disabled():
                out = self.actor.infer(sequence_batch(piece), micro_batches, temperature, outputs=("log_probs",))
        elif self.ref is None:
            raise RuntimeError("compute_ref_log_prob: no reference engine was built (need_ref=False)")
        else:
            out = self.ref.infer(sequence_batch(piece), micro_batches, temperature, outputs=("log_probs",))
        return None if out is None else {"ref_log_probs": out["log_probs"]}

    def update_actor(self, jobs: list[dict], loss_cfg, temperature: float,
                     correction: dict | None = None, end_of_step: bool = True, distillation=None) -> list[dict]:
        """``_train_jobs`` of ``actor_loss`` with the actor section ``loss_cfg``, ``correction`` and
        ``distillation`` (the ``distillation.distillation_loss`` section when on); the LR schedule steps at
        ``end_of_step`` (the RL step's last call). With a stream running (colocated), it is held from the first
        call of the step to its end, when the new weights are loaded into its rollout as the next policy version
        and it goes on. Collective."""
        loss = partial(actor_loss, cfg=loss_cfg, correction=correction, distillation=distillation)
        self.hold_stream()  # no sampling from here to the new policy's load
        self.rollout_behind = self.rollout_behind or bool(jobs)
        outputs = {}
        if distillation is not None and uses_topk(distillation.loss_mode):  # the student at the teacher's top-k ids
            outputs = {"outputs": ("log_probs", "entropy", STUDENT_TOPK_LOG_PROBS_KEY), "ids_key": TEACHER_TOPK_IDS_KEY}
        results = self._train_jobs(jobs, loss, ACTOR_LOSS_KEYS, end_of_step, temperature=temperature, **outputs)
        if self.stream is not None and end_of_step:
            try:
                self._catch_up_rollout()
            finally:
                self.release_stream(self.version + 1)
        return results

    # ------------------------------------------------------------------ checkpoints (dist_checkpointing: on use)
    @stream_paused
    def save_checkpoint(self, path: str, hf_dir: str | None = None) -> None:
        """The actor's engine state (+ this rank's RNG) into ``path``; with ``hf_dir`` also the policy as an HF
        directory. Collective. The reference policy is the initial model: not saved."""
        from verl_lite.engine.checkpoint import save_role_state

        save_role_state(self.actor, path, tokenizer_path=self.rollout_cfg.tokenizer_path)
        if hf_dir is not None:
            self.export_hf_dir(hf_dir)

    @stream_paused
    def load_checkpoint(self, path: str) -> dict:
        """Load a :meth:`save_checkpoint` directory (any layout) and refresh the rollout's weights. Collective."""
        from verl_lite.engine.checkpoint import load_role_state

        info = load_role_state(self.actor, path)
        self.sync_rollout_weights()
        return info

    @stream_paused
    def export_hf_dir(self, hf_dir: str) -> None:
        """The current policy as an HF directory (safetensors + config + tokenizer). Collective."""
        from verl_lite.engine.checkpoint import save_hf_pretrained

        save_hf_pretrained(self.actor, self.actor.hf_config, hf_dir, tokenizer_path=self.rollout_cfg.tokenizer_path)
