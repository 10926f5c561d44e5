"""megatron-core 0.16.1 internals verl_lite relies on: its process groups' timeout, the MoE alltoall dispatcher on a
CPU-only torch, the distributed optimizer's state and torch Adam, its MLP class and its RoPE (each function says
what it reaches). The engine's own pieces are passed in: this package imports nothing of the engine.
"""

from __future__ import annotations

import contextlib
import functools
from datetime import timedelta

import torch
import torch.distributed as dist

from verl_lite.compat import require

require("megatron-core", "verl_lite.compat.megatron_internals")
require("torch", "verl_lite.compat.megatron_internals")  # its process groups' timeout, its fused Adam


def apply_timeout_to_groups(timeout: timedelta) -> None:
    """Give every group megatron created the timeout: megatron 0.16.1 creates its expert-data-parallel
    gloo groups without one (``parallel_state.py:1278``), which would leave them at 30 minutes."""
    from megatron.core import parallel_state

    for group in parallel_state._global_process_group_list or []:
        if group is not None:  # None stands for the default group, created with the timeout
            dist.distributed_c10d._set_pg_timeout(timeout, group)


def reduce_replicated_experts(chunks, tf_config) -> None:
    """megatron 0.16.1 marks expert weights for the expert-data-parallel reduction (``allreduce=False``) only when
    EP > 1 (``ColumnParallelLinear`` / ``RowParallelLinear``: ``not (is_expert and expert_parallel)``). At EP = 1 with
    TP > ETP the TP ranks hold the same experts but route different tokens (sequence parallelism), so their
    gradients must be summed over the expert-data-parallel group, which the DP x CP reduction of ``allreduce=True``
    skips: each TP rank would train its copy of the experts on its own tokens. Mark them as EP > 1 does (before
    the DDP wrap, which files them by that attribute)."""
    etp = tf_config.expert_tensor_parallel_size or tf_config.tensor_model_parallel_size
    if tf_config.num_moe_experts is None or tf_config.expert_model_parallel_size > 1 \
            or tf_config.tensor_model_parallel_size <= etp:
        return
    for chunk in chunks:
        for module in chunk.modules():
            if getattr(module, "is_expert", False):
                for param in module.parameters(recurse=False):
                    param.allreduce = False


def prepare_host_dispatch() -> None:
    """Before building MoE layers on a CPU-only torch: give megatron's alltoall dispatcher a placeholder for the
    class-level device-to-host copy stream (``torch.cuda.Stream()``) it creates unless one exists. No-op with CUDA."""
    if torch.cuda.is_available():
        return
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    if MoEAlltoAllTokenDispatcher.cuda_dtoh_stream is None:
        MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = object()  # a placeholder: never used as a stream


def make_dispatchers_host_safe(model) -> None:
    """After building on a CPU-only torch: the alltoall dispatchers' copy-to-host + stream synchronise step
    (``_maybe_dtoh_and_synchronize``) runs without streams: at its DtoH point the split sizes become numpy arrays
    (what ``all_to_all`` expects, as megatron's copy makes them); there is nothing to copy or wait for. No-op with
    CUDA."""
    if torch.cuda.is_available():
        return
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    def host_dtoh(d, point: str, tokens_per_expert=None):
        if not d.drop_and_pad and point == d.cuda_dtoh_point:
            for name in ("input_splits", "output_splits", "output_splits_tp"):
                value = getattr(d, name, None)
                if torch.is_tensor(value):
                    setattr(d, name, value.numpy())
        return tokens_per_expert

    for module in model.modules():
        dispatcher = getattr(module, "token_dispatcher", None)
        if isinstance(dispatcher, MoEAlltoAllTokenDispatcher):
            dispatcher._maybe_dtoh_and_synchronize = functools.partial(host_dtoh, dispatcher)


def in_process_save_results() -> None:
    """Before a synchronous ``dist_checkpointing.save``: give megatron's torch_dist writer a thread queue for its
    results; megatron 0.16.1 creates a spawned ``multiprocessing`` Manager's (``strategies/filesystem_async.py:51``),
    a server process that re-imports the caller's main module and outlives the save."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()


def each_optimizer(optimizer) -> list:
    """megatron's optimizers behind ``optimizer``: a ``ChainedOptimizer``'s ``chained_optimizers`` (dense and
    expert parameters), else ``optimizer`` itself. Each wraps a torch optimizer as ``.optimizer``."""
    return getattr(optimizer, "chained_optimizers", [optimizer])


def main_param_shard_range(optimizer, param) -> tuple[int, int]:
    """[start, end) of ``param``'s flattened elements whose fp32 main copy this DP rank holds, read from the
    distributed optimizer (of ``optimizer``) that manages ``param`` (its private ``_get_model_param_range_map``).
    Raises KeyError when none does."""
    for opt in each_optimizer(optimizer):
        if param in getattr(opt, "model_param_gbuf_map", {}):
            r = opt._get_model_param_range_map(param)["param"]
            return r.start, r.end
    raise KeyError("parameter not managed by the distributed optimizer")


@contextlib.contextmanager
def torch_adam_step_fix(optimizer):
    """While active, loading the ``fully_reshardable`` format into a distributed optimizer on torch's Adam fills
    each parameter's missing ``step`` (restored with the param groups) with the value already restored, where
    ``_set_main_param_and_optimizer_states`` would raise ``KeyError: 'step'``."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    patched = []
    for opt in each_optimizer(optimizer):
        if not isinstance(opt, DistributedOptimizer):
            continue
        original = opt._set_main_param_and_optimizer_states

        def set_states(model_param, tensors, opt=opt, original=original):
            group_index, group_order = opt.model_param_group_index_map[model_param]
            state = opt.optimizer.state[opt.optimizer.param_groups[group_index]["params"][group_order]]
            if "step" in state and "step" not in tensors:
                tensors = dict(tensors, step=state["step"])
            original(model_param, tensors)

        opt._set_main_param_and_optimizer_states = set_states
        patched.append(opt)
    try:
        yield
    finally:
        for opt in patched:
            del opt._set_main_param_and_optimizer_states


