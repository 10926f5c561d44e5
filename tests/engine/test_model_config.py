"""MegatronConfig layout validation, HF -> TransformerConfig mapping, rejected layouts, the CPU adapter."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import transformers

from verl_lite.engine.config import MegatronConfig


def _hf(arch, **kw):
    base = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=96, rms_norm_eps=1e-5)
    base.update(kw)
    cls = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config, "llama": transformers.LlamaConfig}[arch]
    return cls(**base)


@pytest.mark.parametrize(
    "kwargs,world,match",
    [
        (dict(tp=2), 3, "the 3 processes must divide by tp\\*pp\\*cp = 2\\*1\\*1"),  # MegatronConfig.problems
        (dict(vpp=2), 2, "megatron.virtual_pipeline_model_parallel_size=2 needs pipeline_model_parallel_size > 1"),
        (dict(pp=2, vpp=0), 2, "megatron.virtual_pipeline_model_parallel_size=0 must be an integer >= 1"),
        (dict(sequence_parallel=True), 1, "needs tensor_model_parallel_size > 1"),
        (dict(timeout_s=0), 1, "timeout_s"),
        (dict(cp=0), 1, "megatron.context_parallel_size"),
        (dict(etp=2), 2, "expert_tensor_parallel_size=2: expert tensor parallelism is not built"),
    ],
)
def test_parallel_config_rejects_bad_layouts(kwargs, world, match):
    with pytest.raises(ValueError, match=match):
        MegatronConfig.layout(**kwargs).validate(world)


def test_parallel_config_accepts_and_reports_dp():
    p = MegatronConfig.layout(tp=2, pp=2, cp=2).validate(16)
    assert p.dp(16) == 2
    # verl's vpp=1 is one model chunk per pipeline rank: no interleaving, as null
    one_chunk = MegatronConfig.layout(pp=2, vpp=1).validate(2)
    assert one_chunk.vpp is None


def test_vpp_with_batch_p2p_comm_is_rejected_with_the_reason():
    from verl_lite.engine.model import transformer_config_from_hf

    with pytest.raises(ValueError, match="silently wrong"):
        transformer_config_from_hf(_hf("qwen2"), MegatronConfig.layout(pp=2, vpp=2), batch_p2p_comm=True)
    with pytest.raises(ValueError, match="overlap_p2p_comm"):
        transformer_config_from_hf(_hf("qwen2"), MegatronConfig.layout(pp=2, vpp=2), overlap_p2p_comm=False)
    cfg = transformer_config_from_hf(_hf("qwen2"), MegatronConfig.layout(pp=2, vpp=2))
    assert cfg.overlap_p2p_comm and not cfg.batch_p2p_comm
    assert cfg.virtual_pipeline_model_parallel_size == 2


def test_architecture_mapping():
    from verl_lite.engine.model import rope_settings, rope_theta, transformer_config_from_hf

    q2 = transformer_config_from_hf(_hf("qwen2"), MegatronConfig.layout(tp=2))
    assert q2.add_qkv_bias and not q2.qk_layernorm and not q2.add_bias_linear
    assert q2.num_query_groups == 2 and q2.kv_channels == 16 and q2.ffn_hidden_size == 96
    assert q2.gated_linear_unit and q2.activation_func is torch.nn.functional.silu
    assert q2.normalization == "RMSNorm" and q2.layernorm_epsilon == 1e-5
    assert q2.variable_seq_lengths and q2.moe_token_dispatcher_type == "alltoall"
    assert q2.hidden_dropout == 0 and q2.attention_dropout == 0
    q3 = transformer_config_from_hf(_hf("qwen3", head_dim=32), MegatronConfig.layout(), calculate_per_token_loss=True)
    assert q3.qk_layernorm and not q3.add_qkv_bias and q3.kv_channels == 32 and q3.calculate_per_token_loss
    ll = transformer_config_from_hf(_hf("llama"), MegatronConfig.layout(pp=2), params_dtype=torch.bfloat16)
    assert not ll.add_qkv_bias and not ll.qk_layernorm
    assert ll.bf16 and ll.params_dtype == torch.bfloat16 and ll.pipeline_dtype == torch.bfloat16
    assert rope_theta(_hf("qwen2", rope_theta=12345.0)) == 12345.0
    llama3 = _hf("llama", rope_theta=5e5, max_position_embeddings=16384, rope_scaling={
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192})
    assert rope_settings(llama3) == dict(rotary_base=5e5, rope_scaling=True, rope_scaling_factor=32.0)
    assert rope_theta({"model_type": "qwen2", "rope_parameters": {"rope_type": "default", "rope_theta": 7.0}}) == 7.0


@pytest.mark.parametrize(
    "hf_kw,parallel,match",
    [
        (dict(num_hidden_layers=3), MegatronConfig.layout(pp=2), "layers must divide by pp x vpp"),
        (dict(num_hidden_layers=4), MegatronConfig.layout(pp=2, vpp=4), "layers must divide by pp x vpp"),
        (dict(num_attention_heads=4, num_key_value_heads=4), MegatronConfig.layout(tp=8), "attention heads \\(4\\)"),
        (dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}), MegatronConfig.layout(), "RoPE type"),
        (dict(max_position_embeddings=16384, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 2.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}), MegatronConfig.layout(), "llama3 RoPE"),
    ],
)
def test_unsupported_models_are_rejected(hf_kw, parallel, match):
    from verl_lite.engine.model import transformer_config_from_hf

    with pytest.raises(ValueError, match=match):
        transformer_config_from_hf(_hf("qwen2", **hf_kw), parallel)


def test_unknown_model_type_is_rejected():
    from verl_lite.engine.model import transformer_config_from_hf

    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        transformer_config_from_hf(transformers.GPT2Config(), MegatronConfig.layout())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU adapter is inert when CUDA is available")
def test_cpu_adapter_maps_cuda_requests_to_cpu():
    """In a fresh interpreter (the adapter is process-wide): exactly the documented rewrites."""
    code = """
import torch
from verl_lite.compat import cpu_adapter
assert not cpu_adapter.is_installed()
assert cpu_adapter.install() and cpu_adapter.install() and cpu_adapter.is_installed()
x = torch.zeros(3, device="cuda")
assert x.device.type == "cpu"
assert torch.empty(2, device=torch.cuda.current_device()).device.type == "cpu"
assert x.to("cuda:0").device.type == "cpu" and x.to(0).device.type == "cpu" and x.cuda() is x
assert x.to(torch.float64).dtype == torch.float64
assert x.type() == "torch.cuda.FloatTensor" and x.type(torch.float64).dtype == torch.float64
assert not torch.ones(2, pin_memory=True).is_pinned()
torch.cuda.synchronize()
print("OK")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-2000:]
