"""The engine's config sections (a role's ``megatron``, ``optim`` and ``model.lora``) and the engine config.

Each section is defined here once, with its defaults, choices and checks (``problems``: one line per problem,
naming ``key``, the caller's name for the section, and the fix); ``verl_lite.config.schema`` composes them
under verl's key names. Plain data (torch and megatron only inside the checks that need them), so the
controller can build and check it before any process group exists.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

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


# optimizer field -> (accepted?, what is required)
OPTIM_RANGES = {
    "lr": (lambda o: o.lr > 0, "must be > 0"),
    "weight_decay": (lambda o: o.weight_decay >= 0, "must be >= 0"),
    "betas": (lambda o: len(o.betas) == 2 and all(0.0 <= b < 1.0 for b in o.betas), "must be two numbers in [0, 1)"),
    "clip_grad": (lambda o: o.clip_grad > 0, "must be > 0 (a global-norm threshold; use a large value such as 1e9 "
                                             "to effectively disable clipping)"),
    "lr_decay_style": (lambda o: o.lr_decay_style in LR_DECAY_STYLES, "is unknown; choose constant, linear or cosine"),
    "lr_warmup_steps": (lambda o: o.lr_warmup_steps >= 0, "must be >= 0"),
    "min_lr": (lambda o: 0.0 <= o.min_lr <= o.lr, "must lie in [0, lr]"),
}


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
# the fused kernels megatron's local (non-Transformer-Engine) layer spec lacks: the engine sets them false
LOCAL_SPEC_FUSIONS = ("apply_rope_fusion", "bias_activation_fusion", "bias_dropout_fusion", "masked_softmax_fusion",
                      "persist_layer_norm", "gradient_accumulation_fusion", "cross_entropy_loss_fusion")
_OVERRIDE_FALSE_ONLY = LOCAL_SPEC_FUSIONS + ("account_for_embedding_in_pipeline_split",
                                             "account_for_loss_in_pipeline_split")
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
    from verl_lite.compat.lazy_compile import compile_decorators_deferred

    with compile_decorators_deferred():  # the driver validates, and never compiles: megatron's import, not dynamo's
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


# the short names of a megatron section's layout (MegatronConfig's properties) -> its keys
MEGATRON_NAMES = {"tp": "tensor_model_parallel_size", "pp": "pipeline_model_parallel_size",
                  "vpp": "virtual_pipeline_model_parallel_size", "cp": "context_parallel_size",
                  "sequence_parallel": "sequence_parallel", "timeout_s": "timeout_s",
                  "ep": "expert_model_parallel_size", "etp": "expert_tensor_parallel_size"}


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


def _names_or_value(value):
    """Module names as a list (a single name or a list of them compare alike); a path or None as it is."""
    return as_names(value) if isinstance(value, (list, tuple)) or value in LORA_TARGETS else value


RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


def _raise_on(problems: list[str]) -> None:
    if problems:
        raise ValueError("; ".join(problems))


def head_split_problem(key: str, tp: int, model_cfg: dict | None, why: str) -> str | None:
    """The one rule of splitting attention over ``tp`` ranks (``key`` = its setting): ``tp`` divides the model's
    attention heads, and it and the key/value heads divide one another (``why``: who replicates KV heads)."""
    heads = (model_cfg or {}).get("num_attention_heads")
    kv_heads = (model_cfg or {}).get("num_key_value_heads") or heads
    if heads is None or not (heads % tp or (kv_heads % tp and tp % kv_heads)):
        return None
    return (f"{key}={tp} must divide the model's attention heads ({heads}), and TP and the key/value heads "
            f"({kv_heads}) must divide one another ({why})")


@dataclass
class MegatronConfig:
    tensor_model_parallel_size: int = 1  # TP: each layer's weights split over this many ranks
    pipeline_model_parallel_size: int = 1  # PP: layers split into this many stages
    virtual_pipeline_model_parallel_size: Optional[int] = None  # model chunks per pipeline rank (null or 1: none); > 1 needs pp > 1 and layers % (pp * vpp) == 0
    context_parallel_size: int = 1  # CP: each sequence split over this many ranks (zig-zag, THD)
    sequence_parallel: bool = False  # only meaningful with tp > 1
    expert_model_parallel_size: int = 1  # EP (MoE models only): each MoE layer's experts split over this many ranks
    expert_tensor_parallel_size: int = 1  # ETP: 1 = every expert whole on its rank (the only value built)
    use_distributed_optimizer: bool = False  # shard optimizer state over DP (megatron's distributed optimizer)
    calculate_per_token_loss: bool = False  # megatron's loss mode; the gradient is the same in both
    timeout_s: int = 300  # process-group timeout: a stuck collective fails after this many seconds
    dtype: str = "float32"  # float32 | bfloat16 (bf16 weights/activations, fp32 main params, grads and losses)
    override_transformer_config: Dict[str, Any] = field(default_factory=dict)  # megatron TransformerConfig fields, applied last

    @classmethod
    def layout(cls, **fields) -> "MegatronConfig":
        """A section from the short names of its layout (``tp``, ``pp``, ``vpp``, ``cp``, ``ep``, ``etp``: the
        read-only properties below) and any of its own fields."""
        return cls(**{MEGATRON_NAMES.get(k, k): v for k, v in fields.items()})

    tp = property(lambda self: self.tensor_model_parallel_size)
    pp = property(lambda self: self.pipeline_model_parallel_size)
    vpp = property(lambda self: None if self.virtual_pipeline_model_parallel_size == 1 else  # 1 chunk: none
                   self.virtual_pipeline_model_parallel_size)
    cp = property(lambda self: self.context_parallel_size)
    ep = property(lambda self: self.expert_model_parallel_size)
    etp = property(lambda self: self.expert_tensor_parallel_size)

    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp

    def dp(self, world_size: int) -> int:
        """DP is whatever the layout leaves: ``world_size // (tp * pp * cp)``."""
        return world_size // self.model_parallel_size

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, canonical_dtype(self.dtype))

    def problems(self, key: str = "megatron", world: int | None = None, workers: str = "the {world} processes",
                 model_cfg: dict | None = None) -> list[str]:
        """The rules of the TP x PP (x VPP) x CP layout over ``world`` ranks (None: not checked), the timeout and
        the dtype; with ``model_cfg`` (config.json) also how its layers and heads divide."""
        def name(short: str) -> str:
            return f"{key}.{MEGATRON_NAMES[short]}"

        tp, pp, vpp, cp = self.tp, self.pp, self.vpp, self.cp
        bad = [f for f, v in (("tp", tp), ("pp", pp), ("cp", cp)) if not isinstance(v, int) or isinstance(v, bool) or v < 1]
        out = [f"{name(f)}={getattr(self, f)!r} must be an integer >= 1" for f in bad]
        if vpp is not None:
            if not isinstance(vpp, int) or isinstance(vpp, bool) or vpp < 2:
                out.append(f"{name('vpp')}={vpp!r} must be an integer >= 1 (model chunks per pipeline rank; 1 or "
                           f"null: no interleaving)")
            elif not bad and pp < 2:
                out.append(f"{name('vpp')}={vpp} needs {MEGATRON_NAMES['pp']} > 1 (got {pp}); set it to null or raise pp")
        if self.sequence_parallel and not bad and tp < 2:
            out.append(f"{name('sequence_parallel')}=true needs {MEGATRON_NAMES['tp']} > 1 (got {tp}); set it to false")
        if not self.timeout_s or self.timeout_s <= 0:
            out.append(f"{name('timeout_s')}={self.timeout_s} must be > 0 seconds (a stuck collective fails after it)")
        out += dtype_problems(f"{key}.dtype", self.dtype)
        if bad:
            return out
        if world is not None and world >= 1 and world % (tp * pp * cp):
            out.append(f"{workers.format(world=world)} must divide by tp*pp*cp = {tp}*{pp}*{cp} = {tp * pp * cp}; "
                       f"change {key}.tensor/pipeline/context_parallel_size or the worker count")
        if model_cfg is not None:
            layers, heads = model_cfg.get("num_hidden_layers"), model_cfg.get("num_attention_heads")
            kv_heads = model_cfg.get("num_key_value_heads") or heads
            stages = pp * (vpp if isinstance(vpp, int) and vpp >= 2 else 1)
            if layers is not None and layers % stages:
                out.append(f"the model's {layers} layers must divide by pp x vpp = {pp} x {vpp or 1} = {stages}; "
                           f"change {name('pp')} / {MEGATRON_NAMES['vpp']}")
            out += filter(None, [head_split_problem(name("tp"), tp, model_cfg,
                                                    "megatron replicates KV heads when TP exceeds them")])
        return out

    def moe_problems(self, key: str, world: int, model_cfg: dict | None) -> list[str]:
        """Expert parallelism (``expert_model_parallel_size`` / ``expert_tensor_parallel_size``) and the
        router-loss overrides: EP > 1 and router losses only for a mixture-of-experts model."""
        ep, etp, tp, pp = self.ep, self.etp, self.tp, self.pp
        for field_name, v in (("expert_model_parallel_size", ep), ("expert_tensor_parallel_size", etp)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                return [f"{key}.{field_name}={v!r} must be an integer >= 1"]
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
                    for k, v in (self.override_transformer_config or {}).items() if k in ROUTER_LOSS_KEYS and v]
        if moe or model_cfg is None:  # a dense model refuses EP > 1 above
            if world >= 1 and (world // pp) % (ep * etp):
                out.append(f"{key}.expert_model_parallel_size x expert_tensor_parallel_size = {ep * etp} must divide "
                           f"the {world // pp} ranks of a pipeline stage (workers / pp)")
        if moe:
            experts = model_cfg.get("num_experts") or model_cfg.get("num_local_experts")
            if experts and experts % ep:
                out.append(f"{key}.expert_model_parallel_size={ep} must divide the model's {experts} experts")
            if tp > 1 and not self.sequence_parallel:
                out.append(f"{key}: a mixture-of-experts model with tensor_model_parallel_size={tp} needs "
                           "sequence_parallel=true (megatron's token dispatcher splits the tokens over TP)")
        return out

    def validate(self, world_size: int | None = None, model_cfg: dict | None = None) -> "MegatronConfig":
        """Raise ValueError naming every problem and its fix (with ``model_cfg``: also the model's); return self."""
        _raise_on(self.problems("megatron", world_size, model_cfg=model_cfg)
                  + self.moe_problems("megatron", world_size or 0, model_cfg))
        return self


@dataclass
class OptimConfig:
    """Adam(W) with decoupled weight decay, global-norm gradient clipping and an LR schedule.

    Schedule (megatron ``OptimizerParamScheduler``), for schedule step k = 0, 1, ...: warm-up lr_k = lr * k /
    lr_warmup_steps for k <= lr_warmup_steps; then "constant": lr; "linear"/"cosine": decays from lr to min_lr
    at the engine's ``total_steps``. RL: a schedule step is an RL step (verl's rule: every optimizer step of
    RL step k uses lr_k, so the first RL step of a warm-up trains at 0); SFT: an optimizer step (k = 1, 2, ...).
    Weight decay skips biases and 1-D parameters (norms), as megatron does. Loading a checkpoint always
    restores the step count k; the schedule's shape is this config's unless ``use_checkpoint_opt_param_scheduler``."""

    lr: float = 1e-4  # peak learning rate (verl: 1e-6; see 'Defaults that differ')
    weight_decay: float = 0.0  # decoupled (AdamW) weight decay; biases and norms are skipped
    clip_grad: float = 1.0  # max global grad norm
    lr_warmup_steps: int = 0  # schedule steps of linear warm-up (RL steps; SFT: optimizer steps)
    lr_decay_style: str = "constant"  # constant | linear | cosine
    min_lr: float = 0.0  # floor for linear/cosine decay
    betas: List[float] = field(default_factory=lambda: [0.9, 0.99])  # Adam betas
    use_checkpoint_opt_param_scheduler: bool = False  # on resume: true keeps the checkpoint's LR schedule; false (verl's default) continues this run's schedule from the saved step

    def problems(self, key: str = "optim", total_steps: int | None = None) -> list[str]:
        """The optimizer's ranges (``OPTIM_RANGES``); with ``total_steps`` (the schedule's length) also that a
        decaying schedule's warm-up ends before it."""
        out = []
        for name, (ok, requirement) in OPTIM_RANGES.items():
            if not ok(self):
                value = getattr(self, name)
                requirement += f" (lr={self.lr})" if name == "min_lr" else ""
                out.append(f"{key}.{name}={list(value) if isinstance(value, tuple) else value!r} {requirement}")
        return out + (self.schedule_problems(key, total_steps) if total_steps is not None else [])

    def schedule_problems(self, key: str, total_steps: int, unit: str = "total_steps") -> list[str]:
        """A schedule of ``total_steps`` steps: at least one, and a decaying one's warm-up ends before it."""
        if total_steps < 1:
            return [f"{key}: {unit}={total_steps} must be >= 1"]
        if self.lr_decay_style != "constant" and self.lr_warmup_steps >= total_steps:
            return [f"{key}.lr_warmup_steps={self.lr_warmup_steps} must be < {unit}={total_steps} "
                    f"for lr_decay_style={self.lr_decay_style!r}"]
        return []


@dataclass
class LoraConfig:
    """LoRA adapters on a frozen base (verl's ``model.lora.*``; docs/lora.md). rank 0 = off: every parameter trains."""

    type: str = "lora"  # lora | canonical_lora: both build one adapter per HF projection (PEFT's layout)
    rank: int = 0  # adapter rank; 0 = no LoRA
    alpha: float = 32.0  # scaling alpha / rank (PEFT's lora_alpha)
    dropout: float = 0.0  # dropout on the adapter input (0 = deterministic; > 0 needs tp=1)
    target_modules: Any = field(default_factory=lambda: ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])  # HF names (q_proj, ..., all-linear) or megatron's
    exclude_modules: List[str] = field(default_factory=list)  # names taken out of target_modules
    merge: bool = True  # the rollout receives merged weights (vLLM's LoRA-adapter path is not built)
    adapter_path: Optional[str] = None  # a PEFT adapter directory to start from (rank/alpha/targets must match)

    def problems(self, key: str = "lora") -> list[str]:
        """The rules of a LoRA section: type and merge; with ``rank`` > 0 alpha, dropout, module names and a
        target left; with rank 0 (the full model trains) no adapter-only field away from its default."""
        out = []
        if self.type not in LORA_TYPES:
            out.append(f"{key}.type={self.type!r} is not built (DoRA / VLM LoRA); use one of {LORA_TYPES} (both "
                       f"build one adapter per HF projection, as PEFT does)")
        if self.merge is not True:
            out.append(f"{key}.merge=false (vLLM's LoRA-adapter path) is not built: the rollout always receives "
                       f"merged weights; set it true or drop it")
        if self.rank == 0:
            default = type(self)()
            changed = [f"{key}.{name}={getattr(self, name)!r}" for name in LORA_ONLY_FIELDS
                       if _names_or_value(getattr(self, name)) != _names_or_value(getattr(default, name))]
            return out + ([f"{key}.rank=0 (no LoRA: the full model trains) with {', '.join(changed)} set: those only "
                           f"shape LoRA adapters; set {key}.rank > 0 to train adapters, or drop "
                           f"{', '.join(c.split('=')[0] for c in changed)} to train the full model"] if changed else [])
        if int(self.rank) < 0:
            out.append(f"{key}.rank must be > 0 to build adapters (0 = no LoRA), got {self.rank}")
        if not float(self.alpha) > 0:
            out.append(f"{key}.alpha must be > 0, got {self.alpha}")
        if not 0.0 <= float(self.dropout) < 1.0:
            out.append(f"{key}.dropout must lie in [0, 1), got {self.dropout}")
        for name in ("target_modules", "exclude_modules"):
            unknown = [n for n in as_names(getattr(self, name)) if n not in LORA_TARGETS]
            if unknown:
                out.append(f"{key}.{name} has unknown module names {unknown}; choose from {sorted(LORA_TARGETS)}")
        if not out and not self.projections:
            out.append(f"{key}.target_modules={as_names(self.target_modules)} minus exclude_modules leaves no module")
        return out

    @property
    def scaling(self) -> float:
        return float(self.alpha) / int(self.rank)

    @property
    def projections(self) -> tuple[str, ...]:
        """The HF projections that get an adapter, in ``LORA_ALL_LINEAR`` order."""
        return lora_projections(self.target_modules, self.exclude_modules)

    def layout_problems(self, key: str, num_kv_heads: int | None, tp: int,
                        tp_key: str = "tensor_model_parallel_size") -> list[str]:
        """What this LoRA (rank > 0) cannot do at tensor parallelism ``tp`` for a model of ``num_kv_heads`` KV heads:
        adapters on q/k/v are split by KV head group over TP ranks, and dropout masks must agree across TP ranks."""
        if not self.rank or tp <= 1:
            return []
        out = []
        if num_kv_heads and num_kv_heads % tp and set(self.projections) & {"q_proj", "k_proj", "v_proj"}:
            out.append(f"{key}.rank={self.rank} with {tp_key}={tp}: LoRA on the q/k/v projections needs the model's "
                       f"num_key_value_heads={num_kv_heads} divisible by the TP size (each TP rank holds whole KV "
                       f"groups); use a TP that divides {num_kv_heads}, or {key}.target_modules without q/k/v")
        if self.dropout > 0:
            out.append(f"{key}.dropout={self.dropout} with {tp_key}={tp}: the column-parallel inputs are replicated "
                       f"over TP and each rank would draw a different mask; use dropout 0 with TP")
        return out


