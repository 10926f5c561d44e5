"""The one translation from the config's sections (``verl_lite.config.schema``) to what the roles build.

Every engine and worker setting comes from the loaded config through these functions; the
engine's and workers' config classes state no default of their own for a config key.

    actor_worker_config(cfg, total_steps, need_ref)   # WorkerConfig of the actor/rollout/ref role
    critic_worker_config(cfg, total_steps)            # EngineWorkerConfig of the critic role
    reward_model_worker_config(cfg)                   # EngineWorkerConfig of the reward-model role
    judge_worker_config(cfg)                          # RolloutWorkerConfig of the generative judge
    actor_loss_config(cfg.actor_rollout_ref.actor)    # algorithms.ActorLossConfig
    engine_model_overrides(model, megatron)           # EngineConfig.model_overrides of one role
    parallel_config / optim_config / engine_config    # the engine's configs from a section (default:
                                                      # the schema's defaults) plus overrides: SFT,
                                                      # export, tests and bench scripts
"""

from __future__ import annotations

import dataclasses

from verl_lite.workers.actor_rollout_ref import WorkerConfig
from verl_lite.workers.engine_worker import EngineWorkerConfig

# verl's model.enable_gradient_checkpointing as megatron activation recompute (verl's megatron settings)
RECOMPUTE = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}


def recompute_overrides(enable_gradient_checkpointing: bool) -> dict:
    """``model.enable_gradient_checkpointing`` as megatron activation recompute (full granularity, uniform
    method, 1 layer per checkpoint), or nothing when it is off."""
    return dict(RECOMPUTE) if enable_gradient_checkpointing else {}


def engine_model_overrides(model, megatron) -> dict:
    """The ``EngineConfig.model_overrides`` of one role: activation recompute from
    ``model.enable_gradient_checkpointing`` then ``megatron.override_transformer_config`` (which wins)."""
    return {**recompute_overrides(model.enable_gradient_checkpointing),
            **dict(megatron.override_transformer_config or {})}


def engine_worker_fields(model, megatron, optim, total_steps: int, seed: int) -> dict:
    """The ``EngineWorkerConfig`` fields of one role from its ``model``, ``megatron`` and ``optim`` sections."""
    return dict(
        model_path=model.path,
        **dataclasses.asdict(parallel_config(megatron)),  # tp, pp, vpp, cp, sequence_parallel, ep, etp, timeout_s
        optim={**{k: getattr(optim, k) for k in vars(optim)}, "betas": tuple(optim.betas),
               "total_steps": max(1, total_steps)},
        calculate_per_token_loss=megatron.calculate_per_token_loss,
        use_distributed_optimizer=megatron.use_distributed_optimizer,
        seed=seed,
        model_overrides=engine_model_overrides(model, megatron),
        params_dtype=megatron.dtype,
        lora=lora_fields(model.lora),
    )


LORA_ENGINE_KEYS = ("rank", "alpha", "dropout", "target_modules", "exclude_modules", "adapter_path")


def lora_fields(lora) -> dict | None:
    """The ``engine.lora.LoraConfig`` fields of a ``model.lora`` section (None when rank is 0: no LoRA).
    ``type`` and ``merge`` state what the engine always does (engine.rules.lora_problems checks them)."""
    if not lora.rank:
        return None
    fields = {k: getattr(lora, k) for k in LORA_ENGINE_KEYS}
    fields.update(target_modules=tuple(_list(lora.target_modules)), exclude_modules=tuple(_list(lora.exclude_modules)))
    return fields


def _list(value) -> list:
    if value is None:
        return []
    return [value] if isinstance(value, str) else [str(v) for v in value]


def actor_worker_config(cfg, total_steps: int, need_ref: bool) -> WorkerConfig:
    """The actor role's ``WorkerConfig`` (engine layout, the colocated ref and rollout)."""
    from verl_lite.rollout import rollout_kwargs

    arr = cfg.actor_rollout_ref
    return WorkerConfig(
        **engine_worker_fields(arr.model, arr.actor.megatron, arr.actor.optim, total_steps, cfg.trainer.seed),
        tokenizer_path=arr.model.tokenizer_path,
        need_ref=need_ref,
        rollout_name=arr.rollout.name,
        rollout_kwargs=rollout_kwargs(arr.rollout, cfg.data.max_prompt_length + cfg.data.max_response_length),
    )


def rollout_worker_config(cfg):
    """The rollout pool's ``RolloutWorkerConfig`` (split placement: the rollout backend alone)."""
    from verl_lite.rollout import rollout_kwargs
    from verl_lite.workers.rollout_worker import RolloutWorkerConfig

    arr = cfg.actor_rollout_ref
    return RolloutWorkerConfig(model_path=arr.model.path, tokenizer_path=arr.model.tokenizer_path,
                               rollout_name=arr.rollout.name,
                               rollout_kwargs=rollout_kwargs(arr.rollout, cfg.data.max_prompt_length +
                                                             cfg.data.max_response_length))


