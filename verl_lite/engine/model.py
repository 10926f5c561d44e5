"""The model: megatron-core ``GPTModel`` with our layer spec, for the Qwen2 / Qwen3 / Llama family.

- ``transformer_config_from_hf``: HF config + ``MegatronConfig`` -> megatron ``TransformerConfig``.
- ``layer_spec``: megatron's local layer with our ``PackedCoreAttention`` and the norm
  ``speed_paths.norm_class`` picks (``engine/speed_paths.py`` also decides the MLP and RoPE paths).
- ``build_model_chunks``: one ``GPTModel`` per virtual pipeline stage of this rank; ``value_head=True``
  swaps the LM head for a replicated ``[1, hidden]`` projection (a critic).
- Vocabulary: the embedding and the LM head have ``padded_vocab_size(V, tp)`` rows (``vocab_parallel``);
  the HF bridge zero-fills the padded rows on load and strips them on export.

A chunk's forward is megatron's: ``chunk(input_ids [b, s], position_ids, attention_mask,
packed_seq_params=...)`` returns logits ``[b, s, Vp/tp]`` (values ``[b, s, 1]`` for a value head) on the
last stage and hidden states ``[s, b, h]`` elsewhere. On a CPU-only torch megatron's RoPE needs
``cpu_adapter`` (installed by ``build_model_chunks``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from verl_lite.engine import speed_paths
from verl_lite.engine.attention import PackedCoreAttention
from verl_lite.engine.config import LOCAL_SPEC_FUSIONS, MOE_MODEL_TYPES, MegatronConfig
from verl_lite.engine.moe import RouterLossCoefficients
from verl_lite.engine.vocab_parallel import padded_vocab_size

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "qwen3_moe", "qwen2_moe")


def is_moe(hf_config) -> bool:
    """Whether the HF config is a mixture-of-experts model the engine builds with megatron's MoE layer."""
    return _get(hf_config, "model_type") in MOE_MODEL_TYPES


def num_experts(hf_config) -> int:
    """Routed experts per MoE layer (transformers 5 writes ``num_local_experts`` to config.json)."""
    return int(_get(hf_config, "num_experts") or _get(hf_config, "num_local_experts"))


def has_qkv_bias(hf_config) -> bool:
    """Qwen2's (and Llama's ``attention_bias``) q/k/v biases."""
    return _get(hf_config, "model_type") in ("qwen2", "qwen2_moe") or bool(_get(hf_config, "attention_bias", False))


def has_qk_norm(hf_config) -> bool:
    """Qwen3's per-head q/k RMSNorm."""
    return _get(hf_config, "model_type") in ("qwen3", "qwen3_moe")


VALUE_HEAD_SEED = 0


class ValueHead(torch.nn.Module):
    """v = h @ weight^T with weight ``[1, hidden]``, replicated over TP (a critic's head), called like megatron's
    output layer (``-> (values [s, b, 1], None)``); under sequence parallelism the hidden states are gathered first."""

    def __init__(self, config, hidden_size: int):
        super().__init__()
        # A fresh head is drawn from its own generator, so it is the same in every layout (the
        # global RNG has seen a layout-dependent number of draws by now).
        generator = torch.Generator().manual_seed(VALUE_HEAD_SEED)
        weight = torch.randn(1, hidden_size, generator=generator, dtype=torch.float32) * config.init_method_std
        self.weight = torch.nn.Parameter(weight.to(config.params_dtype))
        self.sequence_parallel = bool(config.sequence_parallel)

    def forward(self, hidden: torch.Tensor, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            hidden = gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=False)
        return F.linear(hidden, self.weight), None


