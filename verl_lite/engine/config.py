"""The engine's config sections and the engine config, checked when an engine is built.

``MegatronConfig`` (a role's ``megatron`` section: layout, dtype, timeout), ``OptimConfig`` (its ``optim``
section) and ``LoraConfig`` (its ``model.lora`` section) are defined here once, with their defaults and
checks (``problems``); ``verl_lite.config.schema`` composes them under verl's key names and the engine takes
them as they are. Everything here is plain data (picklable, no torch.distributed), so workers and the
controller can build and check it before any process group exists.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from verl_lite.engine.rules import (
    ATTENTION_BACKENDS,
    MEGATRON_ATTENTION_NAMES,
    MEGATRON_NAMES,
    canonical_dtype,
    dtype_problems,
    layout_problems,
    lora_problems,
    lora_projections,
    optim_problems,
)

RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


def _raise_on(problems: list[str]) -> None:
    if problems:
        raise ValueError("; ".join(problems))


@dataclass
class MegatronConfig:
    tensor_model_parallel_size: int = 1  # TP: each layer's weights split over this many ranks
    pipeline_model_parallel_size: int = 1  # PP: layers split into this many stages
    virtual_pipeline_model_parallel_size: Optional[int] = None  # needs pp > 1 and layers % (pp * vpp) == 0
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
    vpp = property(lambda self: self.virtual_pipeline_model_parallel_size)
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
        """The layout over ``world`` ranks (None: not checked), the timeout and the dtype (engine/rules.py)."""
        layout = {short: getattr(self, name) for short, name in MEGATRON_NAMES.items()}
        return (layout_problems(key, layout, world, workers, model_cfg, MEGATRON_NAMES)
                + dtype_problems(f"{key}.dtype", self.dtype))

    def validate(self, world_size: int | None = None) -> "MegatronConfig":
        """Raise ValueError naming every problem and its fix; return self when the layout is valid."""
        from verl_lite.engine.rules import moe_layout_problems

        problems = self.problems("megatron", world_size) + moe_layout_problems("megatron", self, world_size or 0, None)
        if not problems and world_size and (world_size // self.pp) % (self.ep * self.etp):
            problems.append(f"megatron: expert parallelism ep*etp = {self.ep}*{self.etp} must divide tp*cp*dp = "
                            f"{world_size // self.pp} (world size {world_size} / pp {self.pp}); change "
                            f"expert_model_parallel_size or the number of processes")
        _raise_on(problems)
        return self


@dataclass
class OptimConfig:
    """Adam(W) with decoupled weight decay, global-norm gradient clipping and an LR schedule.

    Schedule (megatron ``OptimizerParamScheduler``), for optimizer step k = 1, 2, ...: warm-up lr_k = lr * k /
    lr_warmup_steps for k <= lr_warmup_steps; then "constant": lr; "linear"/"cosine": decays from lr to min_lr
    at the engine's ``total_steps``. Weight decay skips biases and 1-D parameters (norms), as megatron does.
    Loading a checkpoint always restores the step count k; the schedule's shape is this config's unless
    ``use_checkpoint_opt_param_scheduler``."""

    lr: float = 1e-4  # peak learning rate (verl: 1e-6; see 'Defaults that differ')
    weight_decay: float = 0.0  # decoupled (AdamW) weight decay; biases and norms are skipped
    clip_grad: float = 1.0  # max global grad norm
    lr_warmup_steps: int = 0  # optimizer steps of linear warm-up
    lr_decay_style: str = "constant"  # constant | linear | cosine
    min_lr: float = 0.0  # floor for linear/cosine decay
    betas: List[float] = field(default_factory=lambda: [0.9, 0.99])  # Adam betas
    use_checkpoint_opt_param_scheduler: bool = False  # on resume: true keeps the checkpoint's LR schedule; false (verl's default) continues this run's schedule from the saved step

    def problems(self, key: str = "optim", total_steps: int | None = None) -> list[str]:
        """The optimizer's ranges (engine/rules.py); with ``total_steps`` (the schedule's length) also that a
        decaying schedule's warm-up ends before it."""
        out = optim_problems(key, self)
        if total_steps is not None and total_steps < 1:
            out.append(f"{key}: total_steps={total_steps} must be >= 1")
        elif total_steps is not None and self.lr_decay_style != "constant" and self.lr_warmup_steps >= total_steps:
            out.append(f"{key}.lr_warmup_steps={self.lr_warmup_steps} must be < total_steps={total_steps} "
                       f"for lr_decay_style={self.lr_decay_style!r}")
        return out


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
        """The LoRA rules (engine/rules.py); rank 0 (no LoRA) is accepted."""
        return lora_problems(key, self)

    @property
    def scaling(self) -> float:
        return float(self.alpha) / int(self.rank)

    @property
    def projections(self) -> tuple[str, ...]:
        """The HF projections that get an adapter, in ``LORA_ALL_LINEAR`` order."""
        return lora_projections(self.target_modules, self.exclude_modules)