def use_fused_adam(optimizer) -> None:
    """Run megatron's torch Adam/AdamW (without Apex/TE: torch's per-parameter loop) with torch's fused kernel
    (the per-group ``fused=True``) wherever torch has one for the group's device and dtypes: the same update to
    rounding (~1 ulp). The engine calls it again after a load (a checkpoint's groups carry the flag they were saved
    with); the step counters move to the parameters' device, as the fused kernel requires."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    devices = set(_get_fused_kernels_supported_devices())
    for opt in each_optimizer(optimizer):
        inner = getattr(opt, "optimizer", None)
        if not isinstance(inner, torch.optim.Adam | torch.optim.AdamW):  # TE's / Apex's fused Adams are not torch's
            continue
        for group in inner.param_groups:
            params = group["params"]
            if group.get("differentiable") or not params:
                continue
            if any(p.device.type not in devices or not torch.is_floating_point(p) for p in params):
                continue
            group.update(fused=True, foreach=False)
            for p in params:
                step = inner.state.get(p, {}).get("step")
                if torch.is_tensor(step) and step.device != p.device:
                    inner.state[p]["step"] = step.to(p.device)


def unshare_adam_steps(optimizer) -> None:
    """Give each parameter its own ``step`` tensor: megatron's load_state_dict shares one, which torch's Adam would
    increment once per parameter per optimizer step (wrong bias correction after a resume)."""
    for opt in each_optimizer(optimizer):
        for state in opt.optimizer.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].detach().clone()


def plain_rotary(config) -> bool:
    """RoPE in the case :func:`use_rotary_kernel` computes itself: rotate-half over the head dim, unfused, no MLA."""
    return not config.apply_rope_fusion and not config.rotary_interleaved and not config.multi_latent_attention


def use_rotary_kernel(rotary=None) -> None:
    """Route megatron's unfused RoPE (``transformer/attention.py``'s ``apply_rotary_pos_emb``) through ``rotary(t,
    cos, sin)`` (the engine's) in the :func:`plain_rotary` case with ``mscale`` 1, bshd or packed THD at CP 1 (THD
    positions restart at every ``cu_seqlens`` boundary, as megatron's ``_apply_rotary_pos_emb_thd`` case 2), or a
    pack with shared prompts (``cu_seqlens.shared_prompts``, engine/packing.py: rows carry their positions; refused
    outside that case). ``rotary`` None: only shared-prompt packs are taken (their per-row frequencies handed to
    megatron's bshd path). Everything else runs megatron's own; idempotent for the same ``rotary``."""
    import megatron.core.transformer.attention as attention_module

    current = attention_module.apply_rotary_pos_emb
    if getattr(current, "verl_lite_rotary", current) is rotary:
        return
    original = getattr(current, "verl_lite_original", current)

    def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None):
        plain = plain_rotary(config) and mscale == 1.0 and freqs.shape[-1] == t.shape[-1]
        shared = getattr(cu_seqlens, "shared_prompts", None)
        if shared is not None:
            if not plain or (cp_group is not None and cp_group.size() > 1):
                raise NotImplementedError("a pack with shared prompts needs the plain RoPE case at CP=1")
            packed = freqs[shared.positions].reshape(t.shape[0], 1, t.shape[-1])
            if rotary is None:
                return original(t, packed, config, mscale=mscale, cp_group=cp_group)
            return rotary(t, torch.cos(packed).to(t.dtype), torch.sin(packed).to(t.dtype))
        if rotary is None:
            return original(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group)
        if plain and cu_seqlens is None:
            return rotary(t, torch.cos(freqs).to(t.dtype), torch.sin(freqs).to(t.dtype))
        if plain and cp_group is not None and cp_group.size() == 1:
            tokens = int(cu_seqlens[-1])
            if tokens == t.shape[0] and freqs.shape[0] != tokens:  # megatron's case 1 keys freqs by pack row
                starts = cu_seqlens[:-1].to(torch.long)
                lengths = cu_seqlens[1:].to(torch.long) - starts
                positions = torch.arange(tokens, device=t.device) - torch.repeat_interleave(
                    starts, lengths, output_size=tokens)
                packed = freqs[positions].reshape(tokens, 1, t.shape[-1])
                return rotary(t, torch.cos(packed).to(t.dtype), torch.sin(packed).to(t.dtype))
        return original(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group)

    apply_rotary_pos_emb.verl_lite_rotary = rotary
    apply_rotary_pos_emb.verl_lite_original = original
    attention_module.apply_rotary_pos_emb = apply_rotary_pos_emb


def use_swiglu_mlp(model, mlp_class) -> None:
    """Make every module of ``model`` whose class is exactly megatron's ``MLP`` an ``mlp_class`` (a subclass adding
    no state), MoE experts included; not in the layer spec, where ``TransformerLayer`` passes the TP group only to
    ``MLP`` itself."""
    from megatron.core.transformer.mlp import MLP

    if not issubclass(mlp_class, MLP):
        raise TypeError(f"use_swiglu_mlp: {mlp_class.__name__} is not a subclass of megatron's MLP")
    for module in model.modules():
        if type(module) is MLP:
            module.__class__ = mlp_class
