"""The base of every worker role that hosts a ``MegatronEngine``: a role's workers (one Ray actor per engine rank)
join ONE torch.distributed world with the role's own TP/PP/VPP/CP layout; two roles never share one, so the
actor and the critic can use different layouts on the same machines.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from verl_lite.compat.lazy_compile import compile_decorators_deferred
from verl_lite.controller.worker_group import Worker
from verl_lite.engine.config import EngineConfig
from verl_lite.engine.distributed import data_parallel_rank, data_parallel_size, destroy_distributed, init_distributed
from verl_lite.engine.engine import MegatronEngine, SequenceBatch
from verl_lite.protocol import ROUTED_EXPERTS_KEY, Batch, response_lengths


@dataclass
class EngineWorkerConfig:
    """What an engine role builds: its ``EngineConfig`` (plain data, sent once by the controller)."""

    engine: EngineConfig


def sequence_batch(piece: Batch, loss_keys: tuple[str, ...] = (), routing: bool = False):
    """A Batch piece -> the engine's ``SequenceBatch`` (prompt + response tokens up to the last valid position:
    tokens in a mask's holes stay); ``loss_keys`` present in the piece travel to the loss as per-token data;
    ``routing`` (an engine built with routing_replay): the piece's ``ROUTED_EXPERTS_KEY``, where it has one, is replayed."""
    mask = piece["response_mask"]
    lengths = response_lengths(mask)
    responses = piece["responses"]
    input_ids = [
        torch.cat([torch.as_tensor(p, dtype=torch.long), responses[i, : int(lengths[i])].long()])
        for i, p in enumerate(piece["prompt_ids"])
    ]
    data = {k: piece[k] for k in loss_keys if k in piece}
    replay = piece[ROUTED_EXPERTS_KEY] if routing and ROUTED_EXPERTS_KEY in piece else None
    return SequenceBatch(input_ids, lengths, data, response_width=mask.shape[1], routing=replay)


class EngineWorker(Worker):
    """Joins the role's process group and reports its place for dispatch; ``engine``: the role's
    ``MegatronEngine`` (the one that owns the outputs), once ``init_model`` built it."""

    engine = None

    def __init__(self, rank: int, world_size: int, cfg: EngineWorkerConfig):
        super().__init__(rank, world_size)
        self.cfg = cfg

    def init_model(self) -> None:
        self.engine = MegatronEngine(self._init_world())

    def _init_world(self) -> EngineConfig:
        """init_distributed with this role's layout; returns its ``EngineConfig``."""
        with compile_decorators_deferred():  # megatron's import-time torch.compile + wandb: not paid per worker
            import megatron.core  # noqa: F401

        engine = self.cfg.engine
        init_distributed(self.rank, self.world_size, self.master_addr, self.master_port, engine.megatron,
                         seed=engine.seed)
        return engine

    def _train_jobs(self, jobs: list[dict], loss, loss_keys: tuple[str, ...], advance_lr: bool = True,
                    **step_kwargs) -> list[dict]:
        """One optimizer step per job (``RoleGroup.train``) of ``loss`` with the job's plan, then, at ``advance_lr``
        (the RL step's last call), one LR schedule step. Returns the engine's step metrics per job (loss metrics
        on output owners only)."""
        routing = self.engine.cfg.routing_replay
        results = [self.engine.train_step(sequence_batch(job["piece"], loss_keys, routing), job["micro_batches"],
                                          partial(loss, plan=job["plan"]), global_token_count=job["global_token_count"],
                                          **step_kwargs) for job in jobs]
        if jobs and advance_lr:
            self.engine.advance_lr_schedule()
        return results

    def layout(self) -> dict:
        return {"dp_rank": data_parallel_rank(), "dp_size": data_parallel_size(),
                "is_output_owner": bool(self.engine.is_output_owner), "shares_prompts": bool(self.engine.share_prompts)}

    def shutdown(self) -> None:
        destroy_distributed()
