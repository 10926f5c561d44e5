"""The engine's rules, stated once: dtype, attention backend, optimizer ranges, the megatron override
policy and the expert-parallel layout.

Each function returns a list of problems (one line each, naming ``key`` - the caller's name for the
setting - and the fix); an empty list means the setting is accepted. ``engine/config.py`` raises on
them when an engine config is built; ``verl_lite.config.validate`` collects them for the whole run
config before any worker starts. Nothing here imports torch or megatron at module level (the MoE
names come from engine/model.py and engine/moe.py when a check needs them).
"""

from __future__ import annotations

LR_DECAY_STYLES = ("constant", "linear", "cosine")
PARAMS_DTYPES = ("float32", "bfloat16")
DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16"}
FP16_UNSUPPORTED = (
    "float16 training needs megatron's dynamic loss scaling (skipped steps on overflow), which the engine does "
    "not build; use bfloat16 (same memory, no loss scaling) or float32"
)
ATTENTION_BACKENDS = ("auto", "flash", "sdpa")
# megatron's AttnBackend names (verl's override_transformer_config.attention_backend) -> ours
MEGATRON_ATTENTION_NAMES = {"auto": "auto", "flash": "flash", "unfused": "sdpa", "local": "sdpa", "sdpa": "sdpa"}


MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe")  # every layer sparse (decoder_sparse_step=1, no mlp_only_layers)
ROUTER_LOSS_KEYS = ("moe_aux_loss_coeff", "moe_z_loss_coeff")  # the router losses' override keys


def canonical_dtype(name: str) -> str:
    """'bf16' -> 'bfloat16', 'fp32' -> 'float32' (verl's spellings); other names unchanged."""
    return DTYPE_ALIASES.get(str(name).lower(), str(name).lower())


# optimizer field -> (accepted?, what is required); a field the caller's section lacks is skipped
OPTIM_RANGES = {
    "lr": (lambda o: o.lr > 0, "must be > 0"),
    "weight_decay": (lambda o: o.weight_decay >= 0, "must be >= 0"),
    "betas": (lambda o: len(o.betas) == 2 and all(0.0 <= b < 1.0 for b in o.betas), "must be two numbers in [0, 1)"),
    "eps": (lambda o: o.eps > 0, "must be > 0"),
    "clip_grad": (lambda o: o.clip_grad > 0, "must be > 0 (a global-norm threshold; use a large value such as 1e9 "
                                             "to effectively disable clipping)"),
    "lr_decay_style": (lambda o: o.lr_decay_style in LR_DECAY_STYLES, "is unknown; choose constant, linear or cosine"),
    "lr_warmup_steps": (lambda o: o.lr_warmup_steps >= 0, "must be >= 0"),
    "total_steps": (lambda o: o.total_steps >= 1, "must be >= 1"),
    "min_lr": (lambda o: 0.0 <= o.min_lr <= o.lr, "must lie in [0, lr]"),
}


def optim_problems(key: str, optim, value_last: bool = False) -> list[str]:
    """The optimizer ranges (``OPTIM_RANGES``) of ``optim`` (the engine's OptimConfig or the config's section):
    ``key.name=value requirement``, or with ``value_last`` ``key.name requirement, got value``."""
    out = []
    for name, (ok, requirement) in OPTIM_RANGES.items():
        if hasattr(optim, name) and not ok(optim):
            value = getattr(optim, name)
            shown = repr(list(value) if isinstance(value, tuple) else value)
            requirement += f" (lr={optim.lr})" if name == "min_lr" else ""
            out.append(f"{key}.{name} {requirement}, got {shown}" if value_last else f"{key}.{name}={shown} {requirement}")
    return out


def dtype_problems(key: str, value) -> list[str]:
    """The engine's parameter dtype: float32 / fp32, or bfloat16 / bf16 (megatron mixed precision); float16 rejected."""
    name = canonical_dtype(value)
    if name in ("float16", "fp16", "half"):
        return [f"{key}={value}: {FP16_UNSUPPORTED}"]
    if name not in PARAMS_DTYPES:
        return [f"{key}={value!r} is unknown; choose float32 (fp32) or bfloat16 (bf16)"]
    return []


def attention_backend_problem(key: str, value, dtype: str = "float32") -> str | None:
    """megatron's ``attention_backend`` names: auto, flash, unfused/local (= torch SDPA); fused (Transformer
    Engine) is not built; flash must be able to run here."""
    name = str(getattr(value, "name", value)).lower()
    if name not in MEGATRON_ATTENTION_NAMES:
        return (f"{key}={value}: megatron's {name} attention (Transformer Engine) is not built; use auto (flash-attn "
                f"on GPU with bf16, else SDPA), flash, or unfused/local (torch SDPA)")
    if MEGATRON_ATTENTION_NAMES[name] == "flash":
        import torch

        from verl_lite.engine.attention import select_attention_backend

        try:
            select_attention_backend("flash", getattr(torch, canonical_dtype(dtype), torch.float32))
        except ValueError as err:
            return f"{key}={value}: {err}"
    return None


