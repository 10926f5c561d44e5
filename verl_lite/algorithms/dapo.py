"""DAPO's two data-side pieces (Yu et al., 2025, "DAPO: An Open-Source LLM RL System at Scale").

- Overlong reward shaping: with L_max = max response length and a buffer of b tokens, a
  response of L tokens gets
      penalty(L) = -min(1, max(0, L - (L_max - b)) / b) * factor
  (0 up to L_max - b, then linear down to -factor at L_max).
- Dynamic sampling: a prompt group whose samples all have the same metric value (all right,
  all wrong) has zero group-relative advantage and carries no learning signal; such groups are
  dropped and more prompts are generated until the batch is full.
"""

from __future__ import annotations

from typing import Sequence

import torch


def overlong_penalty(response_lengths: torch.Tensor, max_response_length: int, buffer_len: int,
                     penalty_factor: float) -> torch.Tensor:
    """penalty(L) per row (<= 0), see the module docstring (``reward.overlong_buffer``'s rules: its ``problems``)."""
    expected = max_response_length - buffer_len
    excess = (response_lengths.double() - expected).clamp(min=0)
    return -(excess / buffer_len).clamp(max=1.0) * penalty_factor


def groups_with_signal(metric: Sequence[float], uids: Sequence) -> list:
    """The uids (first-seen order) whose rows do not all share one metric value (a group of one
    sample is kept, as verl does: there is nothing to compare it with)."""
    values: dict = {}
    for value, uid in zip(metric, uids):
        values.setdefault(uid, []).append(float(value))
    return [uid for uid, vs in values.items() if len(vs) == 1 or max(vs) != min(vs)]