def moe_mlp_spec():
    """megatron's ``MoELayer``: ``SequentialMLP`` experts (its grouped GEMM needs TransformerEngine), a
    ``SharedExpertMLP`` (when the config has one) and our router with the mini-batch losses (``moe.py``)."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoESubmodules
    from megatron.core.transformer.moe.shared_experts import SharedExpertMLP
    from megatron.core.transformer.spec_utils import ModuleSpec

    from verl_lite.engine.moe import router_class

    linears = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    return ModuleSpec(module=MoELayer, submodules=MoESubmodules(
        experts=ModuleSpec(module=SequentialMLP, submodules=linears),
        shared_experts=ModuleSpec(module=SharedExpertMLP, submodules=linears), router=router_class()))


def layer_spec(norm: type, qk_layernorm: bool, moe: bool = False):
    """megatron's local GPT layer, with ``PackedCoreAttention`` and ``norm`` (also as q/k-norm when asked);
    ``moe=True``: the MLP is ``moe_mlp_spec()``."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    attention = ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                           submodules=SelfAttentionSubmodules(
                               linear_qkv=ColumnParallelLinear, core_attention=PackedCoreAttention,
                               linear_proj=RowParallelLinear, q_layernorm=norm if qk_layernorm else IdentityOp,
                               k_layernorm=norm if qk_layernorm else IdentityOp))
    mlp = moe_mlp_spec() if moe else ModuleSpec(
        module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear))
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=norm, self_attention=attention, self_attn_bda=get_bias_dropout_add, pre_mlp_layernorm=norm,
        mlp=mlp, mlp_bda=get_bias_dropout_add))


def _block_spec(config, vp_stage):
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    n = get_num_layers_to_build(config, vp_stage=vp_stage)
    norm = speed_paths.norm_class(config)
    spec = layer_spec(norm, config.qk_layernorm, moe=config.num_moe_experts is not None)
    return TransformerBlockSubmodules(layer_specs=[spec] * n, layer_norm=norm)


def _get(hf_config, name, default=None):
    if isinstance(hf_config, dict):
        return hf_config.get(name, default)
    return getattr(hf_config, name, default)


