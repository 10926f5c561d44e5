"""The decoder layer's elementwise blocks with hand-written backwards: fewer passes over the activations.

Eager autograd saves every primitive's inputs and runs one backward kernel per primitive, each a full
(memory-bound) pass over ``[tokens, width]``; as one ``autograd.Function`` the same math allocates and saves
less. The results equal autograd's to rounding (``tests/engine/test_elementwise.py``, against float64).
``engine/speed_paths.py`` decides where they run.

- :func:`rms_norm`: ``y = w * (x * r).to(dtype)``, ``r = 1 / sqrt(mean(x^2) + eps)`` per row, ``x`` in float32
  (as HF's RMSNorm). With ``x^ = x r`` and ``gy = g w`` (float32): ``dx = r (gy - x^ mean(gy x^))``,
  ``dw = sum over rows of g x^``, where ``mean(gy x^) = (g x^) . w / width`` reuses ``g x^``. In low precision
  the backward keeps ``g w`` and ``x^`` in float32.
- :func:`swiglu`: ``y = silu(a) * b`` for ``x = [a | b]`` (megatron's ``linear_fc1`` layout); ``da = silu'(a) g b``,
  ``db = g silu(a)`` written straight into the two halves of one ``dx``. Bit-identical to autograd's.
- :func:`rotary`: RoPE's ``x cos + [-x2 | x1] sin`` as one multiply and two in-place multiply-adds on the
  halves, backward ``g cos + [g2 | -g1] sin`` the same way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from verl_lite.engine import batch_invariant


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.float()
        # mean(x^2) as ||x||^2 / width: one pass, no [tokens, width] temporary
        norm = torch.linalg.vector_norm(x32, dim=-1, keepdim=True)
        rstd = torch.rsqrt(norm.square_().div_(x.shape[-1]).add_(eps))
        ctx.save_for_backward(x, weight, rstd)
        # activations first: a product whose first operand broadcasts along rows runs slower on CPU
        return (x32 * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        x_hat = x.float() * rstd
        grad32, weight32 = grad.float(), weight.float()
        grad_x_hat = grad32 * x_hat  # g x^: its row sums give dw, its rows dotted with w give mean(gy x^)
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = grad_x_hat.reshape(-1, grad.shape[-1]).sum(0).to(weight.dtype)
        mean_term = (grad_x_hat @ weight32).unsqueeze(-1).div_(x.shape[-1])
        grad_y = grad32 * weight32
        grad_x = grad_y.addcmul_(x_hat, mean_term, value=-1).mul_(rstd)
        return grad_x.to(x.dtype), grad_weight, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / sqrt(mean(x^2, -1) + eps))``, normalised in float32 and cast back before the weight."""
    return _RMSNorm.apply(x, weight, eps)


class RMSNorm(torch.nn.Module):
    """:func:`rms_norm` as the layer spec's norm module (same math as HF's), built by megatron as
    ``RMSNorm(config=..., hidden_size=..., eps=...)``. The weight carries ``sequence_parallel =
    config.sequence_parallel`` so that ``finalize_model_grads`` sums its gradient over TP when each TP rank saw
    only a slice of the sequence."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-6, **_unused):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        self.weight.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        activated = F.silu(gate)
        ctx.save_for_backward(x, activated)
        return activated * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, activated = ctx.saved_tensors
        gate, up = x.chunk(2, dim=-1)
        grad_x = torch.empty_like(x)
        grad_gate, grad_up = grad_x.chunk(2, dim=-1)
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=grad_gate)
        torch.mul(grad, activated, out=grad_up)
        return grad_x


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """``silu(a) * b`` for ``x = [a | b]`` (halves of the last dim)."""
    return _SwiGLU.apply(x)


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        out = x * cos
        out[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-1)
        out[..., half:].addcmul_(x[..., :half], sin[..., half:])
        ctx.save_for_backward(cos, sin)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin = ctx.saved_tensors
        half = grad.shape[-1] // 2
        grad_x = grad * cos
        grad_x[..., half:].addcmul_(grad[..., :half], sin[..., :half], value=-1)
        grad_x[..., :half].addcmul_(grad[..., half:], sin[..., half:])
        return grad_x, None, None


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the rotate-half layout: ``x cos + [-x2 | x1] sin`` for ``x = [x1 | x2]`` (halves of the last
    dim); ``cos``/``sin`` broadcast against ``x`` and are constants (no gradient). Batch-invariant passes take
    the unfused form (``batch_invariant.active``)."""
    if batch_invariant.active():
        first, second = x.chunk(2, dim=-1)
        return x * cos + torch.cat([-second, first], dim=-1) * sin
    return _Rotary.apply(x, cos, sin)
