"""Where the run's roles live: Ray, one resource pool, and a ``RoleGroup`` per role (the actor with its
rollout and reference, the critic, the reward model or judge, the distillation teacher, and with
``hybrid_engine=false`` a rollout pool of its own on the last bundles: split placement)."""

from __future__ import annotations

import os

from verl_lite.agent.preflight import pickle_user_code_by_value
from verl_lite.controller import MicroBatching, ResourcePool, RoleGroup, start_ray, start_roles, stop_ray
from verl_lite.reward.judge import JudgeReward
from verl_lite.reward.model_reward import ModelReward
from verl_lite.workers import ActorRolloutRefWorker, CriticWorker
from verl_lite.workers.from_config import (actor_worker_config, critic_worker_config, judge_worker_config,
                                           reward_model_worker_config, rollout_worker_config, teacher_worker_config)
from verl_lite.workers.reward_model import RewardModelWorker
from verl_lite.workers.rollout_worker import RolloutWorker
from verl_lite.workers.teacher import TeacherWorker


def rollout_world_size(cfg) -> int:
    """Rollout workers of their own (``hybrid_engine=false``: rollout.n_gpus_per_node x rollout.nnodes); 0 colocated."""
    r = cfg.actor_rollout_ref
    return 0 if r.hybrid_engine else r.rollout.n_gpus_per_node * r.rollout.nnodes