# megatron TransformerConfig fields that the engine sets itself and that cannot be overridden
_OVERRIDE_REJECT = {
    "num_layers_in_first_pipeline_stage": "uneven pipeline splits are not built (every stage holds layers / pp)",
    "num_layers_in_last_pipeline_stage": "uneven pipeline splits are not built (every stage holds layers / pp)",
}
_OVERRIDE_FALSE_ONLY = ("apply_rope_fusion", "bias_activation_fusion", "bias_dropout_fusion", "masked_softmax_fusion",
                        "persist_layer_norm", "gradient_accumulation_fusion", "cross_entropy_loss_fusion",
                        "account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split")
_OVERRIDE_ENGINE_OWNED = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                          "kv_channels", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                          "virtual_pipeline_model_parallel_size", "context_parallel_size", "sequence_parallel",
                          "params_dtype", "pipeline_dtype", "bf16", "fp16", "calculate_per_token_loss",
                          "variable_seq_lengths", "normalization", "gated_linear_unit", "add_bias_linear",
                          "add_qkv_bias", "qk_layernorm", "layernorm_epsilon")


def _override_problem(k: str, name: str, value, dtype: str, cuda: bool) -> str | None:

    if name == "attention_backend":
        return attention_backend_problem(k, value, dtype)
    if name in ROUTER_LOSS_KEYS:
        bad = not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0
        return f"{k}={value!r} must be a number >= 0" if bad else None
    if name.startswith("moe_"):
        return (f"{k}: the engine derives the MoE layer from the model's config.json (experts, top-k, shared "
                f"expert, routing); of the moe_* fields only {' and '.join(ROUTER_LOSS_KEYS)} can be set; drop it")
    if name in _OVERRIDE_REJECT:
        return f"{k}: {_OVERRIDE_REJECT[name]}; drop it"
    if name in _OVERRIDE_ENGINE_OWNED:
        return f"{k}: the engine derives it from model.path/config.json and the megatron layout keys; set those instead"
    if name in _OVERRIDE_FALSE_ONLY and value:
        return (f"{k}={value}: the engine builds megatron's local (non-Transformer-Engine) layer spec, which has no "
                f"fused kernel for it; drop it (false is accepted)")
    if name.startswith("recompute_") and value is not None and not cuda:
        return (f"{k}={value}: megatron's activation recompute saves and restores the CUDA RNG state, so it runs on "
                f"GPU only; drop it on CPU")
    return None


def transformer_override_problems(key: str, overrides: dict, dtype: str, cuda: bool) -> list[str]:
    """megatron ``TransformerConfig`` overrides: only fields the engine does not derive from the HF config /
    layout; fusions only false (the local layer spec has no fused kernels); of the moe_* fields only the
    router-loss coefficients; activation recompute only where CUDA runs it (``cuda``)."""
    if not overrides:
        return []
    import dataclasses

    from megatron.core.transformer import TransformerConfig

    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    out = []
    for name, value in overrides.items():
        k = f"{key}.{name}"
        problem = (f"{k}: not a field of megatron's TransformerConfig; drop it" if name not in fields
                   else _override_problem(k, name, value, dtype, cuda))
        if problem:
            out.append(problem)
    return out


def router_loss_recompute_problems(key: str, model_cfg: dict | None, overrides: dict, recompute_key: str) -> list[str]:
    """MoE router losses and activation recompute are not built together (the recomputed router forward would
    see another micro-batch's token map): rejected before start, as the engine would at step 1."""

    moe = model_cfg is not None and model_cfg.get("model_type") in MOE_MODEL_TYPES
    router = [k for k in ROUTER_LOSS_KEYS if overrides.get(k)]
    if moe and router and overrides.get("recompute_granularity") is not None:
        return [f"{key}.{router[0]}={overrides[router[0]]} with activation recompute ({recompute_key} / "
                f"recompute_granularity): MoE router losses under recompute are not built; turn one of them off"]
    return []


# the short names of a megatron section's layout (engine.config.MegatronConfig's properties) -> its keys
MEGATRON_NAMES = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
                  "vpp": "virtual_pipeline_model_parallel_size", "cp": "context_parallel_size",
                  "sequence_parallel": "sequence_parallel", "timeout_s": "timeout_s",
                  "ep": "expert_model_parallel_size", "etp": "expert_tensor_parallel_size"}


