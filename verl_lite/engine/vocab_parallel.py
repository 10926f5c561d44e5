"""Per-token log-probs, entropy and top-k from vocab-parallel logits, never gathering the full vocabulary.

TP rank r holds logits for the slice ``[r*Vp/tp, (r+1)*Vp/tp)`` of the *padded* vocabulary
``Vp = padded_vocab_size(V, tp)`` (the engine's one padding rule). Every function takes that local slice
``[..., Vp/tp]`` and the true vocabulary size ``V``; the padded columns are masked out of every softmax
(their gradient is exactly 0). They return per-token values ``[...]`` (``[..., K]`` for K ids per token),
identical on every TP rank, in float32 (float64 for float64 input); gradients flow to the local slice only.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist


# megatron's ``--make-vocab-size-divisible-by`` (its default, 128).
MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = MAKE_VOCAB_SIZE_DIVISIBLE_BY) -> int:
    """``vocab_size`` rounded up to a multiple of ``lcm(divisible_by, tp)``, so every TP rank holds the same rows.

    megatron rounds to ``divisible_by * tp``, a different size per TP layout; the lcm is the same at every
    power-of-two TP up to ``divisible_by``, so checkpoints reshard between them and a vocabulary that is a
    multiple of 128 is never padded there. Other TPs (3, 7, ...) may pad further."""
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


def _padding_mask(local_size: int, vocab_size: int | None, group, device) -> torch.Tensor | None:
    """Bool ``[local_size]``: True at this TP rank's padded columns (global index >= ``vocab_size``);
    None when this rank holds none (or ``vocab_size`` is None)."""
    if vocab_size is None:
        return None
    world = dist.get_world_size(group) if group is not None else 1
    rank = dist.get_rank(group) if group is not None else 0
    if vocab_size > local_size * world:
        raise ValueError(f"vocab_size={vocab_size} exceeds the logits' vocabulary ({local_size} columns x tp={world}); "
                         "pass the model's true vocabulary size")
    start = rank * local_size
    if start + local_size <= vocab_size:
        return None
    return torch.arange(start, start + local_size, device=device) >= vocab_size


def vocab_parallel_log_probs(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int | None = None) -> torch.Tensor:
    """log softmax(logits)[labels] over the true vocabulary; labels: ``[...]`` global token ids < ``vocab_size``
    (None: no padding). megatron's ``vocab_parallel_cross_entropy`` overwrites its input, hence the copy."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree on the token dims")
    dtype = _compute_dtype(logits)
    x = logits.clone() if logits.dtype == dtype else logits.to(dtype)
    x = _masked(x, _padding_mask(logits.shape[-1], vocab_size, _tp_group(None), logits.device))
    if vocab_size is not None and labels.numel() and int(labels.max()) >= vocab_size:
        raise ValueError(f"label {int(labels.max())} is outside the vocabulary (vocab_size={vocab_size})")
    return -vocab_parallel_cross_entropy(x, labels)


class _VocabParallelEntropy(torch.autograd.Function):
    """H = log Z - sum_v p_v x_v with Z = sum_v exp(x_v), p = softmax(x), over the full vocabulary: all-reduce MAX
    of the local maxima, SUM of the local Z and sum_v p_v x_v. Backward (local): dH/dx_v = p_v (sum_u p_u x_u - x_v).
    Padded columns (``pad``) take no part: p_v = 0 there, and so is their gradient."""

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


def _log_partition(x: torch.Tensor, group) -> torch.Tensor:
    """log Z = log sum_v exp(x_v) over the full vocabulary ``[..., 1]``: all-reduce MAX of the local maxima, SUM of
    the local sums (``x``: masked local logits in the compute dtype)."""
    world = dist.get_world_size(group) if group is not None else 1
    m = x.max(dim=-1, keepdim=True).values
    if world > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    z = torch.exp(x - m).sum(dim=-1, keepdim=True)
    if world > 1:
        dist.all_reduce(z, op=dist.ReduceOp.SUM, group=group)
    return m + torch.log(z)


def _local_start(local_size: int, group) -> int:
    """The global id of this TP rank's first column."""
    return (dist.get_rank(group) if group is not None else 0) * local_size