@dataclass
class EngineConfig:
    """What ``MegatronEngine`` builds: a role's sections as the config holds them, and what the role adds.

    optim: None only for a forward_only engine (no DDP, no optimizer); total_steps: the LR schedule's length;
    lora rank 0 is no LoRA (``lora`` becomes None; a critic's value head trains whole either way);
    gradient_checkpointing: megatron activation recompute (``RECOMPUTE``); adam_eps is not a config key;
    attention_backend: the THD kernel (``attention.select_attention_backend``), also set by
    ``megatron.override_transformer_config.attention_backend`` (megatron's names); routing_replay: an MoE model
    whose routers can replay given routing (``SequenceBatch.routing``; engine/moe.py); batch_invariant_length:
    0, or every forward batch-invariant (engine/batch_invariant.py) with attention over this many key positions
    (the longest sequence it may see), at TP = PP = CP = 1."""

    model_path: str
    megatron: MegatronConfig = field(default_factory=MegatronConfig)
    optim: Optional[OptimConfig] = field(default_factory=OptimConfig)
    lora: Optional[LoraConfig] = None
    total_steps: int = 1
    gradient_checkpointing: bool = False
    value_head: bool = False
    forward_only: bool = False
    seed: int = 0
    adam_eps: float = 1e-8
    attention_backend: str = "auto"
    routing_replay: bool = False
    batch_invariant_length: int = 0

    def __post_init__(self):
        from pathlib import Path

        if not self.model_path:
            raise ValueError("EngineConfig.model_path is empty; give an HF model directory")
        if not (Path(self.model_path) / "config.json").is_file():
            raise ValueError(
                f"EngineConfig.model_path={self.model_path!r} has no config.json; give an HF model directory "
                f"(config.json + *.safetensors)")
        if self.lora is not None and not self.lora.rank:  # rank 0 = no LoRA
            self.lora = None
        if self.forward_only:
            self.optim = None
        if self.optim is None and not self.forward_only:
            raise TypeError("EngineConfig.optim must be an OptimConfig (None only with forward_only)")
        _raise_on(self.megatron.problems("megatron")
                  + (self.optim.problems("optim", self.total_steps) if self.optim is not None else [])
                  + (self.lora.problems("lora") if self.lora is not None else []))
        if self.batch_invariant_length < 0 or (self.batch_invariant_length and (
                self.megatron.tp, self.megatron.pp, self.megatron.cp) != (1, 1, 1)):
            raise ValueError(f"EngineConfig.batch_invariant_length={self.batch_invariant_length}: >= 0, and a batch-"
                             f"invariant engine runs at TP = PP = CP = 1 (got tp={self.megatron.tp}, pp="
                             f"{self.megatron.pp}, cp={self.megatron.cp}): their collectives sum in another order")
        overrides = self.megatron.override_transformer_config or {}
        if "attention_backend" in overrides:  # verl's override_transformer_config.attention_backend
            value = overrides["attention_backend"]
            name = str(getattr(value, "name", value)).lower()
            if name not in MEGATRON_ATTENTION_NAMES:
                raise ValueError(attention_backend_problem("megatron.override_transformer_config.attention_backend",
                                                           value))
            if self.attention_backend not in ("auto", MEGATRON_ATTENTION_NAMES[name]):
                raise ValueError(f"EngineConfig.attention_backend={self.attention_backend!r} and megatron."
                                 f"override_transformer_config.attention_backend={name!r} disagree; give one")
            self.attention_backend = MEGATRON_ATTENTION_NAMES[name]
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"EngineConfig.attention_backend={self.attention_backend!r}; choose one of "
                             f"{ATTENTION_BACKENDS}")

    @property
    def model_overrides(self) -> dict[str, Any]:
        """megatron ``TransformerConfig`` fields: activation recompute (``gradient_checkpointing``), then
        ``megatron.override_transformer_config`` (which wins), less the attention backend (``attention_backend``)."""
        overrides = {**(RECOMPUTE if self.gradient_checkpointing else {}),
                     **(self.megatron.override_transformer_config or {})}
        overrides.pop("attention_backend", None)
        return overrides

    def forward_only_twin(self, **changes) -> "EngineConfig":
        """This engine's forward-only copy (no optimizer, no LoRA, no recompute, of the overrides only the
        attention kernel): the frozen reference of an actor."""
        attention = {k: v for k, v in (self.megatron.override_transformer_config or {}).items() if k == "attention_backend"}
        return dataclasses.replace(self, megatron=dataclasses.replace(self.megatron, override_transformer_config=attention),
                                   optim=None, lora=None, gradient_checkpointing=False, forward_only=True, **changes)
