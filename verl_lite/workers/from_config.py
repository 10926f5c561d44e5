"""What each role builds from the run config: its sections as they are, composed with what crosses sections."""

from __future__ import annotations

from types import SimpleNamespace

from verl_lite.engine.config import EngineConfig
from verl_lite.workers.actor_rollout_ref import RolloutWorkerConfig, WorkerConfig
from verl_lite.workers.engine_worker import EngineWorkerConfig


def role_engine(model, megatron, seed: int, optim=None, total_steps: int = 1, **role) -> EngineConfig:
    """One role's ``EngineConfig``: its ``model`` section (path, LoRA, gradient checkpointing), ``megatron`` and
    ``optim`` sections, the schedule's length and the run's seed."""
    return EngineConfig(model_path=model.path, megatron=megatron, optim=optim, lora=getattr(model, "lora", None),
                        total_steps=max(1, total_steps), seed=seed,
                        gradient_checkpointing=getattr(model, "enable_gradient_checkpointing", False), **role)


def actor_worker_config(cfg, total_steps: int, need_ref: bool) -> WorkerConfig:
    a = cfg.actor_rollout_ref
    mode = a.actor.router_replay.mode
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    return WorkerConfig(role_engine(a.model, a.actor.megatron, cfg.trainer.seed, a.actor.optim, total_steps,
                                    routing_replay=mode != "disabled",
                                    batch_invariant_length=longest if a.rollout.batch_invariant else 0),
                        need_ref=need_ref, rollout=rollout_worker_config(cfg), router_replay=mode)


def rollout_worker_config(cfg) -> RolloutWorkerConfig:
    """The policy's rollout (colocated with the actor, or split placement's pool), holding a sequence of
    data.max_prompt_length + data.max_response_length tokens."""
    from verl_lite.rollout import rollout_kwargs

    arr, d = cfg.actor_rollout_ref, cfg.data
    return RolloutWorkerConfig(model_path=arr.model.path, tokenizer_path=arr.model.tokenizer_path,
                               rollout_name=arr.rollout.name,
                               rollout_kwargs=rollout_kwargs(arr.rollout, d.max_prompt_length + d.max_response_length),
                               on_engine=_engine_rollout_tokens(arr))


def _engine_rollout_tokens(arr) -> int:
    """0, or with ``rollout.batch_invariant`` the token budget of the engine-generator's forwards: the rollout's
    log-prob budget (null: the actor's ``ppo_max_token_len_per_gpu``)."""
    if not arr.rollout.batch_invariant:
        return 0
    return max(1, int(arr.rollout.log_prob_max_token_len_per_gpu or arr.actor.ppo_max_token_len_per_gpu))


def judge_worker_config(cfg) -> RolloutWorkerConfig:
    """The generative judge's rollout: ``reward_model.model`` behind ``reward_model.rollout``'s backend, with room
    for a prompt of ``prompt_length`` and a judgement of ``response_length`` tokens (vLLM's max_model_len)."""
    from verl_lite.rollout import rollout_kwargs

    rm = cfg.reward_model
    r = rm.rollout
    # one full judge model (the only TP built), recording no routing (nothing replays a judge's)
    backend = SimpleNamespace(**vars(r), tensor_model_parallel_size=1, enable_rollout_routing_replay=False)
    return RolloutWorkerConfig(model_path=rm.model.path, tokenizer_path=rm.model.tokenizer_path, rollout_name=r.name,
                               rollout_kwargs=rollout_kwargs(backend, r.prompt_length + r.response_length))


def critic_worker_config(cfg, total_steps: int) -> EngineWorkerConfig:
    c = cfg.critic
    return EngineWorkerConfig(role_engine(c.model, c.megatron, cfg.trainer.seed, c.optim, total_steps, value_head=True))


def teacher_worker_config(cfg) -> EngineWorkerConfig:
    """The distillation teacher's ``EngineWorkerConfig``: ``distillation.teacher_model`` (its path and megatron
    layout), forward only (no optimizer, no LoRA)."""
    t = cfg.distillation.teacher_model
    return EngineWorkerConfig(role_engine(SimpleNamespace(path=t.model_path), t.megatron, cfg.trainer.seed,
                                          forward_only=True))


def reward_model_worker_config(cfg) -> EngineWorkerConfig:
    """The reward-model role's ``EngineWorkerConfig`` (a value head, forward only: no optimizer, no LoRA)."""
    r = cfg.reward_model
    return EngineWorkerConfig(role_engine(r.model, r.megatron, cfg.trainer.seed, value_head=True, forward_only=True))