def layout_problems(key: str, layout: dict, world: int | None, workers: str = "the {world} processes",
                    model_cfg: dict | None = None, names: dict | None = None) -> list[str]:
    """The rules of one TP x PP (x VPP) x CP layout over ``world`` ranks (None: not checked), one line each.

    ``layout``: the short names (tp, pp, vpp, cp, sequence_parallel, timeout_s); ``names``: how ``key`` names
    them (default: the short names; ``MEGATRON_NAMES`` for a megatron section's keys);
    ``model_cfg``: the model's config.json, whose layers must divide by pp x vpp and whose attention heads by tp
    (TP and the KV heads divide one another: megatron replicates KV heads when TP exceeds them)."""
    def name(field: str) -> str:
        return f"{key}.{(names or {}).get(field, field)}"

    tp, pp, vpp, cp = (layout[f] for f in ("tp", "pp", "vpp", "cp"))
    bad = [f for f, v in (("tp", tp), ("pp", pp), ("cp", cp)) if not isinstance(v, int) or isinstance(v, bool) or v < 1]
    out = [f"{name(f)}={layout[f]!r} must be an integer >= 1" for f in bad]
    if vpp is not None:
        if not isinstance(vpp, int) or vpp < 2:
            out.append(f"{name('vpp')}={vpp} must be >= 2 (model chunks per pipeline rank) or null")
        elif not bad and pp < 2:
            out.append(f"{name('vpp')}={vpp} needs {(names or {}).get('pp', 'pp')} > 1 (got {pp}); set it to null "
                       f"or raise pp")
    if layout["sequence_parallel"] and not bad and tp < 2:
        out.append(f"{name('sequence_parallel')}=true needs {(names or {}).get('tp', 'tp')} > 1 (got {tp}); set it "
                   f"to false")
    if not layout["timeout_s"] or layout["timeout_s"] <= 0:
        out.append(f"{name('timeout_s')}={layout['timeout_s']} must be > 0 seconds (a stuck collective fails after it)")
    if bad:
        return out
    if world is not None and world >= 1 and world % (tp * pp * cp):
        out.append(f"{workers.format(world=world)} must divide by tp*pp*cp = {tp}*{pp}*{cp} = {tp * pp * cp}; change "
                   f"{key}.tensor/pipeline/context_parallel_size or the worker count")
    if model_cfg is not None:
        layers, heads = model_cfg.get("num_hidden_layers"), model_cfg.get("num_attention_heads")
        kv_heads = model_cfg.get("num_key_value_heads") or heads
        stages = pp * (vpp if isinstance(vpp, int) and vpp >= 2 else 1)
        if layers is not None and layers % stages:
            out.append(f"the model's {layers} layers must divide by pp x vpp = {pp} x {vpp or 1} = {stages}; change "
                       f"{name('pp')} / {(names or {}).get('vpp', 'vpp')}")
        if heads is not None and (heads % tp or (kv_heads % tp and tp % kv_heads)):
            out.append(f"{name('tp')}={tp} must divide the model's attention heads ({heads}), and TP and the "
                       f"key/value heads ({kv_heads}) must divide one another (megatron replicates KV heads when TP "
                       f"exceeds them)")
    return out


