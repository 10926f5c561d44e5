"""Per-token log-probs and entropy from vocab-parallel logits, never gathering the full vocabulary.

The LM head is a megatron ``ColumnParallelLinear`` with ``parallel_output=True``: TP rank r holds
logits for the vocabulary slice ``[r*Vp/tp, (r+1)*Vp/tp)`` of the *padded* vocabulary
``Vp = padded_vocab_size(V, tp)`` (the one padding rule of the engine, used by the model, the HF
bridge and checkpoints). Both functions take that local slice, ``[..., Vp/tp]``, and the true vocabulary size ``V``;
the padded columns (global index >= V) are masked out of every softmax, so they never enter a
log-prob, an entropy or a gradient (their gradient is exactly 0). They return per-token values
``[...]``, identical on every TP rank, in float32 (float64 for float64 input).
Gradients flow to the local slice only; megatron's column-parallel backward sums the slices'
contributions to the hidden states over TP.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


# megatron's ``--make-vocab-size-divisible-by`` (its default, 128).
MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = MAKE_VOCAB_SIZE_DIVISIBLE_BY) -> int:
    """The vocabulary size the engine builds: ``vocab_size`` rounded up to a multiple of
    ``lcm(divisible_by, tp)``, so every TP rank holds the same number of rows.

    megatron rounds up to a multiple of ``divisible_by * tp``, which gives every TP layout its own
    padded size. The lcm is the same for every power-of-two TP up to ``divisible_by``, so the padded
    size, and with it every checkpoint shape, is the same at TP 1, 2, 4, ..., 128 (checkpoints reshard
    between them), and a vocabulary that is a multiple of 128 (every shipped config's) is never
    padded at those TPs. Other TPs (3, 7, ...) may pad further.
    """
    if vocab_size < 1 or tp < 1 or divisible_by < 1:
        raise ValueError(f"padded_vocab_size: vocab_size={vocab_size}, tp={tp}, divisible_by={divisible_by} must be >= 1")
    multiple = math.lcm(divisible_by, tp)
    return -(-vocab_size // multiple) * multiple


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


def _padding_mask(local_size: int, vocab_size: int | None, group, device) -> torch.Tensor | None:
    """Bool ``[local_size]``: True at this TP rank's padded columns (global index >= ``vocab_size``);
    None when this rank holds none (or ``vocab_size`` is None)."""
    if vocab_size is None:
        return None
    world = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    if vocab_size > local_size * world:
        raise ValueError(
            f"vocab_size={vocab_size} exceeds the logits' vocabulary ({local_size} columns x tp={world}); "
            "pass the model's true vocabulary size"
        )
    start = rank * local_size
    if start + local_size <= vocab_size:
        return None
    return torch.arange(start, start + local_size, device=device) >= vocab_size


def vocab_parallel_log_probs(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int | None = None) -> torch.Tensor:
    """log softmax(logits)[labels] over the true vocabulary (TP-sharded, padding excluded).

    logits: ``[..., Vp/tp]`` local slice; labels: ``[...]`` global token ids < ``vocab_size``;
    ``vocab_size``: the true vocabulary size V (None: no padding, every column is a token).
    Returns ``[...]`` (>= float32). Uses megatron's ``vocab_parallel_cross_entropy`` (which
    overwrites its input, hence the copy) on the copy with padded columns set to -inf.
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree on the token dims")
    x = _fresh_copy(logits)
    pad = _padding_mask(logits.shape[-1], vocab_size, _tp_group(None), logits.device)
    if pad is not None:
        x = x.masked_fill(pad, float("-inf"))
    if vocab_size is not None and labels.numel() and int(labels.max()) >= vocab_size:
        raise ValueError(f"label {int(labels.max())} is outside the vocabulary (vocab_size={vocab_size})")
    return -vocab_parallel_cross_entropy(x, labels)


class _VocabParallelEntropy(torch.autograd.Function):
    """H = log Z - sum_v p_v x_v with Z = sum_v exp(x_v), p = softmax(x), sums over the full vocab.

    Forward: all-reduce MAX of the local maxima, SUM of the local partition sums and of the local
    sum_v p_v x_v. Backward (local, no communication): dH/dx_v = p_v * (sum_u p_u x_u - x_v).
    Padded columns (``pad``, True where masked) take no part: p_v = 0 there, and so is their gradient.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, group, pad) -> torch.Tensor:
        x = _masked(logits.to(_compute_dtype(logits)), pad)
        world = dist.get_world_size(group) if group is not None else 1
        m = x.max(dim=-1, keepdim=True).values
        if world > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        e = torch.exp(x - m)
        z = e.sum(dim=-1, keepdim=True)
        px = (e * _zeroed(x, pad)).sum(dim=-1, keepdim=True)
        if world > 1:
            zpx = torch.cat([z, px], dim=-1)
            dist.all_reduce(zpx, op=dist.ReduceOp.SUM, group=group)
            z, px = zpx[..., :1], zpx[..., 1:]
        mean_x = px / z  # sum_v p_v x_v
        lse = m + torch.log(z)
        ctx.pad = pad
        ctx.save_for_backward(logits, lse, mean_x)
        return (lse - mean_x).squeeze(-1)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, lse, mean_x = ctx.saved_tensors
        x = _masked(logits.to(_compute_dtype(logits)), ctx.pad)
        p = torch.exp(x - lse)  # 0 at padded columns
        grad = grad_out.unsqueeze(-1) * p * (mean_x - _zeroed(x, ctx.pad))
        return grad.to(logits.dtype), None, None


def _masked(x: torch.Tensor, pad: torch.Tensor | None) -> torch.Tensor:
    return x if pad is None else x.masked_fill(pad, float("-inf"))


def _zeroed(x: torch.Tensor, pad: torch.Tensor | None) -> torch.Tensor:
    return x if pad is None else x.masked_fill(pad, 0.0)


def vocab_parallel_entropy(logits: torch.Tensor, group=None, vocab_size: int | None = None) -> torch.Tensor:
    """Entropy of softmax(logits) over the true vocabulary; logits ``[..., Vp/tp]`` -> ``[...]`` (>= float32).

    ``group`` defaults to megatron's tensor-parallel group; ``vocab_size`` is the true vocabulary
    size V (None: no padding): columns with global index >= V are excluded.
    """
    group = _tp_group(group)
    pad = _padding_mask(logits.shape[-1], vocab_size, group, logits.device)
    return _VocabParallelEntropy.apply(logits, group, pad)
