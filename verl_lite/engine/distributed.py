"""Process groups for the engine: one default group plus megatron's TP/PP/CP/DP (and expert) groups.

Every group carries the timeout from ``MegatronConfig.timeout_s``, so a dead or diverged peer turns into
an error on the waiting ranks, never a 30-minute hang. Megatron's rank order is ``tp-cp-ep-dp-pp`` (TP
varies fastest); expert layers use ``etp-ep-edp-pp`` over the same ranks.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from verl_lite.compat import cpu_adapter, megatron_internals
from verl_lite.engine.config import MegatronConfig


def init_distributed(rank: int, world_size: int, master_addr: str, master_port: int, parallel: MegatronConfig,
                     seed: int = 1234) -> None:
    """Create the default process group and megatron's model-parallel groups, and seed RNGs.

    gloo on CPU (after installing the CPU adapter), nccl on GPU (device = ``LOCAL_RANK`` or
    ``rank % device_count``). Same seed on every rank (megatron derives the per-TP-rank streams). Called
    again in an initialised process (same rank and world size) it rebuilds megatron's groups only."""
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
                f"not {rank}/{world_size}; call destroy_distributed() first")
    else:
        from verl_lite.utils.rendezvous import rendezvous_store  # rank 0 listens on master_addr only

        dist.init_process_group(backend="nccl" if on_gpu else "gloo", rank=rank, world_size=world_size, timeout=timeout,
                                store=rendezvous_store(master_addr, master_port, rank, world_size, timeout))
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp, pipeline_model_parallel_size=parallel.pp,
        virtual_pipeline_model_parallel_size=parallel.vpp, context_parallel_size=parallel.cp,
        expert_model_parallel_size=parallel.ep, expert_tensor_parallel_size=parallel.etp,
        distributed_timeout_minutes=parallel.timeout_s / 60.0)  # only used as timedelta(minutes=...)
    megatron_internals.apply_timeout_to_groups(timeout)
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=not on_gpu)


def destroy_distributed() -> None:
    """Tear down megatron's groups and the default group (safe to call twice)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def merged_over(group, mine: dict) -> dict:
    """The union of every rank's ``mine`` over ``group`` (collective); ``mine`` itself in a group of one."""
    size = dist.get_world_size(group)
    if size == 1:
        return mine
    gathered = [None] * size
    dist.all_gather_object(gathered, mine, group=group)
    return {k: v for d in gathered for k, v in d.items()}


def data_parallel_rank() -> int:
    """Rank within the DP group (without CP)."""
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_rank()


def data_parallel_size() -> int:
    """Size of the DP group (without CP)."""
    from megatron.core import parallel_state

    return parallel_state.get_data_parallel_world_size()