def judge_worker_config(cfg):
    """The generative judge's ``RolloutWorkerConfig``: ``reward_model.model`` behind ``reward_model.rollout``'s backend,
    with room for a prompt of ``prompt_length`` and a judgement of ``response_length`` tokens (vLLM's max_model_len)."""
    from verl_lite.rollout import rollout_kwargs
    from verl_lite.workers.rollout_worker import RolloutWorkerConfig

    rm = cfg.reward_model
    r = rm.rollout
    from types import SimpleNamespace

    backend = SimpleNamespace(**vars(r), tensor_model_parallel_size=1)  # one full judge model (the only TP built)
    return RolloutWorkerConfig(model_path=rm.model.path, tokenizer_path=rm.model.tokenizer_path, rollout_name=r.name,
                               rollout_kwargs=rollout_kwargs(backend, r.prompt_length + r.response_length))


def critic_worker_config(cfg, total_steps: int) -> EngineWorkerConfig:
    """The critic role's ``EngineWorkerConfig``."""
    c = cfg.critic
    return EngineWorkerConfig(**engine_worker_fields(c.model, c.megatron, c.optim, total_steps, cfg.trainer.seed))


def reward_model_worker_config(cfg) -> EngineWorkerConfig:
    """The reward-model role's ``EngineWorkerConfig`` (forward only: no optimizer, no LoRA)."""
    r, m = cfg.reward_model, cfg.reward_model.megatron
    return EngineWorkerConfig(model_path=r.model.path, **dataclasses.asdict(parallel_config(m)), optim={},
                              calculate_per_token_loss=m.calculate_per_token_loss,
                              use_distributed_optimizer=m.use_distributed_optimizer, seed=cfg.trainer.seed,
                              model_overrides=dict(m.override_transformer_config or {}), params_dtype=m.dtype, lora=None)

ACTOR_LOSS_KEYS = ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "loss_agg_mode",
                   "entropy_coeff", "use_kl_loss", "kl_loss_coef", "kl_loss_type")


def _loss_fields(actor) -> dict:
    pl = actor.policy_loss
    return {**{k: getattr(pl, k) for k in vars(pl) if k != "loss_mode"}, **{k: getattr(actor, k) for k in ACTOR_LOSS_KEYS}}


def actor_loss_config(actor=None, **overrides):
    """``algorithms.ActorLossConfig`` from the ``actor_rollout_ref.actor`` section (None: the schema's
    defaults), then ``overrides``."""
    from verl_lite.algorithms import ActorLossConfig
    from verl_lite.config.schema import ActorConfig

    actor = actor if actor is not None else ActorConfig()
    return ActorLossConfig(**{**_loss_fields(actor), "policy_loss": actor.policy_loss.loss_mode, **overrides})


def policy_loss_config(**overrides):
    """``algorithms.PolicyLossConfig`` with the schema's defaults, then ``overrides``."""
    from verl_lite.algorithms import PolicyLossConfig
    from verl_lite.config.schema import ActorConfig

    fields = _loss_fields(ActorConfig())
    return PolicyLossConfig(**{k: fields[k] for k in PolicyLossConfig.__dataclass_fields__} | overrides)


def parallel_config(megatron=None, **overrides):
    """``engine.ParallelConfig`` from a ``megatron`` section (None: the schema's defaults), then ``overrides``."""
    from verl_lite.config.schema import MegatronConfig
    from verl_lite.engine.distributed import ParallelConfig

    m = megatron if megatron is not None else MegatronConfig()
    fields = dict(tp=m.tensor_model_parallel_size, pp=m.pipeline_model_parallel_size,
                  vpp=m.virtual_pipeline_model_parallel_size, cp=m.context_parallel_size,
                  sequence_parallel=m.sequence_parallel, ep=m.expert_model_parallel_size,
                  etp=m.expert_tensor_parallel_size, timeout_s=m.timeout_s)
    return ParallelConfig(**{**fields, **overrides})


def optim_config(optim=None, megatron=None, **overrides):
    """``engine.OptimConfig`` from an ``optim`` and a ``megatron`` section (None: the schema's defaults),
    then ``overrides`` (e.g. ``total_steps``)."""
    from verl_lite.config.schema import MegatronConfig, OptimConfig as OptimSection
    from verl_lite.engine.config import OptimConfig

    o = optim if optim is not None else OptimSection()
    m = megatron if megatron is not None else MegatronConfig()
    fields = {k: getattr(o, k) for k in vars(o)}
    fields.update(betas=tuple(o.betas), use_distributed_optimizer=m.use_distributed_optimizer)
    return OptimConfig(**{**fields, **overrides})


def engine_config(model_path: str, parallel=None, optim=None, **overrides):
    """``engine.EngineConfig`` for ``model_path`` with the schema's defaults (layout, optimizer, seed,
    dtype, per-token loss) for everything ``parallel``, ``optim`` and ``overrides`` do not give."""
    from verl_lite.config.schema import MegatronConfig, TrainerConfig
    from verl_lite.engine.config import EngineConfig

    m = MegatronConfig()
    fields = dict(seed=TrainerConfig().seed, params_dtype=m.dtype, calculate_per_token_loss=m.calculate_per_token_loss)
    forward_only = overrides.get("forward_only", False)
    return EngineConfig(model_path, parallel if parallel is not None else parallel_config(),
                        optim if optim is not None or forward_only else optim_config(), **{**fields, **overrides})
