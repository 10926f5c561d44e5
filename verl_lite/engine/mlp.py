"""megatron's dense MLP with its SwiGLU activation as one autograd function.

``SwiGLUMLP`` is megatron-core's ``MLP`` (same submodules, parameters, sharded state dict and TP
layout) whose forward, for the gated SiLU the engine's models use, runs ``linear_fc1`` ->
:func:`verl_lite.engine.elementwise.swiglu` -> ``linear_fc2``. Any other activation set-up (a clamp,
a non-zero ``glu_linear_offset``, MoE's per-token scales, TE or fused-bias activations) takes
megatron's own forward unchanged.

The layer spec keeps megatron's ``MLP``, so megatron's layer builds it with its own arguments (its TP
group); on the CPU speed paths ``speed_paths.adapt_built_model`` then makes the built MLPs this class.
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
