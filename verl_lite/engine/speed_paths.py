"""The one door to the engine's CPU speed paths: every piece that has one asks :func:`cpu_speed_paths`.

The CPU speed paths, each proven exact against the standard path (``tests/engine/test_speed_paths.py`` and
its neighbours): the norm :class:`elementwise.RMSNorm`; megatron's dense MLPs re-classed as
:class:`mlp.SwiGLUMLP`; megatron's RoPE routed through :func:`elementwise.rotary` (a process-wide patch,
``compat.megatron_internals.use_rotary_kernel``); short causal attention as two matmuls
(``attention.causal_matmul_attention``).

On: the engine runs on the CPU. Off (CUDA): megatron's own pieces (``TENorm`` with Transformer Engine, else
``WrappedTorchNorm``; ``MLP``; megatron's RoPE; SDPA or flash-attn), with two exceptions that keep features
working: sequence parallelism without Transformer Engine builds the engine's RMSNorm (megatron's local norm
refuses SP), and packs with shared prompts (``engine/packing.py``) still go through the RoPE routing, which
hands their per-row frequencies to megatron's own function and leaves every other call unchanged.
"""

from __future__ import annotations

import importlib.util

import torch

from verl_lite.engine.elementwise import RMSNorm, rotary


def cpu_speed_paths() -> bool:
    """Whether the engine takes its CPU speed paths: True when this process has no CUDA device."""
    return not torch.cuda.is_available()


def norm_class(config) -> type:
    """The RMSNorm module class the layer spec builds (see the module docstring)."""
    if cpu_speed_paths():
        return RMSNorm
    if _have_transformer_engine():
        from megatron.core.extensions.transformer_engine import TENorm

        return TENorm
    if config.sequence_parallel:
        return RMSNorm  # megatron's WrappedTorchNorm asserts sequence_parallel is off
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    return WrappedTorchNorm


def _have_transformer_engine() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def route_rotary() -> None:
    """Before building models: megatron's RoPE routed through the engine's on the CPU paths; otherwise only packs
    with shared prompts are routed, to megatron's own function. Idempotent."""
    from verl_lite.compat import megatron_internals

    megatron_internals.use_rotary_kernel(rotary if cpu_speed_paths() else None)


def adapt_built_model(model) -> None:
    """After building a ``GPTModel``: on the CPU paths its dense MLPs become ``SwiGLUMLP``; otherwise unchanged."""
    if not cpu_speed_paths():
        return
    from verl_lite.compat import megatron_internals
    from verl_lite.engine.mlp import SwiGLUMLP  # engine.mlp imports megatron-core at its top

    megatron_internals.use_swiglu_mlp(model, SwiGLUMLP)
