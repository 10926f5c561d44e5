"""Batch-invariant forwards: a token's outputs depend on its own sequence only, bit for bit.

:class:`BatchInvariantMode` (a ``TorchFunctionMode``) calls every token-major kernel whose rounding could depend
on the batch on blocks of exactly ``ROW_CHUNK`` rows (zero rows pad the last block): matmuls against a 2-D
weight, the transcendental elementwise functions and the reductions over the last dimension. Exact operations
(add, mul, div, max, gathers) and batched matmuls (the attention's, called at a fixed key length by
``attention.PackedCoreAttention``) run as they are; fused multiply-adds, which round once on the vector path and
twice on the scalar one, are not used (:func:`active`). Gradients flow through the blocks unchanged (the backward
is not itself batch-invariant, and need not be). Why and the evidence: docs/algorithms.md,
"Consistency mode (`rollout.batch_invariant`)".
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# Rows per kernel call: a multiple of every SIMD width, so a block of any row width has no scalar tail.
ROW_CHUNK = 128


def rowwise(fn, x: torch.Tensor):
    """``fn(block)`` on fixed ``[ROW_CHUNK, width]`` blocks of ``x``'s rows (``x``: ``[..., width]``; 1-D: one value
    per row), concatenated back: ``fn`` must act on each row alone."""
    if x.dim() == 1:
        return rowwise(fn, x.unsqueeze(-1)).reshape(x.shape)
    lead, width = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, width)
    blocks = []
    for start in range(0, rows.shape[0], ROW_CHUNK):
        block = rows[start:start + ROW_CHUNK]
        short = ROW_CHUNK - block.shape[0]
        block = torch.cat([block, block.new_zeros(short, width)]) if short else block.contiguous()
        blocks.append(fn(block))
    out = torch.cat(blocks)[: rows.shape[0]] if blocks else fn(rows)
    return out.reshape(*lead, *out.shape[1:])


# matmuls (input, weight): blocked where the weight is 2-D
_WEIGHT_MATMULS = {F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.mm, torch.Tensor.mm}
# elementwise functions of one tensor whose vector and scalar paths may round differently
_UNARY = {torch.exp, torch.Tensor.exp, torch.log, torch.Tensor.log, torch.sigmoid, torch.Tensor.sigmoid,
          torch.tanh, torch.Tensor.tanh, torch.rsqrt, torch.Tensor.rsqrt, torch.sqrt, torch.Tensor.sqrt,
          F.silu, F.gelu, F.softplus, torch.log1p, torch.Tensor.log1p, torch.expm1, torch.Tensor.expm1,
          torch.cos, torch.Tensor.cos, torch.sin, torch.Tensor.sin, torch.pow, torch.Tensor.pow}
# reductions and normalisations over the last dimension
_LAST_DIM = {torch.sum, torch.Tensor.sum, torch.mean, torch.Tensor.mean, torch.logsumexp, torch.Tensor.logsumexp,
             torch.softmax, torch.Tensor.softmax, F.softmax, torch.log_softmax, torch.Tensor.log_softmax,
             F.log_softmax, torch.linalg.vector_norm, torch.Tensor.norm}


# where ``dim`` sits among the positional arguments (the tensor first), where it is not second
_DIM_POSITION = {torch.linalg.vector_norm: 2, torch.Tensor.norm: 2}


def _is_last_dim(func, args: tuple, kwargs: dict) -> bool:
    """Whether ``func(*args, **kwargs)`` reduces (or normalises) a tensor of 2+ dims over its last dimension only."""
    x, position = args[0], _DIM_POSITION.get(func, 1)
    dim = kwargs.get("dim", args[position] if len(args) > position else None)
    if isinstance(dim, (tuple, list)):
        dim = dim[0] if len(dim) == 1 else None
    return isinstance(dim, int) and x.dim() >= 2 and dim in (-1, x.dim() - 1)


_modes = threading.local()  # torch-function modes are per thread, and so is this count


def active() -> bool:
    """Whether a :class:`BatchInvariantMode` is on in this thread: code with a fused kernel whose rounding depends on
    the element's place in its buffer (``elementwise.rotary``'s multiply-adds) takes its plain form then."""
    return getattr(_modes, "depth", 0) > 0


class BatchInvariantMode(TorchFunctionMode):
    """Within it, the token-major kernels run on fixed ``ROW_CHUNK``-row blocks (the module docstring)."""

    def __enter__(self):
        _modes.depth = getattr(_modes, "depth", 0) + 1
        return super().__enter__()

    def __exit__(self, *exc):
        _modes.depth -= 1
        return super().__exit__(*exc)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _WEIGHT_MATMULS and len(args) >= 2 and "out" not in kwargs and _is_weight_matmul(*args[:2]):
            first, weight, *rest = args
            return rowwise(lambda block: func(block, weight, *rest, **kwargs), first)
        if (func is torch.addmm and len(args) == 3 and "out" not in kwargs and args[1].dim() == 2
                and (not isinstance(args[0], torch.Tensor) or args[0].dim() <= 1)):
            bias, first, weight = args
            return rowwise(lambda block: torch.addmm(bias, block, weight, **kwargs), first)
        if (func in _UNARY and args and isinstance(args[0], torch.Tensor) and args[0].dim() >= 1
                and args[0].is_floating_point() and not kwargs.get("inplace") and _scalar_operands(args[1:])):
            out = kwargs.pop("out", None)
            result = rowwise(lambda block: func(block, *args[1:], **kwargs), args[0])
            return result if out is None else out.copy_(result)
        if (func in _LAST_DIM and args and isinstance(args[0], torch.Tensor) and "out" not in kwargs
                and _is_last_dim(func, args, kwargs)):
            return rowwise(lambda block: func(block, *args[1:], **kwargs), args[0])
        return func(*args, **kwargs)


def _scalar_operands(rest: tuple) -> bool:
    """Whether the further operands of an elementwise call are scalars (a tensor operand, as ``pow``'s exponent,
    would not line up with the blocks)."""
    return all(not isinstance(x, torch.Tensor) or x.numel() == 1 for x in rest)


def _is_weight_matmul(first, second) -> bool:
    return (isinstance(first, torch.Tensor) and isinstance(second, torch.Tensor) and first.dim() >= 2
            and second.dim() == 2)
