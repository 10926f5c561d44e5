"""Engine configuration: the optimizer and the engine itself, validated on construction.

Everything here is plain data (picklable, no torch.distributed), so workers and the
controller can build and check it before any process group exists.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from verl_lite.engine.distributed import ParallelConfig

from verl_lite.engine.rules import (
    ATTENTION_BACKENDS,
    MEGATRON_ATTENTION_NAMES,
    canonical_dtype,
    dtype_problems,
    optim_problems,
)


@dataclass
class OptimConfig:
    """Adam(W) with decoupled weight decay, global-norm gradient clipping and an LR schedule.

    Schedule (megatron ``OptimizerParamScheduler``), for optimizer step k = 1, 2, ...:
    - warm-up: lr_k = lr * k / lr_warmup_steps for k <= lr_warmup_steps;
    - then "constant": lr; "linear"/"cosine": decays from lr to min_lr at k = total_steps.
    Weight decay skips biases and 1-D parameters (norms), as megatron does by default.
    Loading a checkpoint always restores the step count k; the schedule's shape (lr, min_lr,
    warm-up, total_steps, style) is this config's unless ``use_checkpoint_opt_param_scheduler``
    (verl's key and meaning: then the checkpoint's shape is kept).
    Every field the config's ``optim`` section holds is required here (its defaults live in
    ``verl_lite.config.schema`` only); ``verl_lite.workers.from_config.optim_config`` builds one.
    """

    lr: float
    weight_decay: float
    betas: tuple[float, float]
    clip_grad: float
    lr_warmup_steps: int
    lr_decay_style: str
    min_lr: float
    use_checkpoint_opt_param_scheduler: bool
    use_distributed_optimizer: bool
    total_steps: int = 1
    eps: float = 1e-8

    def __post_init__(self):
        self.betas = tuple(float(b) for b in self.betas)
        problems = optim_problems("OptimConfig", self, value_last=True)
        if problems:
            raise ValueError("; ".join(problems))
        if self.lr_decay_style != "constant" and self.lr_warmup_steps >= self.total_steps:
            raise ValueError(
                f"OptimConfig: lr_warmup_steps={self.lr_warmup_steps} must be < total_steps={self.total_steps} "
                f"for lr_decay_style={self.lr_decay_style!r}"
            )


@dataclass
class EngineConfig:
    """What ``MegatronEngine`` builds.

    The fields the config states (seed, params_dtype, the layout's timeout) are required, their
    defaults live in ``verl_lite.config.schema`` only; ``verl_lite.workers.from_config.engine_config``
    builds one from the schema's defaults.

    model_path: HF model directory (config.json + safetensors).
    parallel: TP/PP/VPP/CP/SP layout and the collective timeout.
    calculate_per_token_loss: megatron's per-token mode (the engine hands megatron token counts
        and scales the loss so the gradient is the same in both modes).
    value_head: build a critic (scalar head) instead of the LM head.
    forward_only: no DDP, no optimizer (reference policy, inference).
    optim: the optimizer; None only for a forward_only engine.
    params_dtype: "float32" or "bfloat16" (also "fp32"/"bf16"). bfloat16 is megatron's mixed
        precision: bf16 weights and activations (``Float16Module``), fp32 main parameters in the
        optimizer, fp32 gradient accumulation and reduction (DDP ``grad_reduce_in_fp32``), logits
        cast to fp32 before log-probs/entropy/values, so every loss is computed in fp32.
    lora: ``engine.lora.LoraConfig`` (adapters on the targeted linears, the base frozen;
        a critic's value head still trains whole) or None.
    attention_backend: THD core attention kernel: "auto" (flash-attn varlen when CUDA, the
        ``flash_attn`` package and a 16-bit dtype are all present, else SDPA), "sdpa" (always SDPA),
        "flash" (flash-attn, an error where it cannot run). See ``attention.select_attention_backend``.
    """

    model_path: str
    parallel: "ParallelConfig"
    optim: OptimConfig | None = None
    calculate_per_token_loss: bool = False
    value_head: bool = False
    forward_only: bool = False
    seed: int = field(kw_only=True)
    params_dtype: str = field(kw_only=True)
    attention_backend: str = "auto"
    model_overrides: dict[str, Any] = field(default_factory=dict)
    lora: Any = None  # engine.lora.LoraConfig: adapters on a frozen base (None: every parameter trains)

    def __post_init__(self):
        from pathlib import Path

        if not self.model_path:
            raise ValueError("EngineConfig.model_path is empty; give an HF model directory")
        if not (Path(self.model_path) / "config.json").is_file():
            raise ValueError(
                f"EngineConfig.model_path={self.model_path!r} has no config.json; give an HF model directory "
                f"(config.json + *.safetensors)"
            )
        if problems := dtype_problems("EngineConfig.params_dtype", self.params_dtype):
            raise ValueError(problems[0])
        self.params_dtype = canonical_dtype(self.params_dtype)
        if "attention_backend" in self.model_overrides:  # verl's override_transformer_config.attention_backend
            overrides = dict(self.model_overrides)
            value = overrides.pop("attention_backend")
            name = str(getattr(value, "name", value)).lower()
            mapped = MEGATRON_ATTENTION_NAMES.get(name)
            if mapped is None:
                raise ValueError(
                    f"attention_backend={name!r}: megatron's fused (Transformer Engine) attention is not built; "
                    f"use flash, auto, unfused or local (unfused/local = torch SDPA)"
                )
            if self.attention_backend not in ("auto", mapped):
                raise ValueError(
                    f"EngineConfig.attention_backend={self.attention_backend!r} and model_overrides "
                    f"attention_backend={name!r} disagree; give one"
                )
            self.attention_backend, self.model_overrides = mapped, overrides
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"EngineConfig.attention_backend={self.attention_backend!r}; choose one of {ATTENTION_BACKENDS}"
            )
        if self.lora is not None and type(self.lora).__name__ != "LoraConfig":
            raise TypeError(f"EngineConfig.lora must be an engine.lora.LoraConfig or None, got {type(self.lora).__name__}")
        if not isinstance(self.optim, OptimConfig) and not (self.forward_only and self.optim is None):
            raise TypeError(f"EngineConfig.optim must be an OptimConfig (None only with forward_only), "
                            f"got {type(self.optim).__name__}")

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.params_dtype)
