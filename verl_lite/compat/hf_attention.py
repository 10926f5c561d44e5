"""The HF rollout's attention for decode steps, registered with transformers' attention interface (``TESTED_TRANSFORMERS``).

A decode step asks one query per row of every cached key. transformers' ``sdpa`` hands that to torch's SDPA, whose
flash kernel for the CPU costs more than the arithmetic here: per layer and decode step, 2 threads, 128 rows,
4 query / 2 KV heads of 32 over 20 positions: 180 us against 126 us as two matmuls; 8 / 2 heads of 64 over 70
positions: 941 against 372 us. :func:`use_decode_attention` registers ``verl_lite_decode`` with
``transformers.AttentionInterface`` (and transformers' own ``sdpa_mask`` for it with ``AttentionMaskInterface``, so
the model builds the masks SDPA would get) and switches a model that runs ``sdpa`` to it: a single-query step on
the CPU in float32/float64 runs the engine's ``grouped_matmul_attention`` (a KV group's query heads as the rows of
one matmul), every other call (the prefill, GPUs, 16-bit, attention sinks, soft-capping, dropout) runs
transformers' ``sdpa_attention_forward`` unchanged.

For any transformers but the version it was written for, and for a model not on ``sdpa``, it stands aside.
"""

from __future__ import annotations

import torch

from verl_lite.compat import installed_version
from verl_lite.engine.attention import MATMUL_ATTENTION_DTYPES, grouped_matmul_attention

# the versions whose attention-function signature (module, query, key, value, attention_mask, dropout, scaling,
# **kwargs) -> (output [b, q, heads, d], weights), the boolean mask of sdpa_mask (True = attend; or None) and
# AttentionInterface / AttentionMaskInterface.register this was written for and checked against
TESTED_TRANSFORMERS = ("5.25.0",)
NAME = "verl_lite_decode"
# attention-function arguments that change the math; a call with any of them set goes to transformers' sdpa
_SDPA_ONLY = ("softcap", "s_aux", "position_bias")


def mask_bias(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An additive bias from a boolean mask (True = attend): 0 where allowed, -inf elsewhere (``[b, 1, 1, L]``
    broadcasts over the grouped scores ``[b, g, h/g, L]``)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def _attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
               **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    matmul = (query.shape[2] == 1 and query.device.type == "cpu" and query.dtype in MATMUL_ATTENTION_DTYPES
              and not dropout
              and (attention_mask is None or attention_mask.dtype == torch.bool)
              and all(kwargs.get(name) is None for name in _SDPA_ONLY))
    if not matmul:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    bias = None if attention_mask is None else mask_bias(attention_mask, query.dtype)
    out = grouped_matmul_attention(query, key, value, scale, bias)
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
