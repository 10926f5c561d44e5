"""A weight sync's tensors in flat buckets (verl's ``checkpoint_engine.update_weights_bucket_megabytes``).

``weight_buckets`` packs (hf_name, tensor) pairs, in order, into ``WeightBucket``s: one flat byte buffer each, at
most ``bucket_bytes`` long unless a single tensor is larger (it then travels alone), every tensor at an offset that
is a multiple of ``ALIGN`` bytes. ``bucket_tensors`` gives a bucket's pairs back as views of its buffer, bit for
bit the tensors packed (their dtype, shape and values; contiguous). A weight sync then moves a few large buffers
instead of one object per tensor, and the receiver holds one bucket at a time while it loads.
"""

from __future__ import annotations

import math
from typing import Iterable, Iterator, NamedTuple

import torch

ALIGN = 64  # bytes: every tensor starts at a multiple (any dtype's element size divides it)
MEGABYTE = 1 << 20


class WeightBucket(NamedTuple):
    data: torch.Tensor  # uint8 [nbytes]: the tensors' bytes back to back, each at an ALIGN-aligned offset
    entries: list[tuple[str, str, tuple[int, ...], int]]  # (hf_name, dtype name, shape, byte offset into data)


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _pack(pairs: list[tuple[str, torch.Tensor]]) -> WeightBucket:
    offsets, end = [], 0
    for _, tensor in pairs:
        offsets.append(_aligned(end))
        end = offsets[-1] + _nbytes(tensor)
    data = torch.empty(end, dtype=torch.uint8)
    entries = []
    for (name, tensor), offset in zip(pairs, offsets):
        flat = tensor.detach().to("cpu").contiguous().reshape(-1)
        data[offset:offset + _nbytes(tensor)].copy_(flat.view(torch.uint8) if flat.numel() else flat.to(torch.uint8))
        entries.append((name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset))
    return WeightBucket(data, entries)


def weight_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[WeightBucket]:
    """The pairs packed in order into buckets of at most ``bucket_bytes`` (one larger tensor: a bucket alone)."""
    if bucket_bytes < 1:
        raise ValueError(f"weight_buckets: bucket_bytes={bucket_bytes} must be >= 1")
    pending: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        end = _aligned(size) + _nbytes(tensor)
        if pending and end > bucket_bytes:
            yield _pack(pending)
            pending, end = [], _nbytes(tensor)
        pending.append((name, tensor))
        size = end
    if pending:
        yield _pack(pending)


def bucket_tensors(bucket: WeightBucket) -> Iterator[tuple[str, torch.Tensor]]:
    """A bucket's (hf_name, tensor) pairs: views of its buffer, in the order they were packed."""
    for name, dtype_name, shape, offset in bucket.entries:
        dtype = getattr(torch, dtype_name)
        raw = bucket.data[offset:offset + math.prod(shape) * dtype.itemsize]
        yield name, raw.view(dtype).reshape(shape)


def bucket_bytes_of(megabytes: int | float) -> int:
    """``update_weights_bucket_megabytes`` in bytes."""
    return int(megabytes * MEGABYTE)
