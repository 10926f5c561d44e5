"""The HF rollout's attention for decode steps, registered with transformers' attention interface (``TESTED_VERSIONS``).

A CPU decode step (one query per row) is faster as two plain matmuls than through torch's SDPA kernel.
:func:`use_decode_attention` registers ``verl_lite_decode`` (and transformers' ``sdpa_mask`` for its masks) and
switches a model on ``sdpa`` to it: such a step in one of the given dtypes runs the given matmul attention; every
other call runs transformers' ``sdpa_attention_forward`` unchanged. Another transformers, or another attention:
it stands aside.
"""

from __future__ import annotations

import torch

from verl_lite.compat import installed_is_tested

# written for and checked against the attention-function signature (module, query, key, value, attention_mask,
# dropout, scaling, **kwargs) -> (output [b, q, heads, d], weights), the boolean mask of sdpa_mask (True = attend; or
# None) and AttentionInterface / AttentionMaskInterface.register of the transformers versions in
# compat.TESTED_VERSIONS
NAME = "verl_lite_decode"
# attention-function arguments that change the math; a call with any of them set goes to transformers' sdpa
_SDPA_ONLY = ("softcap", "s_aux", "position_bias")


def mask_bias(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """An additive bias from a boolean mask (True = attend): 0 where allowed, -inf elsewhere (``[b, 1, 1, L]``
    broadcasts over the grouped scores ``[b, g, h/g, L]``)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def decode_attention(matmul_attention, matmul_dtypes: tuple[torch.dtype, ...]):
    """transformers' attention function for ``verl_lite_decode``: a single-query step on the CPU in one of
    ``matmul_dtypes`` runs ``matmul_attention(query [b, h, 1, d], key [b, g, L, d], value, scale, additive bias or
    None) -> [b, h, 1, d]``; every other call runs transformers' ``sdpa_attention_forward`` unchanged."""

    def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling: float | None = None,
                  **kwargs):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward  # transformers: on first use

        matmul = (query.shape[2] == 1 and query.device.type == "cpu" and query.dtype in matmul_dtypes
                  and not dropout
                  and (attention_mask is None or attention_mask.dtype == torch.bool)
                  and all(kwargs.get(name) is None for name in _SDPA_ONLY))
        if not matmul:
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                          **kwargs)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        bias = None if attention_mask is None else mask_bias(attention_mask, query.dtype)
        out = matmul_attention(query, key, value, scale, bias)
        return out.transpose(1, 2).contiguous(), None

    return attention


def use_decode_attention(model, matmul_attention, matmul_dtypes: tuple[torch.dtype, ...]) -> bool:
    """Switch ``model`` from ``sdpa`` to ``verl_lite_decode`` (registered as :func:`decode_attention` of the
    arguments at every switch). Returns whether it switched (see the module docstring for when it stands aside)."""
    if not installed_is_tested("transformers"):
        return False
    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, decode_attention(matmul_attention, matmul_dtypes))
    AttentionMaskInterface.register(NAME, sdpa_mask)
    model.set_attn_implementation(NAME)
    return True
