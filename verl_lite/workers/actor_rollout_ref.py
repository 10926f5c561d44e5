"""Actor + rollout + reference policy in ONE process per rank (one Ray actor per engine rank).

- actor:    a trainable ``MegatronEngine`` (this rank's TP/PP/CP shard);
- ref:      a frozen forward-only ``MegatronEngine`` on the same process groups (only when the
            KL loss or the in-reward KL needs it);
- rollout:  a full HF model per process (``HFRollout``), weights copied in-process from the
            actor's ``export_hf()`` after every update.

Every method is a thin shell: unpack what the controller sent, call the engine or the rollout,
hand the result back. Which rows, which micro-batches, the normalization plan and the token
counts all come from the controller; nothing here does RL math.

Batches arrive as :class:`verl_lite.protocol.Batch` pieces holding ``prompt_ids`` (list of
token lists), ``responses`` [n, W] (right-padded) and ``response_mask`` [n, W], plus the
per-token tensors the loss needs (``old_log_probs``, ``advantages``, ``ref_log_probs``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch

from verl_lite.controller.worker_group import Worker
from verl_lite.protocol import Batch

LOSS_DATA_KEYS = ("response_mask", "old_log_probs", "advantages", "ref_log_probs", "is_weights")


@dataclass
class WorkerConfig:
    """What one actor/rollout/ref process builds (plain data, sent once by the controller)."""

    model_path: str
    tokenizer_path: str
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    cp: int = 1
    sequence_parallel: bool = False
    timeout_s: float = 300.0
    optim: dict = field(default_factory=dict)  # verl_lite.engine.config.OptimConfig fields
    calculate_per_token_loss: bool = False
    use_distributed_optimizer: bool = False
    need_ref: bool = False
    rollout_name: str = "hf"
    seed: int = 0


def sequence_batch(piece: Batch, with_loss_data: bool = False):
    """A Batch piece -> the engine's ``SequenceBatch`` (input_ids = prompt + response tokens)."""
    from verl_lite.engine.engine import SequenceBatch

    mask = piece["response_mask"]
    lengths = mask.sum(-1).long()
    responses = piece["responses"]
    input_ids = [
        torch.cat([torch.as_tensor(p, dtype=torch.long), responses[i, : int(lengths[i])].long()])
        for i, p in enumerate(piece["prompt_ids"])
    ]
    data = {}
    if with_loss_data:
        data = {k: piece[k] for k in LOSS_DATA_KEYS if k in piece}
    return SequenceBatch(input_ids, lengths, data, response_width=mask.shape[1])


class ActorRolloutRefWorker(Worker):
    def __init__(self, rank: int, world_size: int, cfg: WorkerConfig):
        super().__init__(rank, world_size)
        self.cfg = cfg
        self.actor = self.ref = self.rollout = None

    # ------------------------------------------------------------------ set-up
    def init_model(self) -> None:
        from transformers import AutoTokenizer

        from verl_lite.engine.config import EngineConfig, OptimConfig
        from verl_lite.engine.distributed import ParallelConfig, init_distributed
        from verl_lite.engine.engine import MegatronEngine
        from verl_lite.rollout import make_rollout

        c = self.cfg
        parallel = ParallelConfig(tp=c.tp, pp=c.pp, vpp=c.vpp, cp=c.cp, sequence_parallel=c.sequence_parallel,
                                  timeout_s=c.timeout_s)
        init_distributed(self.rank, self.world_size, self.master_addr, self.master_port, parallel, seed=c.seed)
        optim = OptimConfig(**c.optim, use_distributed_optimizer=c.use_distributed_optimizer)
        self.actor = MegatronEngine(EngineConfig(
            model_path=c.model_path, parallel=parallel, optim=optim,
            calculate_per_token_loss=c.calculate_per_token_loss, seed=c.seed,
        ))
        if c.need_ref:
            self.ref = MegatronEngine(EngineConfig(model_path=c.model_path, parallel=parallel, forward_only=True,
                                                   seed=c.seed))
        tokenizer = AutoTokenizer.from_pretrained(c.tokenizer_path)
        self.rollout = make_rollout(c.rollout_name, c.model_path, tokenizer)

    def layout(self) -> dict:
        from verl_lite.engine.distributed import data_parallel_rank, data_parallel_size

        return {"dp_rank": data_parallel_rank(), "dp_size": data_parallel_size(),
                "is_output_owner": bool(self.actor.is_output_owner)}

    # ------------------------------------------------------------------ rollout
    def generate(self, prompt_ids: list[list[int]], seeds: list[int] | None, sampling: dict) -> list[dict]:
        """``sampling['n']`` responses per prompt, prompt-major.

        With ``seeds`` (one per prompt) sample k of prompt p is a function of (its seed, k,
        position) only, so the samples do not depend on how prompts were split over workers: one
        batched call where the rollout takes per-prompt ``seeds``, else one call per prompt.
        Without seeds (greedy) all prompts go in one call.
        """
        import inspect

        if not prompt_ids:
            return []
        if seeds is None:
            return self.rollout.generate(prompt_ids, **sampling)
        if "seeds" in inspect.signature(self.rollout.generate).parameters:
            return self.rollout.generate(prompt_ids, seeds=list(seeds), **sampling)
        out = []
        for prompt, seed in zip(prompt_ids, seeds):
            out.extend(self.rollout.generate([prompt], seed=seed, **sampling))
        return out

    def sync_rollout_weights(self) -> int:
        """Copy the actor's current weights into the rollout model (every rank takes part: export gathers)."""
        return self.rollout.load_weights(self.actor.export_hf(), strict=True)

    # ------------------------------------------------------------------ log-probs
    def compute_log_prob(self, piece: Batch, micro_batches: list[list[int]], temperature: float) -> dict | None:
        """Old log-probs and entropy [n, W] of this DP rank's piece (None off the output owner)."""
        return self.actor.infer(sequence_batch(piece), micro_batches, temperature, outputs=("log_probs", "entropy"))

    def compute_ref_log_prob(self, piece: Batch, micro_batches: list[list[int]], temperature: float) -> dict | None:
        if self.ref is None:
            raise RuntimeError("compute_ref_log_prob: no reference engine was built (need_ref=False)")
        out = self.ref.infer(sequence_batch(piece), micro_batches, temperature, outputs=("log_probs",))
        return None if out is None else {"ref_log_probs": out["log_probs"]}

    # ------------------------------------------------------------------ update
    def update_actor(self, jobs: list[dict], loss_cfg, temperature: float) -> list[dict]:
        """One optimizer step per job, in order. A job (one mini-batch's share of this DP rank):
        ``piece`` (Batch), ``micro_batches`` (local row indices), ``plan`` (the mini-batch's
        NormalizationPlan), ``global_token_count`` (sum of sequence lengths over the mini-batch).
        Returns the engine's step metrics per job (loss metrics on output owners only)."""
        from verl_lite.algorithms import actor_loss

        results = []
        for job in jobs:
            loss_fn = partial(actor_loss, plan=job["plan"], cfg=loss_cfg)
            results.append(self.actor.train_step(
                sequence_batch(job["piece"], with_loss_data=True), job["micro_batches"], loss_fn,
                temperature=temperature, global_token_count=job["global_token_count"],
            ))
        return results

    def shutdown(self) -> None:
        from verl_lite.engine.distributed import destroy_distributed

        destroy_distributed()
