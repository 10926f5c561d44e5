"""The one door to the engine's CPU speed paths: every piece that has one asks :func:`cpu_speed_paths`.

The CPU speed paths (each proven exact against the standard path: ``tests/engine/test_elementwise.py``,
``tests/engine/test_model_attention.py``, ``tests/engine/test_speed_paths.py``):

- norm: :class:`verl_lite.engine.elementwise.RMSNorm` (a hand-written backward);
- MLP: megatron's dense ``MLP``s re-classed as :class:`verl_lite.engine.mlp.SwiGLUMLP` (SwiGLU as one function);
- RoPE: megatron's unfused RoPE routed through :func:`verl_lite.engine.elementwise.rotary`
  (``compat.megatron_internals.use_rotary_kernel``, a process-wide patch);
- attention: causal attention over short sequences as two matmuls (``attention.causal_matmul_attention``).

On: the engine runs on the CPU (no CUDA device). Off (CUDA): megatron's own pieces, as its layer specs build
them: the norm is ``TENorm`` with Transformer Engine installed, else megatron's local ``WrappedTorchNorm``;
megatron's ``MLP``; megatron's RoPE function; torch SDPA or flash-attn. Two exceptions keep features working:

- sequence parallelism without Transformer Engine: megatron's local norm refuses it, so the engine's RMSNorm is
  built (it marks its weight for megatron's sequence-parallel gradient all-reduce);
- shared prompts (``engine/packing.py``): a pack's rows carry their own RoPE positions, which megatron's function
  cannot be told. The RoPE routing is installed, but it takes only such a pack, and hands its per-row frequencies
  to megatron's own function; every other call is megatron's unchanged.
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
