"""The batch that flows between the controller and the workers.

A :class:`Batch` holds ``n`` trajectories (or prompts):

- ``tensors``: a ``TensorDict`` with batch size ``[n]`` (dim 0 = trajectories), e.g.
  ``response_mask [n, W]``, ``old_log_probs [n, W]``, ``advantages [n, W]``;
- ``non_tensors``: per-trajectory Python lists of length ``n`` (``uid``, ``data_source``,
  ``ground_truth``, ``extra_info``, and variable-length token lists such as ``prompt_ids``).

Rows stay aligned under every operation: ``select`` (pick rows by index), ``chunk`` (split into
contiguous pieces), ``concat`` (stack batches), ``union`` (add columns). Nothing else: no math.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from verl_lite.compat.lazy_compile import compile_decorators_deferred

# a sample's (and the batch's) MoE routing per token, [tokens, layers, k] uint8: HFRollout(record_routing), the agent
# loop's trajectories, the engine's routing replay
ROUTED_EXPERTS_KEY = "routed_experts"

with compile_decorators_deferred():  # tensordict's import-time allow_in_graph would import torch._dynamo (a large import)
    from tensordict import TensorDict


@dataclass
class Batch:
    tensors: TensorDict
    non_tensors: dict[str, list[Any]] = field(default_factory=dict)

    def __post_init__(self):
        n = len(self)
        for key, values in self.non_tensors.items():
            if len(values) != n:
                raise ValueError(f"Batch column {key!r} has {len(values)} rows but the batch has {n}")

    @classmethod
    def from_dict(cls, tensors: dict[str, torch.Tensor] | None = None, non_tensors: dict[str, Sequence] | None = None,
                  size: int | None = None) -> "Batch":
        """Build a batch; ``size`` is needed only when there are no tensors."""
        tensors = dict(tensors or {})
        non_tensors = {k: list(v) for k, v in (non_tensors or {}).items()}
        if size is None:
            size = next(iter(tensors.values())).shape[0] if tensors else len(next(iter(non_tensors.values()), []))
        return cls(TensorDict(tensors, batch_size=[size]), non_tensors)

    def __len__(self) -> int:
        return int(self.tensors.batch_size[0])

    def __getitem__(self, key: str):
        if key in self.non_tensors:
            return self.non_tensors[key]
        return self.tensors[key]

    def __contains__(self, key: str) -> bool:
        return key in self.non_tensors or key in self.tensors.keys()

    def keys(self) -> list[str]:
        return list(self.tensors.keys()) + list(self.non_tensors.keys())

    def set(self, key: str, value) -> "Batch":
        """Add or replace a column (tensor with dim 0 = n, or a list of n values)."""
        if isinstance(value, torch.Tensor):
            if value.shape[0] != len(self):
                raise ValueError(f"column {key!r} has {value.shape[0]} rows but the batch has {len(self)}")
            self.tensors[key] = value
        else:
            value = list(value)
            if len(value) != len(self):
                raise ValueError(f"column {key!r} has {len(value)} rows but the batch has {len(self)}")
            self.non_tensors[key] = value
        return self

    def union(self, other: "Batch") -> "Batch":
        """Columns of both (same rows); ``other`` wins on a shared key."""
        if len(other) != len(self):
            raise ValueError(f"cannot union batches of {len(self)} and {len(other)} rows")
        out = self.select(list(range(len(self))))
        for key in other.tensors.keys():
            out.tensors[key] = other.tensors[key]
        out.non_tensors.update({k: list(v) for k, v in other.non_tensors.items()})
        return out

    def select(self, indices: Sequence[int]) -> "Batch":
        """Rows ``indices`` in that order (a copy)."""
        idx = torch.as_tensor(list(indices), dtype=torch.long)
        tensors = TensorDict({k: v[idx] for k, v in self.tensors.items()}, batch_size=[len(idx)])
        non_tensors = {k: [v[i] for i in idx.tolist()] for k, v in self.non_tensors.items()}
        return Batch(tensors, non_tensors)

    def columns(self, keys: Sequence[str]) -> "Batch":
        """Only the columns ``keys`` (all rows)."""
        missing = [k for k in keys if k not in self]
        if missing:
            raise KeyError(f"batch has no column(s) {missing}; it has {self.keys()}")
        tensors = TensorDict({k: self.tensors[k] for k in keys if k in self.tensors.keys()}, batch_size=[len(self)])
        return Batch(tensors, {k: list(self.non_tensors[k]) for k in keys if k in self.non_tensors})

    def chunk(self, num_chunks: int) -> list["Batch"]:
        """Split into ``num_chunks`` contiguous equal pieces; the size must divide exactly."""
        n = len(self)
        if num_chunks <= 0 or n % num_chunks:
            raise ValueError(f"cannot split a batch of {n} rows into {num_chunks} equal pieces")
        size = n // num_chunks
        return [self.select(range(i * size, (i + 1) * size)) for i in range(num_chunks)]

    @staticmethod
    def concat(batches: Sequence["Batch"]) -> "Batch":
        """Stack rows of batches with the same columns ([n, W, ...] tensors of different W are right-padded with 0)."""
        if not batches:
            raise ValueError("concat of no batches")
        keys = list(batches[0].tensors.keys())
        tensors = {}
        for k in keys:
            parts = [b.tensors[k] for b in batches]
            if parts[0].dim() >= 2:
                width = max(p.shape[1] for p in parts)
                parts = [torch.cat([p, p.new_zeros(p.shape[0], width - p.shape[1], *p.shape[2:])], dim=1)
                         if p.shape[1] < width else p for p in parts]
            tensors[k] = torch.cat(parts, dim=0)
        non_tensors = {k: [x for b in batches for x in b.non_tensors[k]] for k in batches[0].non_tensors}
        return Batch.from_dict(tensors, non_tensors, size=sum(len(b) for b in batches))

    def to(self, device) -> "Batch":
        return Batch(self.tensors.to(device), self.non_tensors)


def response_lengths(response_mask: torch.Tensor) -> torch.Tensor:
    """Tokens of each response row [n]: the last position with a non-zero mask, plus one (0 for none). Not
    ``mask.sum(-1)``: a mask's holes (a multi-turn rollout's observation tokens) are read by the model too."""
    valid = response_mask != 0
    positions = torch.arange(1, response_mask.shape[-1] + 1, device=response_mask.device)
    return (valid * positions).amax(dim=-1).long() if response_mask.shape[-1] else valid.sum(-1).long()
