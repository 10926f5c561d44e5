"""Row gathers whose backward is a gather too (no scatter-add), and zero rows appended (:func:`pad_rows`).

Autograd's backward of a gather is an accumulating scatter, slow on CPU; when each row of ``x`` lands in at
most one output row that counts, the gradient is a gather again: ``dx[r] = dy[inverse[r]]``, or 0 where
``inverse[r] < 0``. Padding output rows (reading an arbitrary row) are simply not listed in ``inverse``:
their gradient is dropped, exact when they influence no real output or the caller zeroes them.
"""

from __future__ import annotations

import torch


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (inverse,) = ctx.saved_tensors
        return gather_with_zeros(dy, inverse), None, None


def gather_with_zeros(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x[index]`` along dim 0, with rows where ``index < 0`` set to 0 (no autograd of its own)."""
    missing = index < 0
    if not bool(missing.any()):
        return x.index_select(0, index)
    padded = torch.cat([x, x.new_zeros((1, *x.shape[1:]))])
    return padded.index_select(0, torch.where(missing, torch.full_like(index, x.shape[0]), index))


def gather_rows(x: torch.Tensor, index: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """``x.index_select(0, index)`` with the gradient ``dx[r] = dy[inverse[r]]`` (0 where inverse[r] < 0);
    ``inverse`` ([x.shape[0]] long): for each row of x, the one output row whose gradient counts, or -1."""
    return _GatherRows.apply(x, index, inverse)


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` with zero rows appended up to ``rows`` (unchanged when it has as many)."""
    if x.shape[0] >= rows:
        return x
    return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])


def invert_index(index: torch.Tensor, valid: torch.Tensor, num_rows: int) -> torch.Tensor:
    """``inverse[index[j]] = j`` for the valid output rows j (each reading a distinct row), -1 elsewhere."""
    inverse = torch.full((num_rows,), -1, dtype=torch.long, device=index.device)
    positions = torch.arange(index.numel(), dtype=torch.long, device=index.device)
    inverse[index[valid]] = positions[valid]
    return inverse