_LLAMA3_FIXED = dict(low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


def rope_settings(hf_config) -> dict:
    """GPTModel RoPE arguments from the HF config: ``rotary_base`` and, for Llama-3 style scaling,
    ``rope_scaling=True, rope_scaling_factor``. Reads ``rope_theta``/``rope_scaling`` (transformers 4)
    or ``rope_parameters`` (transformers 5). Other RoPE variants are rejected."""
    params = _get(hf_config, "rope_parameters") or _get(hf_config, "rope_scaling") or {}
    theta = _get(hf_config, "rope_theta")
    if theta is None:
        theta = params.get("rope_theta", 10000.0)
    rope_type = params.get("rope_type", params.get("type", "default"))
    out = dict(rotary_base=float(theta), rope_scaling=False, rope_scaling_factor=8.0)
    if rope_type in ("default", None):
        return out
    if rope_type == "llama3":
        # megatron's RotaryEmbedding._apply_scaling hard-codes these three values
        fixed = {k: float(params.get(k, v)) for k, v in _LLAMA3_FIXED.items()}
        if fixed != _LLAMA3_FIXED:
            raise ValueError(
                f"llama3 RoPE scaling with {fixed} is not supported; megatron implements only {_LLAMA3_FIXED}")
        out.update(rope_scaling=True, rope_scaling_factor=float(params["factor"]))
        return out
    raise ValueError(f"RoPE type {rope_type!r} is not supported by the engine yet (supported: 'default', 'llama3'); "
                     "use a model with one of those")


def rope_theta(hf_config) -> float:
    """RoPE base (``rope_settings(hf_config)["rotary_base"]``)."""
    return rope_settings(hf_config)["rotary_base"]


def model_type(hf_config) -> str:
    mt = _get(hf_config, "model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {mt!r} is not supported; the engine supports {SUPPORTED_MODEL_TYPES}")
    return mt


def head_dim(hf_config) -> int:
    hd = _get(hf_config, "head_dim")
    return int(hd) if hd else _get(hf_config, "hidden_size") // _get(hf_config, "num_attention_heads")


def qkv_heads(hf_config) -> tuple[int, int, int]:
    """(attention heads, key/value heads, head dim)."""
    n_heads = _get(hf_config, "num_attention_heads")
    return n_heads, _get(hf_config, "num_key_value_heads") or n_heads, head_dim(hf_config)


def projection_shapes(hf_config, ffn: int | None = None) -> dict[str, tuple[int, int]]:
    """(out, in) of each HF projection's weight; ``ffn``: the MLP's intermediate size (default: the dense one)."""
    h = _get(hf_config, "hidden_size")
    n_heads, n_kv, hn = qkv_heads(hf_config)
    ffn = ffn or _get(hf_config, "intermediate_size")
    return {"q_proj": (n_heads * hn, h), "k_proj": (n_kv * hn, h), "v_proj": (n_kv * hn, h),
            "o_proj": (h, n_heads * hn), "gate_proj": (ffn, h), "up_proj": (ffn, h), "down_proj": (h, ffn)}


def transformer_config_from_hf(hf_config, parallel: MegatronConfig, *, calculate_per_token_loss: bool = False,
                               params_dtype: torch.dtype = torch.float32, **overrides):
    """Megatron ``TransformerConfig`` for an HF Qwen2/Qwen3/Llama config under ``parallel``: RMSNorm,
    SwiGLU, GQA, no linear biases but the q/k/v ones of :func:`has_qkv_bias`, no dropout, RoPE as
    ``rope_settings``; fusions off, ``variable_seq_lengths`` with the alltoall dispatcher (megatron requires
    it even for dense models), and for virtual pipelining ``overlap_p2p_comm=True, batch_p2p_comm=False``
    (the opposite is rejected). ``overrides`` are passed to ``TransformerConfig`` last."""
    from megatron.core.transformer import TransformerConfig

    model_type(hf_config)
    rope_settings(hf_config)  # rejects unsupported RoPE variants early
    parallel.validate(model_cfg=hf_config if isinstance(hf_config, dict) else hf_config.to_dict())  # heads, layers, EP
    n_heads, n_kv, hn = qkv_heads(hf_config)
    tp, pp, vpp = parallel.tp, parallel.pp, parallel.vpp
    if _get(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={_get(hf_config, 'hidden_act')!r} is not supported (SwiGLU with silu only)")
    if _get(hf_config, "mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported (megatron's MLP here has no biases)")
    if not is_moe(hf_config) and _get(hf_config, "intermediate_size") % tp:
        raise ValueError(f"intermediate_size={_get(hf_config, 'intermediate_size')} is not divisible by tp={tp}")
    if vpp is not None and overrides.get("batch_p2p_comm", False):
        raise ValueError(
            "virtual pipeline parallelism with batch_p2p_comm=True is rejected: with VPP the previous and next "
            "pipeline peers can be the same rank, batched isend/irecv to one peer are matched in the wrong order, "
            "and training is silently wrong. Use batch_p2p_comm=False with overlap_p2p_comm=True (the default here).")
    if vpp is not None and not overrides.get("overlap_p2p_comm", True):
        raise ValueError(
            "virtual pipeline parallelism with overlap_p2p_comm=False and variable sequence lengths hangs or "
            "aborts (gloo size mismatch); leave overlap_p2p_comm=True")
    kw = dict(
        # architecture
        num_layers=_get(hf_config, "num_hidden_layers"), hidden_size=_get(hf_config, "hidden_size"),
        ffn_hidden_size=_get(hf_config, "intermediate_size"), num_attention_heads=n_heads, num_query_groups=n_kv,
        kv_channels=hn, normalization="RMSNorm", layernorm_epsilon=float(_get(hf_config, "rms_norm_eps", 1e-6)),
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        add_qkv_bias=has_qkv_bias(hf_config), qk_layernorm=has_qk_norm(hf_config),
        hidden_dropout=0.0, attention_dropout=0.0, init_method_std=float(_get(hf_config, "initializer_range", 0.02)),
        # layout and precision
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
        context_parallel_size=parallel.cp, sequence_parallel=parallel.sequence_parallel,
        params_dtype=params_dtype, pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16, fp16=params_dtype == torch.float16,
        # runtime
        use_cpu_initialization=not torch.cuda.is_available(), perform_initialization=True,
        **dict.fromkeys(LOCAL_SPEC_FUSIONS, False),
        variable_seq_lengths=True, moe_token_dispatcher_type="alltoall",
        calculate_per_token_loss=calculate_per_token_loss,
    )
    if vpp is not None:
        kw.update(overlap_p2p_comm=True, batch_p2p_comm=False)
    overrides = dict(overrides)
    router_loss = RouterLossCoefficients.pop_from(overrides)  # our router owns these, not megatron
    if is_moe(hf_config):
        kw.update(moe_settings(hf_config, parallel))
    kw.update(overrides)
    config = TransformerConfig(**kw)
    config.router_loss = router_loss  # read by moe.RouterWithMiniBatchLosses
    return config


def moe_settings(hf_config, parallel: MegatronConfig) -> dict:
    """``TransformerConfig`` keywords of an HF Qwen3-MoE / Qwen2-MoE config: routing as HF (softmax, top-k;
    ``norm_topk_prob`` renormalises the k weights = megatron's ``moe_router_pre_softmax=False``), Qwen2-MoE's
    shared expert scaled by sigmoid(shared_expert_gate), no token dropping, megatron's router losses off."""
    mt = model_type(hf_config)
    n_exp = num_experts(hf_config)
    ffn = int(_get(hf_config, "moe_intermediate_size"))
    if int(_get(hf_config, "decoder_sparse_step", 1) or 1) != 1 or list(_get(hf_config, "mlp_only_layers", []) or []):
        raise ValueError(
            f"{mt}: decoder_sparse_step != 1 or mlp_only_layers (dense layers between MoE layers) is not supported; "
            "every layer must be sparse")
    shared = int(_get(hf_config, "shared_expert_intermediate_size", 0) or 0) if mt == "qwen2_moe" else 0
    if shared % parallel.tp:
        raise ValueError(f"shared_expert_intermediate_size={shared} is not divisible by tp={parallel.tp}")
    return dict(
        num_moe_experts=n_exp, moe_ffn_hidden_size=ffn, moe_router_topk=int(_get(hf_config, "num_experts_per_tok")),
        moe_router_score_function="softmax", moe_router_pre_softmax=not bool(_get(hf_config, "norm_topk_prob", False)),
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, moe_z_loss_coeff=None,  # moe.py owns them
        moe_grouped_gemm=False, moe_permute_fusion=False, moe_router_fusion=False, moe_token_dispatcher_type="alltoall",
        moe_shared_expert_intermediate_size=shared or None, moe_shared_expert_gate=bool(shared),
        moe_shared_expert_overlap=False,
        expert_model_parallel_size=parallel.ep, expert_tensor_parallel_size=parallel.etp,
    )


def build_model_chunks(hf_config, tf_config, value_head: bool = False) -> list:
    """One megatron ``GPTModel`` per virtual pipeline stage held by this rank, randomly initialised (``hf_bridge``
    loads the weights), on the current CUDA device if any. Embeddings are tied as the HF config says (LM only)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    from verl_lite.compat import cpu_adapter, megatron_internals

    cpu_adapter.install()  # no-op on GPU or when init_distributed already did it (RoPE needs it on CPU)
    megatron_internals.prepare_host_dispatch()
    speed_paths.route_rotary()
    vpp = tf_config.virtual_pipeline_model_parallel_size
    tied = bool(_get(hf_config, "tie_word_embeddings", False)) and not value_head
    chunks = []
    for stage in range(vpp or 1):
        vp_stage = stage if vpp else None
        pre = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
        post = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
        model = GPTModel(
            config=tf_config, transformer_layer_spec=_block_spec(tf_config, vp_stage),
            vocab_size=padded_vocab_size(_get(hf_config, "vocab_size"), tf_config.tensor_model_parallel_size),
            max_sequence_length=int(_get(hf_config, "max_position_embeddings", 4096)), pre_process=pre,
            post_process=post, parallel_output=True, share_embeddings_and_output_weights=tied,
            position_embedding_type="rope", **rope_settings(hf_config), vp_stage=vp_stage)
        model.is_value_model = value_head  # read by hf_bridge on every stage
        megatron_internals.make_dispatchers_host_safe(model)
        speed_paths.adapt_built_model(model)
        if post and value_head:
            model.output_layer = ValueHead(tf_config, tf_config.hidden_size)
            model.output_layer.weight.is_embedding_or_output_parameter = True
        if torch.cuda.is_available():
            model.cuda(torch.cuda.current_device())
        chunks.append(model)
    return chunks


def unwrap_model(chunk):
    """The ``GPTModel`` inside DDP / Float16Module wrappers."""
    while hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk

