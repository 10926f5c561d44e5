"""The base of every worker role that hosts a ``MegatronEngine``: its own torch.distributed world.

A role's workers (one Ray actor per engine rank) join ONE process group with the role's own
TP/PP/VPP/CP layout (DP = world / (tp * pp * cp)); two roles never share a group, so the actor
and the critic can use different layouts on the same machines.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from verl_lite.controller.worker_group import Worker
from verl_lite.protocol import Batch, response_lengths


@dataclass
class EngineWorkerConfig:
    """What an engine role builds (plain data, sent once by the controller; built by ``workers.from_config``)."""

    model_path: str
    tp: int
    pp: int
    vpp: int | None
    cp: int
    sequence_parallel: bool
    ep: int  # expert parallel (MoE models)
    etp: int  # expert tensor parallel
    timeout_s: float
    optim: dict  # verl_lite.engine.config.OptimConfig fields
    calculate_per_token_loss: bool
    use_distributed_optimizer: bool
    seed: int
    model_overrides: dict  # megatron TransformerConfig fields (EngineConfig.model_overrides)
    params_dtype: str  # megatron.dtype: float32 | bfloat16 (EngineConfig.params_dtype)
    lora: dict | None  # engine.lora.LoraConfig fields, None = no LoRA (model.lora.rank 0)


def sequence_batch(piece: Batch, loss_keys: tuple[str, ...] = ()):
    """A Batch piece -> the engine's ``SequenceBatch`` (input_ids = prompt + response tokens).

    The response length of a row is its last valid position + 1 (``response_lengths``): a mask
    may have holes, whose tokens stay in the sequence. ``loss_keys`` present in the piece travel
    to the loss as per-token data."""
    from verl_lite.engine.engine import SequenceBatch

    mask = piece["response_mask"]
    lengths = response_lengths(mask)
    responses = piece["responses"]
    input_ids = [
        torch.cat([torch.as_tensor(p, dtype=torch.long), responses[i, : int(lengths[i])].long()])
        for i, p in enumerate(piece["prompt_ids"])
    ]
    data = {k: piece[k] for k in loss_keys if k in piece}
    return SequenceBatch(input_ids, lengths, data, response_width=mask.shape[1])


class EngineWorker(Worker):
    """Joins the role's process group and reports its place for dispatch."""

    def __init__(self, rank: int, world_size: int, cfg: EngineWorkerConfig):
        super().__init__(rank, world_size)
        self.cfg = cfg

    def _init_world(self):
        """init_distributed with this role's layout; returns the ``ParallelConfig``."""
        from verl_lite.compat.lazy_compile import compile_decorators_deferred

        with compile_decorators_deferred():  # megatron's import-time torch.compile + wandb: ~1 s per worker
            import megatron.core  # noqa: F401
        from verl_lite.engine.distributed import ParallelConfig, init_distributed

        c = self.cfg
        parallel = ParallelConfig(tp=c.tp, pp=c.pp, vpp=c.vpp, cp=c.cp, sequence_parallel=c.sequence_parallel,
                                  ep=c.ep, etp=c.etp, timeout_s=c.timeout_s)
        init_distributed(self.rank, self.world_size, self.master_addr, self.master_port, parallel, seed=c.seed)
        return parallel

    def _train_config(self, parallel, **kwargs):
        from verl_lite.engine.config import EngineConfig, OptimConfig

        c = self.cfg
        optim = OptimConfig(**c.optim, use_distributed_optimizer=c.use_distributed_optimizer)
        return EngineConfig(model_path=c.model_path, parallel=parallel, optim=optim,
                            calculate_per_token_loss=c.calculate_per_token_loss, seed=c.seed,
                            model_overrides=dict(c.model_overrides), params_dtype=c.params_dtype,
                            lora=self._lora_config(), **kwargs)

    def _lora_config(self):
        """The engine's ``LoraConfig`` of this role, or None."""
        if self.cfg.lora is None:
            return None
        from verl_lite.engine.lora import LoraConfig

        return LoraConfig(**self.cfg.lora)

    def _owner_engine(self):
        raise NotImplementedError

    def layout(self) -> dict:
        from verl_lite.engine.distributed import data_parallel_rank, data_parallel_size

        engine = self._owner_engine()
        return {"dp_rank": data_parallel_rank(), "dp_size": data_parallel_size(),
                "is_output_owner": bool(engine.is_output_owner), "shares_prompts": bool(engine.share_prompts)}

    def shutdown(self) -> None:
        from verl_lite.engine.distributed import destroy_distributed

        destroy_distributed()