def moe_layout_problems(key: str, mg, world: int, model_cfg: dict | None) -> list[str]:
    """Expert parallelism (``expert_model_parallel_size`` / ``expert_tensor_parallel_size`` of the megatron
    section ``mg``) and the router-loss overrides: EP > 1 and router losses only for a mixture-of-experts model."""

    ep, etp = mg.expert_model_parallel_size, mg.expert_tensor_parallel_size
    tp, pp = mg.tensor_model_parallel_size, mg.pipeline_model_parallel_size
    for name, v in (("expert_model_parallel_size", ep), ("expert_tensor_parallel_size", etp)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            return [f"{key}.{name}={v!r} must be an integer >= 1"]
    out = []
    if etp != 1:
        out.append(f"{key}.expert_tensor_parallel_size={etp}: expert tensor parallelism is not built (experts are "
                   "kept whole on their EP rank); set it to 1")
    moe = model_cfg is not None and model_cfg.get("model_type") in MOE_MODEL_TYPES
    if model_cfg is not None and not moe:
        kind = f"the model ({model_cfg.get('model_type')}) is dense"
        if ep > 1:
            out.append(f"{key}.expert_model_parallel_size={ep}: {kind}, it has no experts to split; set it to 1")
        out += [f"{key}.override_transformer_config.{k}={v}: {kind}, it has no router; drop it"
                for k, v in (mg.override_transformer_config or {}).items() if k in ROUTER_LOSS_KEYS and v]
    if moe:
        experts = model_cfg.get("num_experts") or model_cfg.get("num_local_experts")
        if experts and experts % ep:
            out.append(f"{key}.expert_model_parallel_size={ep} must divide the model's {experts} experts")
        if world >= 1 and (world // pp) % (ep * etp):
            out.append(f"{key}.expert_model_parallel_size x expert_tensor_parallel_size = {ep * etp} must divide "
                       f"the {world // pp} ranks of a pipeline stage (workers / pp)")
        if tp > 1 and not mg.sequence_parallel:
            out.append(f"{key}: a mixture-of-experts model with tensor_model_parallel_size={tp} needs "
                       "sequence_parallel=true (megatron's token dispatcher splits the tokens over TP)")
    return out


# ------------------------------------------------------------------------------------------ LoRA
LORA_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
LORA_MLP = ("gate_proj", "up_proj", "down_proj")
LORA_ALL_LINEAR = LORA_ATTENTION + LORA_MLP
# a user's target name -> the HF projections it means: HF names, PEFT's all-linear, megatron's fused
# linears (which mean every projection they fuse) and verl's canonical megatron names
LORA_TARGETS = {
    **{p: (p,) for p in LORA_ALL_LINEAR},
    "all-linear": LORA_ALL_LINEAR,
    "linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "linear_q": ("q_proj",), "linear_k": ("k_proj",), "linear_v": ("v_proj",),
    "linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc1_gate": ("gate_proj",), "linear_fc1_up": ("up_proj",),
    "linear_fc2": ("down_proj",),
}
# verl's lora.type values that mean what the engine builds: one adapter per HF projection
LORA_TYPES = ("lora", "canonical_lora")


def as_names(value) -> list[str]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else [str(v) for v in value]


def lora_projections(target_modules, exclude_modules) -> tuple[str, ...]:
    """The HF projections that get an adapter (in ``LORA_ALL_LINEAR`` order); unknown names are skipped."""
    chosen = {p for t in as_names(target_modules) for p in LORA_TARGETS.get(t, ())}
    chosen -= {p for t in as_names(exclude_modules) for p in LORA_TARGETS.get(t, ())}
    return tuple(p for p in LORA_ALL_LINEAR if p in chosen)


LORA_ONLY_FIELDS = ("target_modules", "exclude_modules", "adapter_path")  # what only an adapter uses


def lora_off_problems(key: str, lora) -> list[str]:
    """rank 0 (no LoRA: every parameter trains) with an adapter-only field set away from its default (the
    section's own class default: what the user did not set): the run would train the full model without a
    word, so it is refused with both ways out."""
    default = type(lora)()
    changed = [f"{key}.{name}={getattr(lora, name)!r}" for name in LORA_ONLY_FIELDS
               if _names_or_value(getattr(lora, name)) != _names_or_value(getattr(default, name))]
    if not changed:
        return []
    return [f"{key}.rank=0 (no LoRA: the full model trains) with {', '.join(changed)} set: those only shape LoRA "
            f"adapters; set {key}.rank > 0 to train adapters, or drop {', '.join(c.split('=')[0] for c in changed)} "
            f"to train the full model"]


def _names_or_value(value):
    """Module names as a list (a single name or a list of them compare alike); a path or None as it is."""
    return as_names(value) if isinstance(value, (list, tuple)) or value in LORA_TARGETS else value


def lora_problems(key: str, lora) -> list[str]:
    """The rules of a LoRA section (``key`` names it, e.g. ``actor_rollout_ref.model.lora``): its type and merge,
    always; with ``rank`` > 0 (LoRA on) alpha, dropout, module names and a target left. rank 0 = no LoRA."""
    out = []
    if lora.type not in LORA_TYPES:
        out.append(f"{key}.type={lora.type!r} is not built (DoRA / VLM LoRA); use one of {LORA_TYPES} (both build "
                   f"one adapter per HF projection, as PEFT does)")
    if lora.merge is not True:
        out.append(f"{key}.merge=false (vLLM's LoRA-adapter path) is not built: the rollout always receives merged "
                   f"weights; set it true or drop it")
    if lora.rank == 0:
        return out + lora_off_problems(key, lora)
    if int(lora.rank) < 0:
        out.append(f"{key}.rank must be > 0 to build adapters (0 = no LoRA), got {lora.rank}")
    if not float(lora.alpha) > 0:
        out.append(f"{key}.alpha must be > 0, got {lora.alpha}")
    if not 0.0 <= float(lora.dropout) < 1.0:
        out.append(f"{key}.dropout must lie in [0, 1), got {lora.dropout}")
    for field in ("target_modules", "exclude_modules"):
        bad = [n for n in as_names(getattr(lora, field)) if n not in LORA_TARGETS]
        if bad:
            out.append(f"{key}.{field} has unknown module names {bad}; choose from {sorted(LORA_TARGETS)}")
    if not out and not lora_projections(lora.target_modules, lora.exclude_modules):
        out.append(f"{key}.target_modules={as_names(lora.target_modules)} minus exclude_modules leaves no module")
    return out

