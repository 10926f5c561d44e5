"""Per-token log-probs and entropy from vocab-parallel logits, never gathering the full vocabulary.

The LM head is a megatron ``ColumnParallelLinear`` with ``parallel_output=True``: TP rank r holds
logits for the vocabulary slice ``[r*V/tp, (r+1)*V/tp)``. Both functions take that local slice,
``[..., V/tp]``, and return per-token values ``[...]``, identical on every TP rank, in float32
(float64 for float64 input).
Gradients flow to the local slice only; megatron's column-parallel backward sums the slices'
contributions to the hidden states over TP.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _tp_group(group):
    if group is not None:
        return group
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """float32, or float64 when the input is float64."""
    return torch.promote_types(x.dtype, torch.float32)


def _fresh_copy(x: torch.Tensor) -> torch.Tensor:
    dtype = _compute_dtype(x)
    return x.clone() if x.dtype == dtype else x.to(dtype)


def vocab_parallel_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[labels] over the full (TP-sharded) vocabulary.

    logits: ``[..., V/tp]`` local slice; labels: ``[...]`` global token ids. Returns ``[...]`` (>= float32).
    Uses megatron's ``vocab_parallel_cross_entropy`` (which overwrites its input, hence the copy).
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree on the token dims")
    return -vocab_parallel_cross_entropy(_fresh_copy(logits), labels)


class _VocabParallelEntropy(torch.autograd.Function):
    """H = log Z - sum_v p_v x_v with Z = sum_v exp(x_v), p = softmax(x), sums over the full vocab.

    Forward: all-reduce MAX of the local maxima, SUM of the local partition sums and of the local
    sum_v p_v x_v. Backward (local, no communication): dH/dx_v = p_v * (sum_u p_u x_u - x_v).
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, group) -> torch.Tensor:
        x = logits.to(_compute_dtype(logits))
        world = dist.get_world_size(group) if group is not None else 1
        m = x.max(dim=-1, keepdim=True).values
        if world > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        e = torch.exp(x - m)
        z = e.sum(dim=-1, keepdim=True)
        px = (e * x).sum(dim=-1, keepdim=True)
        if world > 1:
            zpx = torch.cat([z, px], dim=-1)
            dist.all_reduce(zpx, op=dist.ReduceOp.SUM, group=group)
            z, px = zpx[..., :1], zpx[..., 1:]
        mean_x = px / z  # sum_v p_v x_v
        lse = m + torch.log(z)
        ctx.save_for_backward(logits, lse, mean_x)
        return (lse - mean_x).squeeze(-1)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, lse, mean_x = ctx.saved_tensors
        x = logits.to(_compute_dtype(logits))
        p = torch.exp(x - lse)
        grad = grad_out.unsqueeze(-1) * p * (mean_x - x)
        return grad.to(logits.dtype), None


def vocab_parallel_entropy(logits: torch.Tensor, group=None) -> torch.Tensor:
    """Entropy of softmax(logits) over the full vocabulary; logits ``[..., V/tp]`` -> ``[...]`` (>= float32).

    ``group`` defaults to megatron's tensor-parallel group.
    """
    return _VocabParallelEntropy.apply(logits, _tp_group(group))