@dataclass
class EngineConfig:
    """What ``MegatronEngine`` builds: a role's sections as the config holds them, and what the role adds.

    model_path: HF model directory (config.json + safetensors).
    megatron: the layout, dtype, per-token loss mode, timeout and TransformerConfig overrides. bfloat16 is
        megatron's mixed precision: bf16 weights and activations (``Float16Module``), fp32 main parameters in
        the optimizer, fp32 gradient accumulation and reduction, logits cast to fp32 before
        log-probs/entropy/values, so every loss is computed in fp32. ``calculate_per_token_loss``: the engine
        hands megatron token counts and scales the loss so the gradient is the same in both modes.
    optim: the optimizer; None only for a forward_only engine. total_steps: the LR schedule's length.
    lora: adapters on the targeted linears, the base frozen (a critic's value head still trains whole);
        rank 0 is no LoRA (``lora`` becomes None).
    gradient_checkpointing: megatron activation recompute (full, uniform, one layer; the role's
        ``model.enable_gradient_checkpointing``).
    value_head: build a critic (scalar head) instead of the LM head.
    forward_only: no DDP, no optimizer (reference policy, inference).
    seed: the run's seed (``trainer.seed``). adam_eps: Adam's epsilon (not a config key).
    attention_backend: THD core attention kernel: "auto" (flash-attn varlen when CUDA, the ``flash_attn``
        package and a 16-bit dtype are all present, else SDPA), "sdpa", "flash" (an error where it cannot
        run); ``megatron.override_transformer_config.attention_backend`` (megatron's names) sets it too.
    """

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

    def __post_init__(self):
        from pathlib import Path

        if not self.model_path:
            raise ValueError("EngineConfig.model_path is empty; give an HF model directory")
        if not (Path(self.model_path) / "config.json").is_file():
            raise ValueError(
                f"EngineConfig.model_path={self.model_path!r} has no config.json; give an HF model directory "
                f"(config.json + *.safetensors)"
            )
        if self.lora is not None and not self.lora.rank:  # rank 0 = no LoRA
            self.lora = None
        if self.forward_only:
            self.optim = None
        if self.optim is None and not self.forward_only:
            raise TypeError("EngineConfig.optim must be an OptimConfig (None only with forward_only)")
        _raise_on(self.megatron.problems("megatron")
                  + (self.optim.problems("optim", self.total_steps) if self.optim is not None else [])
                  + (self.lora.problems("lora") if self.lora is not None else []))
        overrides = self.megatron.override_transformer_config or {}
        if "attention_backend" in overrides:  # verl's override_transformer_config.attention_backend
            value = overrides["attention_backend"]
            name = str(getattr(value, "name", value)).lower()
            mapped = MEGATRON_ATTENTION_NAMES.get(name)
            if mapped is None:
                raise ValueError(
                    f"attention_backend={name!r}: megatron's fused (Transformer Engine) attention is not built; "
                    f"use flash, auto, unfused or local (unfused/local = torch SDPA)"
                )
            if self.attention_backend not in ("auto", mapped):
                raise ValueError(
                    f"EngineConfig.attention_backend={self.attention_backend!r} and megatron.override_transformer_config "
                    f"attention_backend={name!r} disagree; give one"
                )
            self.attention_backend = mapped
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"EngineConfig.attention_backend={self.attention_backend!r}; choose one of {ATTENTION_BACKENDS}"
            )

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