class _VocabParallelLogProbsAt(torch.autograd.Function):
    """log p_{v_k} = x_{v_k} - log Z for the K ids v_k of each position: log Z as in :func:`_log_partition`, x_{v_k}
    from the rank that holds column v_k (all-reduce SUM of the local picks, 0 elsewhere). Backward (local):
    dL/dx_v = sum_k g_k [v = v_k] - p_v sum_k g_k."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, ids: torch.Tensor, group, pad) -> torch.Tensor:
        x = _masked(logits.to(_compute_dtype(logits)), pad)
        lse = _log_partition(x, group)
        local_ids = ids - _local_start(logits.shape[-1], group)
        held = (local_ids >= 0) & (local_ids < logits.shape[-1])
        local_ids = local_ids.clamp(0, logits.shape[-1] - 1)
        picked = torch.where(held, x.gather(-1, local_ids), torch.zeros((), dtype=x.dtype, device=x.device))
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(picked, op=dist.ReduceOp.SUM, group=group)
        ctx.pad = pad
        ctx.save_for_backward(logits, lse, local_ids, held)
        return picked - lse

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        logits, lse, local_ids, held = ctx.saved_tensors
        x = _masked(logits.to(_compute_dtype(logits)), ctx.pad)
        grad = torch.exp(x - lse) * -grad_out.sum(dim=-1, keepdim=True)  # 0 at padded columns
        grad.scatter_add_(-1, local_ids, torch.where(held, grad_out, torch.zeros_like(grad_out)))
        return grad.to(logits.dtype), None, None, None


def _masked(x: torch.Tensor, pad: torch.Tensor | None) -> torch.Tensor:
    return x if pad is None else x.masked_fill(pad, float("-inf"))


def _zeroed(x: torch.Tensor, pad: torch.Tensor | None) -> torch.Tensor:
    return x if pad is None else x.masked_fill(pad, 0.0)


def vocab_parallel_entropy(logits: torch.Tensor, group=None, vocab_size: int | None = None) -> torch.Tensor:
    """Entropy of softmax(logits) over the true vocabulary; ``group`` defaults to megatron's TP group."""
    group = _tp_group(group)
    pad = _padding_mask(logits.shape[-1], vocab_size, group, logits.device)
    return _VocabParallelEntropy.apply(logits, group, pad)


def _checked_ids(ids: torch.Tensor, vocab_size: int | None, what: str) -> None:
    if vocab_size is not None and ids.numel() and (int(ids.max()) >= vocab_size or int(ids.min()) < 0):
        raise ValueError(f"{what}: ids in [{int(ids.min())}, {int(ids.max())}] are outside the vocabulary "
                         f"(vocab_size={vocab_size})")


def vocab_parallel_log_probs_at(logits: torch.Tensor, ids: torch.Tensor, vocab_size: int | None = None,
                                group=None) -> torch.Tensor:
    """log softmax(logits)[ids] over the true vocabulary for K ids per position: logits ``[..., Vp/tp]``, ids
    ``[..., K]`` global token ids < ``vocab_size`` -> ``[..., K]``, with its gradient (the local slice's)."""
    group = _tp_group(group)
    if logits.shape[:-1] != ids.shape[:-1]:
        raise ValueError(f"logits {tuple(logits.shape)} and ids {tuple(ids.shape)} disagree on the token dims")
    _checked_ids(ids, vocab_size, "vocab_parallel_log_probs_at")
    pad = _padding_mask(logits.shape[-1], vocab_size, group, logits.device)
    return _VocabParallelLogProbsAt.apply(logits, ids.long(), group, pad)


@torch.no_grad()
def vocab_parallel_topk(logits: torch.Tensor, k: int, vocab_size: int | None = None, candidates: int | None = None,
                        group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest log-probs of softmax(logits) over the true vocabulary and their global ids, ``[..., k]`` each,
    largest first; only ids below ``candidates`` (default: the vocabulary) may be chosen, the softmax is still over
    the whole vocabulary. Each rank's local top k, all-gathered over TP (rank order), then the top k of those."""
    group = _tp_group(group)
    world = dist.get_world_size(group) if group is not None else 1
    limit = min(x for x in (vocab_size, candidates, logits.shape[-1] * world) if x is not None)
    if not 1 <= k <= limit:
        raise ValueError(f"top-k of k={k}: must be in [1, {limit}] (the ids that may be chosen)")
    x = _masked(logits.to(_compute_dtype(logits)), _padding_mask(logits.shape[-1], vocab_size, group, logits.device))
    log_probs = x - _log_partition(x, group)
    start = _local_start(logits.shape[-1], group)
    if candidates is not None:
        log_probs = _masked(log_probs, torch.arange(start, start + logits.shape[-1], device=x.device) >= candidates)
    values, ids = log_probs.topk(min(k, logits.shape[-1]), dim=-1)
    ids = ids + start
    if world > 1:
        gathered_values = [torch.empty_like(values) for _ in range(world)]
        gathered_ids = [torch.empty_like(ids) for _ in range(world)]
        dist.all_gather(gathered_values, values.contiguous(), group=group)
        dist.all_gather(gathered_ids, ids.contiguous(), group=group)
        values, position = torch.cat(gathered_values, dim=-1).topk(k, dim=-1)
        ids = torch.cat(gathered_ids, dim=-1).gather(-1, position)
    return values, ids
