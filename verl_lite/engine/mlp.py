"""megatron's dense MLP with its SwiGLU activation as one autograd function.

``SwiGLUMLP`` is megatron-core's ``MLP`` (same parameters, state dict and TP layout) whose forward, for the
plain gated SiLU, runs ``linear_fc1`` -> :func:`elementwise.swiglu` -> ``linear_fc2``; any other set-up takes
megatron's forward unchanged. ``speed_paths.adapt_built_model`` re-classes megatron's built MLPs to it.
"""

from __future__ import annotations

import torch.nn.functional as F
from megatron.core.transformer.mlp import MLP

from verl_lite.engine.elementwise import swiglu


def plain_swiglu(config, activation_func) -> bool:
    """Whether megatron's unfused MLP computes exactly ``silu(a) * b`` of fc1's halves with this config."""
    return (config.gated_linear_unit and activation_func is F.silu and not config.glu_linear_offset
            and config.activation_func_clamp_value is None and not config.use_te_activation_func
            and not config.bias_activation_fusion)


class SwiGLUMLP(MLP):
    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        if per_token_scale is not None or not plain_swiglu(self.config, self.activation_func):
            return super().forward(hidden_states, per_token_scale=per_token_scale, **kwargs)
        intermediate, bias = self.linear_fc1(hidden_states)
        if bias is not None:
            intermediate = intermediate + bias
        return self.linear_fc2(swiglu(intermediate))
