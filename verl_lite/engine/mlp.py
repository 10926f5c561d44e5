"""megatron's dense MLP with its SwiGLU activation as one autograd function.

``SwiGLUMLP`` is megatron-core's ``MLP`` (same submodules, parameters, sharded state dict and TP
layout) whose forward, for the gated SiLU the engine's models use, runs ``linear_fc1`` ->
:func:`verl_lite.engine.elementwise.swiglu` -> ``linear_fc2``. Any other activation set-up (a clamp,
a non-zero ``glu_linear_offset``, MoE's per-token scales, TE or fused-bias activations) takes
megatron's own forward unchanged.
"""

from __future__ import annotations

import torch.nn.functional as F
from megatron.core.transformer.mlp import MLP

from verl_lite.engine.elementwise import swiglu


class SwiGLUMLP(MLP):
    def __init__(self, config, submodules, *args, **kwargs):
        super().__init__(config, submodules, *args, **kwargs)
        self.plain_swiglu = (config.gated_linear_unit and self.activation_func is F.silu
                             and not config.glu_linear_offset and config.activation_func_clamp_value is None
                             and not config.use_te_activation_func and not config.bias_activation_fusion)

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        if not self.plain_swiglu or per_token_scale is not None:
            return super().forward(hidden_states, per_token_scale=per_token_scale, **kwargs)
        intermediate, bias = self.linear_fc1(hidden_states)
        if bias is not None:
            intermediate = intermediate + bias
        return self.linear_fc2(swiglu(intermediate))
