"""The HF rollout's attention for decode steps, registered with transformers' attention interface (``TESTED_TRANSFORMERS``).

A decode step asks one query per row of every cached key. transformers' ``sdpa`` hands that to torch's SDPA, whose
flash kernel for the CPU costs more than the arithmetic here: per layer and decode step, 2 threads, 128 rows,
4 query / 2 KV heads of 32 over 20 positions: 180 us against 126 us as two matmuls; 8 / 2 heads of 64 over 70
positions: 941 against 372 us. :func:`use_decode_attention` registers ``verl_lite_decode`` with
``transformers.AttentionInterface`` (and transformers' own ``sdpa_mask`` for it with ``AttentionMaskInterface``, so
the model builds the masks SDPA would get) and switches a model that runs ``sdpa`` to it: a single-query step on
the CPU in float32/float64 runs :func:`decode_attention`, every other call (the prefill, GPUs, 16-bit, attention
sinks, soft-capping, dropout) runs transformers' ``sdpa_attention_forward`` unchanged.

For any transformers but the version it was written for, and for a model not on ``sdpa``, it stands aside.
"""

from __future__ import annotations

import torch

from verl_lite.compat import installed_version

# the versions whose attention-function signature (module, query, key, value, attention_mask, dropout, scaling,
# **kwargs) -> (output [b, q, heads, d], weights), the boolean mask of sdpa_mask (True = attend; or None) and
# AttentionInterface / AttentionMaskInterface.register this was written for and checked against
TESTED_TRANSFORMERS = ("5.25.0",)
NAME = "verl_lite_decode"
MATMUL_DTYPES = (torch.float32, torch.float64)
# attention-function arguments that change the math; a call with any of them set goes to transformers' sdpa
_SDPA_ONLY = ("softcap", "s_aux", "position_bias")


def decode_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor | None,
                     scale: float) -> torch.Tensor:
    """``softmax(q k^T * scale, over allowed keys) v`` for ONE query per row: query ``[b, h, 1, d]``, key/value
    ``[b, g, L, d]`` (h % g == 0; query head i reads KV group i // (h/g)), ``allowed`` bool broadcastable to
    ``[b, 1, 1, L]`` (True = attend; None = every key) -> ``[b, h, 1, d]``. A group's h/g query heads are the rows of
    one matmul against the group's keys (no K/V repeat)."""
    b, heads, _, width = query.shape
    groups = key.shape[1]
    scores = torch.matmul(query.reshape(b, groups, heads // groups, width), key.transpose(-1, -2)) * scale
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))  # [b, 1, 1, L] over [b, g, h/g, L]
    return torch.matmul(torch.softmax(scores, dim=-1), value).reshape(b, heads, 1, width)


def _attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
               **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    matmul = (query.shape[2] == 1 and query.device.type == "cpu" and query.dtype in MATMUL_DTYPES and not dropout
              and (attention_mask is None or attention_mask.dtype == torch.bool)
              and all(kwargs.get(name) is None for name in _SDPA_ONLY))
    if not matmul:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = decode_attention(query, key, value, attention_mask, scale)
    return out.transpose(1, 2).contiguous(), None


def use_decode_attention(model) -> bool:
    """Switch ``model`` from transformers' ``sdpa`` to ``verl_lite_decode`` (registered on first use): the same
    attention with single-query CPU steps as matmuls. A model that runs anything but ``sdpa`` (eager, flash,
    flex: transformers chose or was told so) is left alone, as is every model with another transformers.
    Returns whether it switched."""
    if installed_version("transformers") not in TESTED_TRANSFORMERS:
        return False
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, _attention)
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    return True
