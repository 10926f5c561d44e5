"""Process groups for the engine: one default group plus megatron's TP/PP/CP/DP groups.

Every group carries the timeout from ``ParallelConfig.timeout_s``, so a dead or diverged peer
turns into an error on the waiting ranks after that many seconds, never a 30-minute hang.
On a CPU-only torch the CPU adapter is installed first and the backend is gloo; with CUDA the
backend is nccl and the adapter stays off.

Megatron's rank order is ``tp-cp-ep-dp-pp``: TP varies fastest, then CP, then DP, then PP.
Expert layers use a second decomposition of the same ranks, ``etp-ep-edp-pp`` (expert TP, expert
parallel, expert data parallel); its groups (EP, ETP, expert-DP) get the same timeout.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from verl_lite.compat import cpu_adapter, megatron_internals


@dataclass
class ParallelConfig:
    """Model-parallel layout. DP is whatever is left: ``world_size // (tp * pp * cp)``.

    tp: tensor parallel size; pp: pipeline stages; vpp: virtual stages (model chunks) per
    pipeline rank, None to disable; cp: context parallel size; sequence_parallel: megatron
    sequence parallelism (needs tp > 1); timeout_s: timeout of every process group (required: the
    config's ``megatron.timeout_s`` holds its default).
    ep: expert parallel size (mixture-of-experts models only; the experts of every MoE layer are
    split over ep ranks carved out of DP x CP x TP); etp: expert tensor parallel size (1: every
    expert whole on its rank). ``tp*cp*dp`` must divide by ``ep*etp``.
    """

    timeout_s: float = field(kw_only=True)
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    cp: int = 1
    sequence_parallel: bool = False
    ep: int = 1
    etp: int = 1

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp

    def dp(self, world_size: int) -> int:
        return world_size // self.model_parallel_size

    def validate(self, world_size: int | None = None) -> "ParallelConfig":
        """Raise ValueError naming the problem and the fix; return self when the layout is valid."""
        from verl_lite.engine.rules import layout_problems

        for name in ("ep", "etp"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"parallel.{name}={v!r} must be an integer >= 1")
        problems = layout_problems("parallel", vars(self), world_size)
        if problems:
            raise ValueError("; ".join(problems))
        if self.etp != 1:
            raise ValueError(
                f"parallel.etp={self.etp}: expert tensor parallelism > 1 is not supported yet (the HF bridge "
                "shards experts whole); set expert_tensor_parallel_size=1"
            )
        if world_size is not None and (self.ep > 1 or self.etp > 1):
            dense_ranks = world_size // self.pp  # TP x CP x DP ranks of one pipeline stage
            if dense_ranks % (self.ep * self.etp):
                raise ValueError(
                    f"expert parallelism ep*etp = {self.ep}*{self.etp} must divide tp*cp*dp = {dense_ranks} "
                    f"(world size {world_size} / pp {self.pp}); change ep or the number of processes"
                )
        return self


def init_distributed(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    parallel: ParallelConfig,
    seed: int = 1234,
) -> None:
    """Create the default process group and megatron's model-parallel groups, and seed RNGs.

    gloo on CPU (after installing the CPU adapter), nccl on GPU (device = ``LOCAL_RANK`` or
    ``rank % device_count``). All groups use ``timeout_s``. Same seed on every rank; megatron
    derives the per-TP-rank streams from it. Calling it again in an initialised process (same
    rank and world size) keeps the default group and rebuilds megatron's groups for ``parallel``.
    """
    from megatron.core import parallel_state, tensor_parallel

    parallel.validate(world_size)
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        cpu_adapter.install()
    else:
        local_rank = int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count()))
        torch.cuda.set_device(local_rank)
    timeout = timedelta(seconds=parallel.timeout_s)
    if dist.is_initialized():
        if dist.get_world_size() != world_size or dist.get_rank() != rank:
            raise RuntimeError(
                f"torch.distributed is already initialised as rank {dist.get_rank()}/{dist.get_world_size()}, "
                f"not {rank}/{world_size}; call destroy_distributed() first"
            )
    else:
        from verl_lite.utils.rendezvous import rendezvous_store  # rank 0 listens on master_addr only

        dist.init_process_group(
            backend="nccl" if on_gpu else "gloo",
            store=rendezvous_store(master_addr, master_port, rank, world_size, timeout),
            rank=rank,
            world_size=world_size,
            timeout=timeout,
        )
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp,
        context_parallel_size=parallel.cp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.etp,
        distributed_timeout_minutes=parallel.timeout_s / 60.0,  # only used as timedelta(minutes=...)
    )
    megatron_internals.apply_timeout_to_groups(timeout)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=not on_gpu)


def destroy_distributed() -> None:
    """Tear down megatron's groups and the default group (safe to call twice)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def data_parallel_rank() -> int:
    """Rank within the DP group (without CP)."""
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_rank()


def data_parallel_size() -> int:
    """Size of the DP group (without CP)."""
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_world_size()
