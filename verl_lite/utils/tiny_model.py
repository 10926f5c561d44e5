"""Tiny random HF causal LMs (Qwen2 / Qwen3 / Llama, Qwen3-MoE / Qwen2-MoE) written to a local directory, for
tests, the CPU dev mode and benchmarks: no model hub needed. The weights' spread keeps next-token distributions
far from uniform, so log-probs, entropies and their gradients are non-trivial numbers.
"""

from __future__ import annotations

from pathlib import Path

import torch

ARCHS = ("qwen2", "qwen3", "llama")
MOE_ARCHS = ("qwen3_moe", "qwen2_moe")


def _common(vocab_size: int, hidden_size: int, num_layers: int, num_attention_heads: int, num_key_value_heads: int,
            intermediate_size: int, tie_word_embeddings: bool, rope_theta: float, max_position_embeddings: int,
            **extra) -> dict:
    """The HF config fields every tiny model shares."""
    return dict(vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
                num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads,
                intermediate_size=intermediate_size, tie_word_embeddings=tie_word_embeddings, rope_theta=rope_theta,
                max_position_embeddings=max_position_embeddings, **extra, rms_norm_eps=1e-6, hidden_act="silu",
                attention_dropout=0.0, bos_token_id=1, eos_token_id=2, pad_token_id=0, dtype="float32")


def make_tiny_hf_model(out_dir: str | Path, arch: str = "qwen2", *, vocab_size: int = 128, hidden_size: int = 64,
                       num_layers: int = 4, num_attention_heads: int = 4, num_key_value_heads: int = 2,
                       intermediate_size: int = 128, tie_word_embeddings: bool = False, rope_theta: float = 10000.0,
                       max_position_embeddings: int = 4096, rope_scaling: dict | None = None, seed: int = 0,
                       init_std: float = 0.1) -> Path:
    """Write a randomly initialised fp32 HF model dir (config.json + model.safetensors) and return its path;
    weights as :func:`_save_randomly_initialised` draws them. ``rope_scaling`` goes to the HF config as is."""
    if hidden_size % num_attention_heads:
        raise ValueError(f"hidden_size={hidden_size} must divide by num_attention_heads={num_attention_heads}")
    if num_attention_heads % num_key_value_heads:
        raise ValueError(f"num_attention_heads={num_attention_heads} must divide by "
                         f"num_key_value_heads={num_key_value_heads}")
    import transformers

    common = _common(vocab_size, hidden_size, num_layers, num_attention_heads, num_key_value_heads,
                     intermediate_size, tie_word_embeddings, rope_theta, max_position_embeddings,
                     **({"rope_scaling": dict(rope_scaling)} if rope_scaling else {}))
    if arch == "qwen2":
        cfg = transformers.Qwen2Config(use_sliding_window=False, **common)
    elif arch == "qwen3":
        cfg = transformers.Qwen3Config(use_sliding_window=False, head_dim=hidden_size // num_attention_heads,
                                       attention_bias=False, **common)
    elif arch == "llama":
        cfg = transformers.LlamaConfig(attention_bias=False, mlp_bias=False, **common)
    else:
        raise ValueError(f"unknown arch {arch!r}; choose one of {ARCHS}")
    return _save_randomly_initialised(cfg, out_dir, seed, init_std)


def _save_randomly_initialised(cfg, out_dir, seed: int, init_std: float, router_std: float | None = None) -> Path:
    """Build the HF model of ``cfg``, draw its weights from one generator seeded with ``seed`` (norm weights
    1 + N(0, 0.1^2), so a mis-mapped norm is visible; biases N(0, 0.1^2); routers ``mlp.gate.weight``
    N(0, router_std^2) when given; every other matrix N(0, init_std^2)), save it in ``out_dir``, return the path."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                std, mean = 0.1, 1.0
            elif name.endswith("bias"):
                std, mean = 0.1, 0.0
            elif router_std is not None and name.endswith("mlp.gate.weight"):
                std, mean = router_std, 0.0
            else:
                std, mean = init_std, 0.0
            p.copy_(mean + std * torch.randn(p.shape, generator=gen))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    return out


def make_tiny_moe_model(out_dir: str | Path, arch: str = "qwen3_moe", *, vocab_size: int = 64, hidden_size: int = 32,
                        num_layers: int = 2, num_attention_heads: int = 4, num_key_value_heads: int = 2,
                        num_experts: int = 4, top_k: int = 2, moe_intermediate_size: int = 16,
                        shared_expert_intermediate_size: int = 24, tie_word_embeddings: bool = False, seed: int = 0,
                        init_std: float = 0.15, router_std: float = 0.5) -> Path:
    """Write a random fp32 HF mixture-of-experts model dir and return its path.

    ``qwen3_moe``: Qwen3-MoE (per-head q/k norm, softmax router over all experts, top-k, renormalised:
    ``norm_topk_prob=True``). ``qwen2_moe``: Qwen2-MoE (q/k/v bias, top-k of the softmax without
    renormalisation, plus a shared expert scaled by sigmoid(shared_expert_gate)). Every layer is sparse;
    ``router_std`` keeps routing decisions far from ties; saved with one tensor per expert projection.
    """
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={num_experts}]")
    import transformers

    # intermediate_size: the dense MLP width, unused (every layer is sparse)
    common = _common(vocab_size, hidden_size, num_layers, num_attention_heads, num_key_value_heads,
                     moe_intermediate_size, tie_word_embeddings, 10000.0, 4096,
                     moe_intermediate_size=moe_intermediate_size, num_experts=num_experts, num_experts_per_tok=top_k,
                     decoder_sparse_step=1, mlp_only_layers=[], output_router_logits=False)
    if arch == "qwen3_moe":
        cfg = transformers.Qwen3MoeConfig(use_sliding_window=False, head_dim=hidden_size // num_attention_heads,
                                          attention_bias=False, norm_topk_prob=True, **common)
    elif arch == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(use_sliding_window=False, norm_topk_prob=False,
                                          shared_expert_intermediate_size=shared_expert_intermediate_size, **common)
    else:
        raise ValueError(f"unknown MoE arch {arch!r}; choose one of {MOE_ARCHS}")
    return _save_randomly_initialised(cfg, out_dir, seed, init_std, router_std=router_std)