class Placement:
    """The started roles of one run: ``actor``, ``critic``, ``reward_model`` (the driver's scorer over its
    role), ``teacher`` (distillation), ``rollout`` (split placement's pool) and their ``pool``; each None until
    ``start`` (or when the run has none) and again after ``close``."""

    def __init__(self, cfg, layout, worker_timeout_s: float):
        self.cfg, self.layout, self.worker_timeout_s = cfg, layout, worker_timeout_s
        self.actor = self.critic = self.rollout = self.reward_model = self.teacher = self.pool = None
        self._owns_ray = False

    def start(self, use_critic: bool, need_ref: bool, actor_steps: int, critic_steps: int, tokenizer, agent) -> None:
        """Start (or join) Ray, place the roles, build engines and rollouts (``*_steps``: each role's optimizer
        steps over the run, for its LR schedule). ``agent`` (an AgentSpec or None): every role that samples
        builds its agent runner. On failure everything started is closed."""
        try:
            self._owns_ray = start_ray(num_cpus=os.cpu_count() or 1)
            self._place(use_critic, need_ref, actor_steps, critic_steps, tokenizer)
            if agent is not None:  # multi-turn rollouts: each sampling worker builds its agent runner (tools, loops)
                pickle_user_code_by_value(agent)
                for role in (self.actor, self.rollout):
                    if role is not None:
                        role.call_all("init_agent", agent)
        except BaseException:
            self.close()
            raise

    def _place(self, use_critic: bool, need_ref: bool, actor_steps: int, critic_steps: int, tokenizer) -> None:
        cfg, world = self.cfg, self.layout.world_size
        c = cfg.critic
        separate = use_critic and c.num_workers is not None
        split = rollout_world_size(cfg)  # hybrid_engine=false: rollout workers on bundles of their own, last
        teacher, tm = cfg.distillation.enabled, cfg.distillation.teacher_model
        own_teacher = teacher and tm.enable_resource_pool  # its bundles after the actor's and a critic's own
        critic_bundles = self.layout.critic_world_size if separate else 0
        self.pool = ResourcePool(world + critic_bundles + (tm.world(world) if own_teacher else 0) + split,
                                 nnodes=cfg.trainer.nnodes)  # per node, ranks node by node
        colocated_share = 1.0 / (1 + (use_critic and not separate) + cfg.reward_model.enable
                                 + (teacher and not own_teacher))
        self.actor = self._engine_role("actor", ActorRolloutRefWorker, world,
                                       actor_worker_config(cfg, actor_steps, need_ref),
                                       cfg.actor_rollout_ref.actor.megatron, share=colocated_share)
        if use_critic:
            self.critic = self._engine_role("critic", CriticWorker, self.layout.critic_world_size,
                                            critic_worker_config(cfg, critic_steps), c.megatron,
                                            bundle_offset=world if separate else 0, share=colocated_share)
        # the reward model and the teacher: colocated on the actor's workers (the teacher: or its own), each in a
        # layout of its own
        if cfg.reward_model.enable:
            self.reward_model = self._reward_model(colocated_share, tokenizer)
        if teacher:
            placed = dict(bundle_offset=world + critic_bundles, share=1.0) if own_teacher else \
                dict(share=colocated_share)
            self.teacher = self._engine_role("teacher", TeacherWorker, tm.world(world), teacher_worker_config(cfg),
                                             tm.megatron, **placed)
        if split:
            # the trainer's roles are the critical path (they never wait on a rollout running ahead) and keep
            # the cores; the rollout pool, idle between policy versions, takes its share of them
            self.rollout = RoleGroup("rollout", RolloutWorker, split, rollout_worker_config(cfg), self.pool,
                                     self.worker_timeout_s, bundle_offset=self.pool.world_size - split,
                                     concurrent_ranks=world + split)
        start_roles(self.actor, self.critic, self.reward_model and self.reward_model.group, self.teacher, self.rollout)

    def _engine_role(self, name: str, worker, world: int, config, megatron, **placed) -> RoleGroup:
        """``world`` engine workers of ``name`` in the ``megatron`` section's layout (its CP and virtual-PP sizes)."""
        vpp_multiple = megatron.pipeline_model_parallel_size if megatron.vpp else 1
        return RoleGroup(name, worker, world, config, self.pool, self.worker_timeout_s,
                         cp=megatron.context_parallel_size, vpp_multiple=vpp_multiple, **placed)

    def _reward_model(self, share: float, tokenizer):
        """The reward-model role and the driver's scorer over it: the discriminative RM on the engine
        (verl_lite.reward.model_reward), or with ``reward_model.generative`` the judge, one rollout worker of its
        own next to the actor's rank 0 (verl_lite.reward.judge)."""
        from transformers import AutoTokenizer

        rm = self.cfg.reward_model
        if rm.generative:
            group = RoleGroup("reward_model", RolloutWorker, 1, judge_worker_config(self.cfg), self.pool,
                              self.worker_timeout_s, share=share)
            return JudgeReward(group, tokenizer, AutoTokenizer.from_pretrained(rm.model.tokenizer_path), rm)
        group = self._engine_role("reward_model", RewardModelWorker, self.layout.world_size,
                                  reward_model_worker_config(self.cfg), rm.megatron, share=share)
        return ModelReward(group, tokenizer, AutoTokenizer.from_pretrained(rm.model.tokenizer_path),
                           MicroBatching(micro_batch_size=rm.micro_batch_size_per_gpu))

    def close(self) -> None:
        """Kill every role's workers and stop Ray if this placement started it (idempotent)."""
        for role in (self.rollout, self.actor, self.critic, self.reward_model and self.reward_model.group,
                     self.teacher):
            if role is not None:
                role.shutdown()
        self.actor = self.critic = self.rollout = self.reward_model = self.teacher = None
        if self.pool is not None:
            self.pool.remove()
            self.pool = None
        if self._owns_ray:
            stop_ray()
            self._owns_ray = False


class PlacedRole:
    """``trainer.actor`` (and critic, rollout, reward_model, pool): the placement's attribute of that name,
    settable, so a trainer can be handed roles another one started."""

    def __set_name__(self, owner, name: str):
        self.name = name

    def __get__(self, trainer, owner=None):
        return self if trainer is None else getattr(trainer.placement, self.name)

    def __set__(self, trainer, value):
        setattr(trainer.placement, self.name, value)
