"""The PPO-family loop on a single controller (verl's step order).

    trainer = PPOTrainer(cfg)            # validates the config; nothing started yet
    history = trainer.fit()              # starts Ray + role groups, trains, validates, tears down

One RL step:
    1. generate      n responses per prompt (uid per prompt); DAPO's dynamic sampling keeps
                     generating until enough prompt groups carry a learning signal
    2. reward        score every response (+ DAPO overlong shaping); the score sits at the
                     response's last valid token; remax also scores one greedy response per prompt
    3. old log-probs the actor recomputes them, unless they provably equal the current policy's
                     (one epoch, one mini-batch, nothing else reads them): then the update takes
                     them from its own forward (``actor/old_log_prob_recomputed`` = 0), and so does
                     an off-policy step's rollout correction (its weights and metrics)
    4. ref log-probs when the KL loss or the in-reward KL needs them
    5. values        the critic's values, when the estimator needs a critic (gae)
    6. KL in reward  (optional) token_level_rewards = scores - beta * KL
    7. advantages    on the driver (algorithms.compute_advantage)
    8. critic update for each critic epoch and mini-batch: one optimizer step (clipped value loss)
    9. actor update  for each epoch and mini-batch: the driver builds the NormalizationPlan from
                     the WHOLE mini-batch (and clip_cov/kl_cov's token selection), the actor
                     role plans micro-batches per DP rank, the workers take one optimizer step
   10. weight sync   actor -> rollout, in process
   11. metrics, validation every test_freq

No formula lives here: the math is in ``verl_lite.algorithms``, the data movement in
``verl_lite.controller`` (one ``RoleGroup`` per role, each with its own layout and process
group). GRPO, GSPO, DAPO, PPO ... differ only by config.
"""

from __future__ import annotations

import math
import os
import random
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from verl_lite.agent.loop import agent_rows
from verl_lite.agent.metrics import agent_metrics, tool_call_rate
from verl_lite.agent.preflight import agent_spec, enable_for_python_tools, pickle_user_code_by_value
from verl_lite.algorithms import (
    LOSS_NEEDS,
    NormalizationPlan,
    apply_kl_penalty,
    compute_advantage,
    estimator_needs,
    explained_variance,
    get_kl_controller,
    groups_with_signal,
    overlong_penalty,
    rollout_correction,
    select_cov_tokens,
    truncated_is_weights,
)
from verl_lite.config import validate_config
from verl_lite.config.loader import ConfigError, Problems, names_follow, use_train_data
from verl_lite.config.preflight import check_model_files, preflight
from verl_lite.controller import MicroBatching, ResourcePool, RoleGroup, start_ray, start_roles, stop_ray
from verl_lite.controller.pipeline import PipelineError, RolloutPipeline
from verl_lite.controller.wire import wire
from verl_lite.controller.worker_group import WorkerError
from verl_lite.data import RLDataset, iterate_batches
from verl_lite.data.dataset import IN_MEMORY
from verl_lite.engine.engine import NonFiniteStepError
from verl_lite.engine.model_files import resolve_model_dir
from verl_lite.errors import NonFiniteTraining, RunFailure
from verl_lite.protocol import Batch, response_lengths
from verl_lite.reward import RewardError, RewardManager
from verl_lite.reward.functions import RewardFunctions
from verl_lite.reward.judge import JudgeReward
from verl_lite.reward.model_reward import ModelReward, combine_scores
from verl_lite.reward.config import judge_input_problems, reward_input_problems
from verl_lite.rollout.config import CONFIG_SAMPLING_KWARGS, generation_kwargs_problems
from verl_lite.trainer import metrics as M
from verl_lite.trainer.callbacks import CallbackList
from verl_lite.trainer.checkpointing import CheckpointManager
from verl_lite.trainer.run_lock import lock_checkpoint_dir
from verl_lite.trainer.tracking import COMPLETIONS_KEY
from verl_lite.trainer.training_run import train_in_run_dir
from verl_lite.workers import ActorRolloutRefWorker, CriticWorker
from verl_lite.workers.from_config import (
    actor_worker_config,
    critic_worker_config,
    judge_worker_config,
    reward_model_worker_config,
    rollout_worker_config,
)
from verl_lite.workers.reward_model import RewardModelWorker
from verl_lite.workers.rollout_worker import RolloutWorker

ROLLOUT_COLUMNS = ["prompt_ids", "responses", "response_mask"]


class DynamicSamplingError(RunFailure):
    """DAPO's dynamic sampling hit ``algorithm.filter_groups.max_num_gen_batches``."""


def _use_model(cfg, model, processing_class) -> None:
    """``model=`` / ``processing_class=`` of the Python API into ``actor_rollout_ref.model.path`` /
    ``tokenizer_path`` (and the critic's, where they followed the actor's). A model or tokenizer
    object is saved (``save_pretrained``) into a fresh ``<trainer.output_dir>/api_model-<time>/`` and
    used from there, since every worker loads the model from a directory."""
    import time

    m, critic = cfg.actor_rollout_ref.model, cfg.critic.model
    old = (m.path, m.tokenizer_path)
    saved = None

    def save(obj) -> str:
        nonlocal saved
        if saved is None:
            saved = Path(cfg.trainer.output_dir) / f"api_model-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
            saved.mkdir(parents=True, exist_ok=True)
        obj.save_pretrained(saved)
        return str(saved)

    if model is not None:
        with names_follow(cfg):  # a run name derived from the model follows it
            m.path = save(model) if hasattr(model, "save_pretrained") else resolve_model_dir(str(model))
        m.tokenizer_path = m.path
        if processing_class is None and hasattr(model, "save_pretrained"):
            source = getattr(model, "name_or_path", None)
            if not source or not Path(source, "tokenizer_config.json").is_file():
                raise ConfigError([f"model= is a model object whose tokenizer cannot be found (name_or_path="
                                   f"{source!r}); pass processing_class=<its tokenizer>"])
            m.tokenizer_path = source
    if processing_class is not None:
        m.tokenizer_path = save(processing_class) if hasattr(processing_class, "save_pretrained") \
            else resolve_model_dir(str(processing_class))
    if critic.path in old:
        critic.path = m.path
    if critic.tokenizer_path in old:
        critic.tokenizer_path = m.tokenizer_path


def _vpp_multiple(mg) -> int:
    return mg.pipeline_model_parallel_size if mg.virtual_pipeline_model_parallel_size else 1


class PPOTrainer:
    """The RL loop, and the Python API.

        trainer = PPOTrainer(cfg, reward_funcs=[f, g], reward_weights=[1.0, 0.5],
                             train_dataset=rows, val_dataset=held_out)
        trainer.fit()                      # writes the run directory, as the CLI does
        trainer.save_pretrained("out/")    # the trained policy as an HF model directory

    Rewards, one of:
    - ``reward_funcs``: TRL-style batched functions (optionally async) that take keyword
      arguments (``prompts``, ``completions``, ``ground_truth``, ``data_source``, the row's
      ``extra_info`` keys), combined with ``reward_weights``; a single such function over the whole
      batch is the custom reward loop (``verl_lite.reward.functions``);
    - ``reward_fn``: one function in verl's signature, ``reward_fn(data_source, solution_str,
      ground_truth, extra_info) -> float | dict`` (``reward.reward_manager=naive``) or the batched
      ``reward_fn(data_sources, solution_strs, ground_truths, extra_infos) -> list`` (``batch``);
    - neither: the configured ``reward.custom_reward_function`` (or the built-in scorer).
    Datasets: ``train_dataset`` / ``val_dataset`` as a parquet path, a list of dicts or an HF
    ``datasets.Dataset`` (default: ``data.train_files`` / ``data.val_files``).

    TRL's names: ``model`` (a local directory or hub id: ``actor_rollout_ref.model.path``; or a
    ``transformers.PreTrainedModel``, saved under ``trainer.output_dir`` and used from there),
    ``processing_class`` (the tokenizer, saved next to it: ``model.tokenizer_path``), ``callbacks``
    (``verl_lite.trainer.callbacks``), ``generation_kwargs`` (passed to the rollout backend;
    ``temperature``/``top_p``/``top_k`` set the rollout config's keys; what the backend cannot do is
    refused before start: ``verl_lite.rollout.config.GENERATION_KWARGS``), ``log_completions`` (every
    logging step's prompts, completions and rewards as a W&B table / TensorBoard text). ``push_to_hub``
    is refused: nothing here uploads.
    """

    def __init__(self, cfg, reward_fn: Callable | None = None, world_size: int | None = None,
                 worker_timeout_s: float | None = None, reward_funcs=None, reward_weights=None,
                 train_dataset=None, val_dataset=None, problems=None,
                 model=None, processing_class=None, callbacks=None, generation_kwargs: dict | None = None,
                 log_completions: bool = False, push_to_hub: bool = False, tools=None, interactions=None):
        """Pre-flight, before anything starts: every problem of the config (``problems``: the
        ``config.loader.Problems`` that ``load_config`` filled), the model files, the tokenizer, the
        reward and the data, in one error.
        ``tools`` (Python functions) / ``interactions`` (name -> ``verl_lite.agent.Interaction``) turn on
        multi-turn rollouts (docs/agents.md); the agent's files are checked with the rest."""
        self.cfg, self.reward_manager, self.agent = cfg, None, None
        if tools or interactions:
            enable_for_python_tools(cfg)
        problems = problems if problems is not None else Problems()
        self.callbacks, self.log_completions = CallbackList(callbacks), bool(log_completions)
        self.generation_kwargs = problems.check(self._use_api_arguments, model, processing_class,
                                                dict(generation_kwargs or {}), push_to_hub) or {}
        self.layout = problems.check(validate_config, cfg, world_size=world_size)
        # a broken config.json, or a policy path already refused (a hub id that cannot be fetched: the tokenizer's
        # loader would retry the hub for a minute), before the tokenizer reads it
        model_ok = (problems.passes(check_model_files, cfg)
                    and not problems.mentions("actor_rollout_ref.model.path", "actor_rollout_ref.model.tokenizer_path"))
        self.tokenizer = problems.check(self._load_tokenizer) if model_ok else None
        if not problems.mentions("reward.custom_reward_function"):
            self.reward_manager = problems.check(self._make_reward, reward_fn, reward_funcs, reward_weights)
        if self.tokenizer is not None and not problems.mentions("multi_turn", "rollout.agent"):
            self.agent = problems.check(agent_spec, cfg, tools, interactions, self.tokenizer)  # AgentSpec or None
        data_ok = self.tokenizer is not None and not problems.mentions("data.train_files", "data.val_files")
        datasets = problems.check(self._make_datasets, train_dataset, val_dataset) if data_ok else None
        self.train_dataset, self.val_dataset = datasets or (None, None)
        if datasets is not None:
            problems.check(preflight, cfg, *datasets, self.tokenizer)
            if self.reward_manager is not None:
                problems.check(self._check_reward_inputs)
        try:
            problems.raise_if_any()
        except BaseException:
            if self.reward_manager is not None:
                self.reward_manager.close()
            raise
        self.world_size = self.layout.world_size
        arr = cfg.actor_rollout_ref
        self.worker_timeout_s = worker_timeout_s or cfg.trainer.worker_timeout_s
        self.estimator_needs = estimator_needs(cfg.algorithm.adv_estimator)
        self.use_critic = "critic" in self.estimator_needs
        self.need_ref = arr.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
        self.kl_ctrl = get_kl_controller(**vars(cfg.algorithm.kl_ctrl)) if cfg.algorithm.use_kl_in_reward else None
        self.loss_correction = self._correction_in_update()  # the actor's loss: arr.actor with this
        self.actor: RoleGroup | None = None
        self.critic: RoleGroup | None = None
        self.rollout: RoleGroup | None = None  # split placement (hybrid_engine=false): the rollout pool
        self.pipeline = None  # split placement: controller.pipeline.RolloutPipeline, from run_loop's start
        self.resumed_async_state = None  # a checkpoint's in-flight rollout batches (checkpointing.ASYNC_FILE)
        self.reward_model = None  # reward.model_reward.ModelReward (or reward.judge.JudgeReward) with reward_model.enable
        self.pool: ResourcePool | None = None
        self._owns_ray = False
        self._checkpoint_lock = None  # trainer.default_local_dir's run lock, held from start() to close()
        self.global_step = 0
        self.update_history: list[list[dict]] = []  # per RL step: the actor's per-optimizer-step results
        self.critic_update_history: list[list[dict]] = []  # the same for the critic
        self.run_dir = None  # set by fit() / the CLI: where the run's files go
        self.final_hf_dir = None
        self.checkpoints = CheckpointManager(cfg, self.train_dataset)  # trainer.save_freq / resume_mode / default_local_dir

    # ================================================================ set-up / teardown
    def _use_api_arguments(self, model, processing_class, generation_kwargs: dict, push_to_hub: bool) -> dict:
        """TRL's constructor arguments into the config (see the class docstring); returns the
        generation_kwargs the backend receives. Raises ConfigError listing every problem."""
        r = self.cfg.actor_rollout_ref.rollout
        p = generation_kwargs_problems(r.name, generation_kwargs)
        if push_to_hub:
            p.append("push_to_hub=True: uploading to the Hugging Face Hub is not built here (no hub access); "
                     "train, then trainer.save_pretrained(dir) and upload dir with `huggingface-cli upload`")
        if p:
            raise ConfigError(p)
        for key in CONFIG_SAMPLING_KWARGS:
            if key in generation_kwargs:
                setattr(r, key, generation_kwargs.pop(key))
        if model is not None or processing_class is not None:
            _use_model(self.cfg, model, processing_class)
        return generation_kwargs

    def _check_reward_inputs(self) -> None:
        """Every row field the reward needs (``ground_truth``, a column a reward function names) exists."""
        datasets = {"data.train_files": self.train_dataset, "data.val_files": self.val_dataset}
        p = reward_input_problems(self.reward_manager, datasets) + judge_input_problems(self.cfg.reward_model, datasets)
        if p:
            raise ConfigError(p)

    def _load_tokenizer(self):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.cfg.actor_rollout_ref.model.tokenizer_path)

    def _make_reward(self, reward_fn, reward_funcs, reward_weights):
        """TRL-style ``reward_funcs``, or verl's ``reward_fn``, or the configured reward (the tokenizer is
        set once it is loaded)."""
        if reward_funcs is not None and reward_fn is not None:
            raise ValueError("give reward_funcs (TRL-style) or reward_fn (verl's signature), not both")
        if reward_funcs is not None:
            return RewardFunctions(reward_funcs, self.tokenizer, reward_weights,
                                   timeout_s=getattr(self.cfg.reward, "timeout_s", None))
        return RewardManager(self.cfg.reward, self.tokenizer, compute_score=reward_fn)

    def _make_datasets(self, train=None, val=None):
        """From the given sources (Python API), else ``data.train_files`` / ``val_files``; a given
        in-memory source is recorded in the config as ``<in-memory dataset>`` (``loader.use_train_data``: the
        names derived from the data follow a given train set). No val files: no validation set (None)."""
        d = self.cfg.data
        tools = (self.agent.tool_schemas or None) if self.agent is not None else None
        datasets = []
        for key, given in (("train_files", train), ("val_files", val)):
            if given is not None:
                name = str(given) if isinstance(given, (str, os.PathLike)) else IN_MEMORY
                use_train_data(self.cfg, name) if key == "train_files" else setattr(d, key, name)
            files = given if given is not None else getattr(d, key)
            datasets.append(RLDataset.from_config(d, files, self.tokenizer, tools) if given is not None or files else None)
        return tuple(datasets)

    def start(self) -> None:
        """Lock ``trainer.default_local_dir`` (a run that saves; ``run_lock``), start (or join) Ray, place the
        roles, build engines and rollouts."""
        if self.actor is not None:
            return

        self._checkpoint_lock = self._checkpoint_lock or lock_checkpoint_dir(self.cfg.trainer)  # before Ray starts
        try:
            self.checkpoints.prepare_resume()  # a damaged or unsafe checkpoint is refused before Ray starts
        except BaseException:
            self.close()
            raise
        self._owns_ray = start_ray(num_cpus=os.cpu_count() or 1)
        try:
            c = self.cfg.critic
            separate = self.use_critic and c.num_workers is not None
            split = self.rollout_world_size()  # hybrid_engine=false: rollout workers on bundles of their own, last
            self.pool = ResourcePool(self.world_size + (self.layout.critic_world_size if separate else 0) + split,
                                     nnodes=self.cfg.trainer.nnodes)  # per node, ranks node by node
            colocated_share = 1.0 / (1 + (self.use_critic and not separate) + self.cfg.reward_model.enable)
            mg = self.cfg.actor_rollout_ref.actor.megatron
            self.actor = RoleGroup("actor", ActorRolloutRefWorker, self.world_size,
                                   actor_worker_config(self.cfg, self.total_optimizer_steps(), self.need_ref), self.pool,
                                   self.worker_timeout_s, cp=mg.context_parallel_size, vpp_multiple=_vpp_multiple(mg),
                                   share=colocated_share)
            if self.use_critic:
                self.critic = RoleGroup(
                    "critic", CriticWorker, self.layout.critic_world_size,
                    critic_worker_config(self.cfg, self.total_critic_steps()), self.pool,
                    self.worker_timeout_s, cp=c.megatron.context_parallel_size, vpp_multiple=_vpp_multiple(c.megatron),
                    bundle_offset=self.world_size if separate else 0, share=colocated_share)
            if self.cfg.reward_model.enable:  # colocated on the actor's workers, a layout of its own
                self.reward_model = self._start_reward_model(colocated_share)
            if split:
                # the trainer's roles are the critical path (they never wait on a rollout running ahead) and keep
                # the cores; the rollout pool, idle between policy versions, takes its share of them
                self.rollout = RoleGroup("rollout", RolloutWorker, split, rollout_worker_config(self.cfg), self.pool,
                                         self.worker_timeout_s, bundle_offset=self.pool.world_size - split,
                                         concurrent_ranks=self.world_size + split)
            start_roles(self.actor, self.critic, self.reward_model and self.reward_model.group, self.rollout)
            if self.agent is not None:  # multi-turn rollouts: each worker builds its agent runner (tools, loops)

                pickle_user_code_by_value(self.agent)
                self.actor.call_all("init_agent", self.agent)
        except BaseException:
            self.close()
            raise

    def rollout_world_size(self) -> int:
        """Rollout workers of their own (``hybrid_engine=false``: rollout.n_gpus_per_node x rollout.nnodes); 0 colocated."""
        r = self.cfg.actor_rollout_ref
        return 0 if r.hybrid_engine else r.rollout.n_gpus_per_node * r.rollout.nnodes

    def _start_reward_model(self, share: float):
        """The reward-model role and the driver's scorer over it: the discriminative RM on the engine
        (verl_lite.reward.model_reward), or with ``reward_model.generative`` the judge, one rollout worker of its
        own next to the actor's rank 0 (verl_lite.reward.judge)."""
        from transformers import AutoTokenizer

        rm = self.cfg.reward_model
        if rm.generative:
            group = RoleGroup("reward_model", RolloutWorker, 1, judge_worker_config(self.cfg), self.pool,
                              self.worker_timeout_s, share=share)
            return JudgeReward(group, self.tokenizer, AutoTokenizer.from_pretrained(rm.model.tokenizer_path), rm)
        group = RoleGroup("reward_model", RewardModelWorker, self.world_size, reward_model_worker_config(self.cfg),
                          self.pool, self.worker_timeout_s, cp=rm.megatron.context_parallel_size,
                          vpp_multiple=_vpp_multiple(rm.megatron), share=share)
        return ModelReward(group, self.tokenizer, AutoTokenizer.from_pretrained(rm.model.tokenizer_path),
                           MicroBatching(micro_batch_size=rm.micro_batch_size_per_gpu))

    def close(self) -> None:
        """Kill every role's workers and stop Ray if this trainer started it (idempotent)."""
        if self.pipeline is not None:
            self.pipeline.close()
            self.pipeline = None
        if self.rollout is not None:
            self.rollout.shutdown()
            self.rollout = None
        for role in (self.actor, self.critic, self.reward_model and self.reward_model.group):
            if role is not None:
                role.shutdown()
        self.actor = self.critic = self.reward_model = None
        if self.pool is not None:
            self.pool.remove()
            self.pool = None
        if self._owns_ray:
            stop_ray()
            self._owns_ray = False
        if self._checkpoint_lock is not None:
            self._checkpoint_lock.release()
            self._checkpoint_lock = None

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.close()

    # ================================================================ sizes
    def steps_per_epoch(self) -> int:
        return len(self.train_dataset) // self.cfg.data.train_batch_size

    def total_steps(self) -> int:
        t = self.cfg.trainer
        return t.total_training_steps if t.total_training_steps is not None else t.total_epochs * self.steps_per_epoch()

    def total_optimizer_steps(self) -> int:
        return self.total_steps() * self.layout.optimizer_steps_per_rl_step

    def total_critic_steps(self) -> int:
        c = self.cfg.critic
        per_step = self.cfg.data.train_batch_size // c.ppo_mini_batch_size * c.ppo_epochs
        return self.total_steps() * per_step

    def old_log_probs_from_update(self) -> bool:
        """True when the old log-probs provably equal the current policy's at the update: one
        epoch, one mini-batch per step, and nothing before the update reads them (no in-reward
        KL, no clip_cov/kl_cov selection, no tis_imp_ratio_cap). An off-policy step's proximal
        policy is then the update's own forward too, and its rollout correction is computed there."""
        a = self.cfg.actor_rollout_ref.actor
        return (a.ppo_epochs == 1 and a.ppo_mini_batch_size == self.cfg.data.train_batch_size
                and not self.cfg.algorithm.use_kl_in_reward and not LOSS_NEEDS[a.policy_loss.loss_mode]
                and a.tis_imp_ratio_cap <= 0)

    def _correction_in_update(self) -> dict | None:
        """``algorithm.rollout_correction``'s settings for the actor's loss, where an off-policy step takes its
        old log-probs from the update's forward (``actor_loss``'s ``correction``); else None."""
        return self._correction_settings() if self.off_policy() and self.old_log_probs_from_update() else None

    def _correction_settings(self) -> dict:
        """``algorithm.rollout_correction`` as ``algorithms.rollout_correction``'s keyword arguments."""
        rc = self.cfg.algorithm.rollout_correction
        return {k: getattr(rc, k) for k in ("rollout_is", "rollout_is_threshold", "rollout_rs", "rollout_rs_threshold",
                                            "rollout_rs_threshold_lower")}

    def off_policy(self) -> bool:
        """Whether the behaviour policy may differ from the policy at the update: a staleness bound > 0 (the
        old log-probs are then the proximal policy recomputed by the trainer, decoupled PPO) or a rollout
        correction asked for (its ratio needs them)."""
        rc = self.cfg.algorithm.rollout_correction
        return (self.cfg.async_training.staleness_threshold > 0 or rc.rollout_is is not None
                or rc.rollout_rs is not None)

    # micro-batching of each role's passes (config sections in verl's names)
    def _actor_update_sizing(self) -> MicroBatching:
        a = self.cfg.actor_rollout_ref.actor
        return MicroBatching.of(a.use_dynamic_bsz, a.ppo_micro_batch_size_per_gpu, a.ppo_max_token_len_per_gpu)

    def _log_prob_sizing(self, section) -> MicroBatching:
        """``section`` holds ``log_prob_*`` keys (rollout: old log-probs, ref)."""
        return MicroBatching.of(section.log_prob_use_dynamic_bsz, section.log_prob_micro_batch_size_per_gpu,
                                section.log_prob_max_token_len_per_gpu)

    def _critic_sizing(self, forward: bool) -> MicroBatching:
        c = self.cfg.critic
        if forward:
            return MicroBatching.of(c.use_dynamic_bsz, c.forward_micro_batch_size_per_gpu,
                                    c.forward_max_token_len_per_gpu)
        return MicroBatching.of(c.use_dynamic_bsz, c.ppo_micro_batch_size_per_gpu, c.ppo_max_token_len_per_gpu)

    # ================================================================ data
    def _train_batches(self) -> Iterator[list[dict]]:
        """Prompt batches (lists of dataset rows) forever, one epoch after another."""
        d = self.cfg.data
        epoch = 0
        while True:
            yield from iterate_batches(self.train_dataset, d.train_batch_size, d.shuffle, d.seed, epoch)
            epoch += 1

    # ================================================================ stages
    def generate(self, rows: list[dict], n: int, sampling: dict, seed: int | None, uid_prefix: str = "",
                 role: RoleGroup | None = None, step: int | None = None) -> Batch:
        """n responses per prompt, prompts split over all actor workers (each holds a full rollout
        model). With a seed, prompt p is sampled with its own seed ``seed + p``, so the rollouts do
        not depend on the layout. Trajectory p * n + k is sample k of prompt p."""
        prompts = [list(r["prompt_ids"]) for r in rows]
        seeds = None if seed is None else [seed + p for p in range(len(prompts))]
        if self.agent is not None:  # multi-turn: the workers' agent loops (verl_lite.agent.loop)

            outs = self.actor.generate(agent_rows(rows), seeds, dict(sampling, n=n), method="generate_agent")
        else:
            outs = (role or self.actor).generate(prompts, seeds, dict(sampling, n=n))
        width = max(len(o["response_ids"]) for o in outs)
        num = len(outs)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        responses = torch.full((num, width), pad, dtype=torch.long)
        mask = torch.zeros((num, width), dtype=torch.float32)
        rollout_lp = torch.zeros((num, width), dtype=torch.float32)
        for i, o in enumerate(outs):
            k = len(o["response_ids"])
            responses[i, :k] = torch.as_tensor(o["response_ids"], dtype=torch.long)
            mask[i, :k] = torch.as_tensor(o["response_mask"], dtype=torch.float32) if "response_mask" in o else 1.0
            rollout_lp[i, :k] = torch.as_tensor(o["log_probs"], dtype=torch.float32)

        def repeat(values):
            return [v for v in values for _ in range(n)]

        agent = {k: [o[k] for o in outs] for k in ("agent_stats", "turn_scores")} if self.agent is not None else {}
        return Batch.from_dict(
            {"responses": responses, "response_mask": mask, "rollout_log_probs": rollout_lp},
            {
                "prompt_ids": repeat(prompts),
                "uid": repeat([f"{self.global_step if step is None else step}-{uid_prefix}{p}" for p in range(len(rows))]),
                "data_source": repeat([r["data_source"] for r in rows]),
                "ground_truth": repeat([r["ground_truth"] for r in rows]),
                "extra_info": repeat([r.get("extra_info") for r in rows]),
                "messages": repeat([r.get("messages") for r in rows]),  # the prompt as chat (a reward model re-renders it)
                **agent,  # multi-turn: per-trajectory stats and the interactions' per-turn rewards
            },
        )

    def score(self, batch: Batch) -> tuple[torch.Tensor, dict]:
        """Scores [n] of the responses (the reward manager decodes them and names the function and
        the sample in any RewardError: a raise, a non-number, NaN/inf, or a wrong count)."""
        lengths = response_lengths(batch["response_mask"]).tolist()
        responses = [batch["responses"][i, :k].tolist() for i, k in enumerate(lengths)]
        kwargs = {"prompts": batch["prompt_ids"]} if hasattr(self.reward_manager, "names") else {}
        scores, extra = self.reward_manager(responses, batch["data_source"], batch["ground_truth"],
                                            batch["extra_info"], **kwargs)
        if "turn_scores" in batch:  # multi-turn: the interactions' per-turn rewards add to the score
            scores = scores + torch.tensor([float(sum(t)) for t in batch["turn_scores"]], dtype=scores.dtype)
        if scores.numel() != len(batch):  # the manager checks this too; never train on misaligned rewards
            raise RewardError(f"reward returned {scores.numel()} scores for {len(batch)} responses")
        return scores.float(), extra

    def training_scores(self, batch: Batch, m: dict) -> tuple[torch.Tensor, dict]:
        """The reward function's scores, or with ``reward_model.enable`` the RM's (or the judge's) score
        (+ rule_reward_weight x the function's; weight 0: the function is not called). Validation always uses
        :meth:`score`."""
        if self.reward_model is None:
            return self.score(batch)

        rm_scores, rm_metrics = self.reward_model.score(batch, self.rollout_seed(self.global_step))
        m.update(rm_metrics)
        m.update(M.stats("reward/model_score", rm_scores))
        weight = self.cfg.reward_model.rule_reward_weight
        rule, extra = self.score(batch) if weight != 0 else (None, {})
        return combine_scores(rm_scores, rule, weight), extra

    def shaped_scores(self, batch: Batch, m: dict) -> tuple[torch.Tensor, dict]:
        """Training scores plus DAPO's overlong penalty when ``reward.overlong_buffer.enable``."""
        scores, extra = self.training_scores(batch, m)
        for name in getattr(self.reward_manager, "names", ()):  # each reward function of the Python API
            m[f"reward/{name}/mean"] = float(torch.tensor(extra[name], dtype=torch.float64).mean())
        ob = self.cfg.reward.overlong_buffer
        if ob.enable:
            penalty = overlong_penalty(response_lengths(batch["response_mask"]), self.cfg.data.max_response_length,
                                       ob.len, ob.penalty_factor).float()
            scores = scores + penalty
            m["reward/overlong_penalty_mean"] = float(penalty.mean())
            m["reward/overlong_fraction"] = float((penalty < 0).float().mean())
        return scores, extra

    def generate_and_score(self, rows: list[dict], more_rows: Callable[[], list[dict]] | None,
                           m: dict) -> tuple[Batch, torch.Tensor, dict]:
        """Rollouts and scores of one step. With ``algorithm.filter_groups.enable`` (DAPO dynamic
        sampling) groups without spread in their metric are dropped and ``more_rows()`` supplies
        further prompts until ``data.train_batch_size`` groups remain (at most
        ``filter_groups.max_num_gen_batches`` rounds)."""
        cfg, r = self.cfg, self.cfg.actor_rollout_ref.rollout
        sampling, base_seed = self.training_sampling(), self.rollout_seed(self.global_step)
        fg = cfg.algorithm.filter_groups
        if not fg.enable:
            batch = self.generate(rows, r.n, sampling, base_seed)
            scores, extra = self.shaped_scores(batch, m)
            return batch, scores, extra
        kept: list[tuple[Batch, torch.Tensor, dict]] = []
        num_groups = dropped = 0
        for round_index in range(fg.max_num_gen_batches):
            if round_index > 0:
                rows = more_rows() if more_rows is not None else rows
            seed = base_seed + round_index * 100_003
            batch = self.generate(rows, r.n, sampling, seed, uid_prefix=f"r{round_index}-")
            scores, extra = self.shaped_scores(batch, m)
            metric = self.correct(scores, extra).float() if fg.metric == "acc" else scores
            keep_uids = set(groups_with_signal(metric.tolist(), batch["uid"]))
            dropped += len(rows) - len(keep_uids)
            keep = [i for i, uid in enumerate(batch["uid"]) if uid in keep_uids]
            if keep:
                kept.append((batch.select(keep), scores[keep], {k: [v[i] for i in keep] for k, v in extra.items()}))
            num_groups += len(keep_uids)
            if num_groups >= cfg.data.train_batch_size:
                break
        else:
            raise DynamicSamplingError(
                f"dynamic sampling (algorithm.filter_groups) found only {num_groups} of {cfg.data.train_batch_size} "
                f"prompt groups with a non-constant {fg.metric!r} in {fg.max_num_gen_batches} generation rounds at "
                f"step {self.global_step + 1}; raise algorithm.filter_groups.max_num_gen_batches, or check the "
                f"reward (every sample of most prompts scores the same)")
        batch = Batch.concat([b for b, _, _ in kept]).select(range(cfg.data.train_batch_size * r.n))
        scores = torch.cat([s for _, s, _ in kept])[: len(batch)]
        extra = {k: [v for _, _, e in kept for v in e[k]][: len(batch)] for k in kept[0][2]}
        m["dynamic_sampling/groups_dropped"] = dropped
        m["dynamic_sampling/generation_rounds"] = round_index + 1
        return batch, scores, extra

    def training_sampling(self) -> dict:
        r = self.cfg.actor_rollout_ref.rollout
        return dict(do_sample=True, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                    max_new_tokens=self.cfg.data.max_response_length, **self.generation_kwargs)

    def rollout_seed(self, step: int) -> int:
        """The sampling seed of the rollouts RL step ``step`` (0-based) trains on."""
        return (self.cfg.trainer.seed * 1_000_003 + step * 10_007) % (2**31 - 2**20)

    def generate_for_pipeline(self, rows: list[dict], step: int) -> Batch:
        """Split placement: the rollouts of RL step ``step`` on the rollout pool (the pipeline's thread calls it)."""
        return self.generate(rows, self.cfg.actor_rollout_ref.rollout.n, self.training_sampling(),
                             self.rollout_seed(step), role=self.rollout, step=step)

    def greedy_baseline(self, rows: list[dict], n: int) -> torch.Tensor:
        """remax: the score of one greedy response per prompt, repeated for its n samples."""
        r = self.cfg.actor_rollout_ref.rollout
        sampling = dict(do_sample=False, temperature=r.temperature, top_p=1.0, top_k=-1,
                        max_new_tokens=self.cfg.data.max_response_length, **self.generation_kwargs)
        greedy = self.generate(rows, 1, sampling, seed=None, uid_prefix="greedy-")
        scores, _ = self.shaped_scores(greedy, {})
        return scores.repeat_interleave(n)

    def compute_old_log_probs(self, batch: Batch) -> dict:
        return self.actor.infer("compute_log_prob", batch.columns(ROLLOUT_COLUMNS),
                                self._log_prob_sizing(self.cfg.actor_rollout_ref.rollout),
                                self.cfg.actor_rollout_ref.rollout.temperature)

    def compute_ref_log_probs(self, batch: Batch) -> dict:
        return self.actor.infer("compute_ref_log_prob", batch.columns(ROLLOUT_COLUMNS),
                                self._log_prob_sizing(self.cfg.actor_rollout_ref.ref),
                                self.cfg.actor_rollout_ref.rollout.temperature)

    def compute_values(self, batch: Batch) -> torch.Tensor:
        return self.critic.infer("compute_values", batch.columns(ROLLOUT_COLUMNS), self._critic_sizing(True))["values"]

    def _mini_batch_rows(self, num_trajectories: int, prompts_per_mini_batch: int, shuffle: bool,
                         epoch: int, salt: int) -> list[list[int]]:
        size = prompts_per_mini_batch * self.cfg.actor_rollout_ref.rollout.n
        order = list(range(num_trajectories))
        if shuffle:
            random.Random(self.cfg.trainer.seed * 7919 + self.global_step * 104729 + epoch + salt).shuffle(order)
        return [order[k:k + size] for k in range(0, num_trajectories, size)]

    def mini_batches(self, num_trajectories: int, epoch: int) -> list[list[int]]:
        """Trajectory indices of each actor mini-batch of one epoch (whole prompt groups unless shuffled)."""
        a = self.cfg.actor_rollout_ref.actor
        return self._mini_batch_rows(num_trajectories, a.ppo_mini_batch_size, a.shuffle, epoch, salt=0)

    def _plans(self, batch: Batch, keys: list[str], rows_per_epoch, epochs: int, mode: str, horizon: float,
               role: str) -> list[tuple[Batch, NormalizationPlan]]:
        """(mini-batch, NormalizationPlan of the WHOLE mini-batch) for every optimizer step, in order.
        A mini-batch with no valid token (N = 0) is rejected here, before any dispatch."""
        out = []
        for epoch in range(epochs):
            for k, rows in enumerate(rows_per_epoch(epoch)):
                mini = batch.select(rows).columns(keys)
                if not bool((mini["response_mask"] != 0).any()):
                    raise ValueError(
                        f"{role} mini-batch {k} of epoch {epoch} at step {self.global_step} has no valid response "
                        f"token (N = 0): the loss is undefined; check the rollout (max_response_length) and the data"
                    )
                out.append((mini, NormalizationPlan.from_mask(mini["response_mask"], mode, horizon=horizon)))
        return out

    def update_actor(self, batch: Batch) -> list[dict]:
        """ppo_epochs x mini-batches optimizer steps; returns per-step results merged over DP."""
        a = self.cfg.actor_rollout_ref.actor
        wanted = ("old_log_probs", "ref_log_probs", "is_weights") + (
            ("rollout_log_probs",) if self.loss_correction is not None else ())
        keys = ROLLOUT_COLUMNS + ["advantages"] + [k for k in wanted if k in batch]
        plans = self._plans(batch, keys, lambda epoch: self.mini_batches(len(batch), epoch), a.ppo_epochs,
                            a.loss_agg_mode, a.loss_scale_factor, "actor")
        if LOSS_NEEDS[a.policy_loss.loss_mode] & {"cov_mask"}:
            return self._update_actor_with_cov_selection(plans)
        return self._train_role("actor", self.actor, "update_actor", plans, self._actor_update_sizing(), a,
                                self.cfg.actor_rollout_ref.rollout.temperature, self.loss_correction)

    def _update_actor_with_cov_selection(self, plans) -> list[dict]:
        """clip_cov / kl_cov: verl's token selection over each WHOLE mini-batch, from the current policy's
        log-probs (the parameters that mini-batch's optimizer step starts from). The first mini-batch is
        on-policy (its old log-probs are the current ones); each later one gets a no-grad log-prob pass
        right before its step, so these steps go to the workers one mini-batch at a time."""
        a = self.cfg.actor_rollout_ref.actor
        steps: list[dict] = []
        for k, (mini, plan) in enumerate(plans):
            current = mini["old_log_probs"] if k == 0 else self.compute_old_log_probs(mini)["log_probs"]
            selected = select_cov_tokens(a.policy_loss.loss_mode, mini["advantages"], mini["old_log_probs"],
                                         mini["response_mask"], a,
                                         seed=self.cfg.trainer.seed * 65_537 + self.global_step * 131 + k,
                                         log_probs=current)
            steps += self._train_role("actor", self.actor, "update_actor", [(mini.set("cov_mask", selected), plan)],
                                      self._actor_update_sizing(), a,
                                      self.cfg.actor_rollout_ref.rollout.temperature, self.loss_correction)
        return steps

    def update_critic(self, batch: Batch) -> list[dict]:
        """Critic epochs x mini-batches optimizer steps of the clipped value loss."""
        c = self.cfg.critic
        mode = c.loss_agg_mode
        rows = lambda epoch: self._mini_batch_rows(len(batch), c.ppo_mini_batch_size, c.shuffle,  # noqa: E731
                                                   epoch, salt=1)
        plans = self._plans(batch, ROLLOUT_COLUMNS + ["old_values", "returns"], rows, c.ppo_epochs, mode,
                            self.cfg.actor_rollout_ref.actor.loss_scale_factor, "critic")
        return self._train_role("critic", self.critic, "update_critic", plans, self._critic_sizing(False),
                                c.cliprange_value)

    def _train_role(self, role: str, group: RoleGroup, method: str, plans, *args) -> list[dict]:
        """``group.train(method, plans, *args)`` merged per optimizer step. A NaN / inf gradient norm (the
        engine raises it on every rank) or loss (checked here, from the output owners) stops the run
        with :class:`NonFiniteTraining` naming the step and the role."""
        try:
            steps = M.merge_owner_steps(group.train(method, plans, *args))
        except WorkerError as err:
            e = err.__cause__
            if not isinstance(e, NonFiniteStepError):
                raise
            loss = "" if e.loss is None else f" (loss {e.loss})"
            raise self._non_finite(role, f"gradient norm is {e.grad_norm} at its optimizer step {e.optimizer_step}"
                                         f"{loss}") from err
        for k, s in enumerate(steps):
            bad = {key: s[key] for key in ("loss", "grad_norm") if key in s and not math.isfinite(s[key])}
            if bad:
                what = " and ".join(f"{key.replace('_', ' ')} is {v}" for key, v in bad.items())
                raise self._non_finite(role, f"{what} in update {k + 1} of {len(steps)} of this step")
        return steps

    def _non_finite(self, role: str, detail: str) -> NonFiniteTraining:
        section = "actor_rollout_ref.actor" if role == "actor" else "critic"
        return NonFiniteTraining(
            f"step {self.global_step + 1}: the {role}'s {detail}, not finite; the run stopped there (the step is "
            f"not logged, checkpointed or exported)",
            f"check the reward's scale, {section}.optim.lr and the model weights, then resume from the last "
            f"checkpoint")

    def sync_weights(self) -> None:
        """Split placement: the updated policy to the pipeline, which loads it into the rollout pool before the
        first batch that version samples. (Colocated there is nothing to send: each actor worker loads its own
        rollout from its actor before it next samples, ``ActorRolloutRefWorker._catch_up_rollout``, inside the
        step's ``generate``; the step has no fan-out and no ``timing_s/sync_weights`` for it.)"""
        self.pipeline.publish(self.global_step + 1, self.export_rollout_weights())

    def export_rollout_weights(self):
        """Split placement: the actor's weights, once in Ray's object store (an ObjectRef the rollout workers
        resolve), bounded by ``async_training.weight_sync_timeout_s``."""
        import ray

        exported = self._weight_sync(self.actor, f"step {self.global_step + 1}: exporting the actor's weights for "
                                     "the rollout pool", "export_rollout_weights")
        return ray.put(wire(exported[0]))  # tensors as raw bytes, as WorkerGroup.broadcast sends them

    def load_rollout_weights(self, weights, version: int) -> None:
        """Split placement: policy ``version`` into every rollout worker, bounded by ``weight_sync_timeout_s``."""
        self._weight_sync(self.rollout, f"the weight sync of policy version {version} to the rollout pool",
                          "load_weights", weights, version)

    def _weight_sync(self, role: RoleGroup, what: str, method: str, *args) -> list:
        """``role.call_all(method, *args)`` bounded by ``async_training.weight_sync_timeout_s``; a worker's
        failure or the bound passing becomes one PipelineError saying ``what`` did not finish."""
        bound = self.cfg.async_training.weight_sync_timeout_s
        try:
            return role.call_all(method, *args, timeout_s=bound)
        except WorkerError as err:
            raise PipelineError(f"{what} failed or did not finish within async_training.weight_sync_timeout_s="
                                f"{bound:g}s ({err})",
                                "raise async_training.weight_sync_timeout_s, or check the rollout workers") from err

    def start_pipeline(self, batches) -> None:
        """Split placement: the rollout pipeline over the data cursor ``batches`` (resumed: the checkpoint's
        in-flight batches first, and the rollout pool loads the checkpoint's policy)."""
        saved = self.resumed_async_state or {}
        resumed = self.global_step > 0
        self.pipeline = RolloutPipeline(
            self.generate_for_pipeline, self.load_rollout_weights, lambda: next(batches),
            staleness=self.cfg.async_training.staleness_threshold,
            queue_timeout_s=self.cfg.async_training.queue_timeout_s, first_index=self.global_step,
            end_index=self.total_steps(), loaded_version=None if resumed else 0, ready=saved.get("in_flight", []))
        if resumed:
            self.pipeline.publish(self.global_step, self.export_rollout_weights())
        self.pipeline.start()

    def async_checkpoint_state(self) -> dict | None:
        """What a checkpoint of a split-placement run saves beside the model: the policy version and the batches
        generated ahead (they were sampled by older versions, so they are saved rather than regenerated)."""
        if self.pipeline is None:
            return None
        return {"policy_version": self.global_step, "in_flight": self.pipeline.in_flight()}

    # ================================================================ one step
    def step(self, rows: list[dict], more_rows: Callable[[], list[dict]] | None = None,
             rollout=None) -> dict[str, Any]:
        """One RL step on a batch of prompt rows (``more_rows`` feeds dynamic sampling); returns its metrics.
        ``rollout``: the step's batch from the split-placement pipeline (generated already, tagged with its
        policy version)."""
        cfg, arr = self.cfg, self.cfg.actor_rollout_ref
        m: dict[str, Any] = {"step": self.global_step + 1}
        recompute_old = not self.old_log_probs_from_update()
        update_actor = self.global_step >= cfg.trainer.critic_warmup
        with M.timer(m, "step"):
            with M.timer(m, "generate"):
                if rollout is None:
                    batch, scores, reward_extra = self.generate_and_score(rows, more_rows, m)
                else:  # split placement: generated by the pipeline, scored here
                    batch = rollout.batch
                    scores, reward_extra = self.shaped_scores(batch, m)
                    m.update(rollout.metrics)
            if "agent_stats" in batch:  # multi-turn: turns, tool calls / errors / timeouts / latency, token kinds

                m.update(agent_metrics(batch["agent_stats"], batch["turn_scores"]))
            if self.log_completions and self._is_logging_step(self.global_step + 1):
                m[COMPLETIONS_KEY] = self._completion_rows(batch, scores, reward_extra)
            mask = batch["response_mask"]
            last = (response_lengths(mask) - 1).clamp(min=0)
            token_scores = torch.zeros_like(mask)
            token_scores[torch.arange(len(batch)), last] = scores
            baselines = None
            if "baseline_rollout" in self.estimator_needs:
                with M.timer(m, "baseline_rollout"):
                    baselines = self.greedy_baseline(self._prompt_rows(batch, arr.rollout.n), arr.rollout.n)
                m.update(M.stats("remax/baseline_reward", baselines))
            if recompute_old:
                with M.timer(m, "old_log_prob"):
                    old = self.compute_old_log_probs(batch)
                    batch.set("old_log_probs", old["log_probs"]).set("entropy", old["entropy"])
                # behaviour (rollout) vs old policy: the log-prob gap always; the correction's metrics, and its
                # weights if asked, off-policy (else the update's forward computes them: _correction_in_update);
                # on-policy the settings ask for neither weights nor rejection (off_policy)
                corr = rollout_correction(old["log_probs"], batch["rollout_log_probs"], mask,
                                          **self._correction_settings())
                m.update({k: float(v) for k, v in corr.metrics.items()
                          if self.off_policy() or k.startswith("rollout/logprob_diff")})
                cap = arr.actor.tis_imp_ratio_cap
                if cap > 0:  # rollout/trainer mismatch correction on the policy loss
                    batch.set("is_weights", truncated_is_weights(old["log_probs"], batch["rollout_log_probs"], mask, cap))
                    m["rollout/is_weight_mean"] = M.masked_mean(batch["is_weights"], mask)
                if corr.weights is not None:
                    batch.set("is_weights", corr.weights)
            m["actor/old_log_prob_recomputed"] = float(recompute_old)
            if self.need_ref:
                with M.timer(m, "ref_log_prob"):
                    batch.set("ref_log_probs", self.compute_ref_log_probs(batch)["ref_log_probs"])
            values = None
            if self.use_critic:
                with M.timer(m, "values"):
                    values = self.compute_values(batch)
                    batch.set("old_values", values)
            if cfg.algorithm.use_kl_in_reward:
                token_rewards, kl_metrics = apply_kl_penalty(token_scores, batch["old_log_probs"],
                                                            batch["ref_log_probs"], mask, self.kl_ctrl,
                                                            cfg.algorithm.kl_penalty)
                m.update({f"reward_kl/{k}": v for k, v in kl_metrics.items()})
            else:
                token_rewards = token_scores
            with M.timer(m, "advantage"):
                advantages, returns = compute_advantage(
                    cfg.algorithm.adv_estimator, token_rewards, mask, index=batch["uid"], values=values,
                    reward_baselines=baselines, gamma=cfg.algorithm.gamma, lam=cfg.algorithm.lam,
                    norm_adv_by_std_in_grpo=cfg.algorithm.norm_adv_by_std_in_grpo,
                )
                batch.set("advantages", advantages).set("returns", returns)
            critic_updates: list[dict] = []
            if self.use_critic:
                with M.timer(m, "update_critic"):
                    critic_updates = self.update_critic(batch)
                m.update({f"critic/{k}": v for k, v in M.mean_dicts(critic_updates).items()})
                m["critic/explained_variance"] = explained_variance(values, returns, mask)
                m["critic/values_mean"] = M.masked_mean(values, mask)
                m["critic/returns_mean"] = M.masked_mean(returns, mask)
            updates: list[dict] = []
            if update_actor:
                with M.timer(m, "update_actor"):
                    updates = self.update_actor(batch)
                if self.pipeline is not None:  # colocated: the rollout reloads as it next samples (timing_s/generate)
                    with M.timer(m, "sync_weights"):
                        self.sync_weights()
        self.global_step += 1
        self.update_history.append(updates)
        self.critic_update_history.append(critic_updates)
        m.update(M.stats("reward", scores))
        m["response_length/mean"] = float(response_lengths(mask).float().mean())
        m["advantages/mean"] = M.masked_mean(advantages, mask)
        # loss terms: mean over this step's optimizer steps of each mini-batch's summed contribution
        merged = M.mean_dicts(updates)
        entropy_mean = merged.pop("entropy_token_mean", None)
        m.update({k: merged.pop(k) for k in list(merged) if k.startswith(("rollout_corr/", "rollout/"))})  # in-forward
        m.update({f"actor/{'entropy_term' if k == 'entropy' else k}": v for k, v in merged.items()})
        # token mean over the rollouts (from the old-log-prob pass, or the on-policy update's forward)
        m["actor/entropy"] = M.masked_mean(batch["entropy"], mask) if "entropy" in batch else entropy_mean
        m["actor/num_updates"] = len(updates)
        return m

    def _is_logging_step(self, step: int) -> bool:
        return step % max(1, self.cfg.trainer.log_freq) == 0 or step == self.total_steps()

    def _completion_rows(self, batch: Batch, scores: torch.Tensor, extra: dict) -> list[dict]:
        """``log_completions``: every sample of the step as {prompt, completion, reward, <function>: score}."""
        lengths = response_lengths(batch["response_mask"]).tolist()
        names = list(getattr(self.reward_manager, "names", ()))
        return [{"prompt": self.tokenizer.decode(list(batch["prompt_ids"][i]), skip_special_tokens=False),
                 "completion": self.tokenizer.decode(batch["responses"][i, :k].tolist(), skip_special_tokens=True),
                 "reward": float(scores[i]), **{n: float(extra[n][i]) for n in names if n in extra}}
                for i, k in enumerate(lengths)]

    @staticmethod
    def _prompt_rows(batch: Batch, n: int) -> list[dict]:
        """One row per prompt group of a rollout batch (trajectory p * n is the first sample of prompt p)."""
        return [{"prompt_ids": batch["prompt_ids"][i], "data_source": batch["data_source"][i],
                 "ground_truth": batch["ground_truth"][i], "extra_info": batch["extra_info"][i],
                 "messages": batch["messages"][i]}
                for i in range(0, len(batch), n)]

    # ================================================================ validation
    def validate(self) -> dict[str, float]:
        """Held-out prompts, decoded per ``rollout.val_kwargs`` (greedy by default): mean score and accuracy."""
        vk = self.cfg.actor_rollout_ref.rollout.val_kwargs
        rows = [self.val_dataset[i] for i in range(len(self.val_dataset))]
        size = self.cfg.data.val_batch_size or len(rows)
        sampling = dict(do_sample=vk.do_sample, temperature=vk.temperature, top_p=vk.top_p, top_k=vk.top_k,
                        max_new_tokens=self.cfg.data.max_response_length, **self.generation_kwargs)
        all_scores, all_correct, agent_stats = [], [], []
        for k in range(0, len(rows), size):
            seed = (self.cfg.trainer.seed + 12345 + k) if vk.do_sample else None
            batch = self.generate(rows[k:k + size], vk.n, sampling, seed)
            scores, extra = self.score(batch)
            if k == 0:
                self._log_val_generations(batch, scores)
            all_scores.append(scores)
            all_correct.append(self.correct(scores, extra))
            agent_stats += batch["agent_stats"] if "agent_stats" in batch else []
        scores, correct = torch.cat(all_scores), torch.cat(all_correct)
        out = {"val/reward_mean": float(scores.mean()), "val/accuracy": float(correct.float().mean())}
        if agent_stats:  # multi-turn: how often the policy calls a tool on held-out prompts

            out["val/tool_call_rate"] = tool_call_rate(agent_stats)
        return out

    def _log_val_generations(self, batch: Batch, scores: torch.Tensor) -> None:
        """``trainer.log_val_generations`` = N > 0: the first N validation samples (prompt, response, score)
        of this validation, appended to ``<run dir>/val_generations.jsonl`` (verl logs the same table)."""
        import json
        from pathlib import Path

        n = min(self.cfg.trainer.log_val_generations, len(batch))
        if n <= 0 or getattr(self, "run_dir", None) is None:
            return
        lengths = response_lengths(batch["response_mask"]).tolist()
        with open(Path(self.run_dir) / "val_generations.jsonl", "a") as f:
            for i in range(n):
                f.write(json.dumps({
                    "step": self.global_step,
                    "prompt": self.tokenizer.decode(list(batch["prompt_ids"][i])),
                    "response": self.tokenizer.decode(batch["responses"][i, : int(lengths[i])].tolist()),
                    "score": float(scores[i]),
                }) + "\n")

    @staticmethod
    def correct(scores: torch.Tensor, extra: dict) -> torch.Tensor:
        """Per-sample correctness: the reward's own ``acc`` field when it returns one, else the full score 1.0
        (so shaped rewards with partial credit do not count as correct)."""
        if extra.get("acc") is not None and all(a is not None for a in extra["acc"]):
            return torch.as_tensor([bool(a) for a in extra["acc"]])
        return scores >= 1.0

    # ================================================================ the loop
    def fit(self, on_step: Callable[[dict], None] | None = None) -> list[dict]:
        """Train, writing the same run directory as the CLI (``trainer.output_dir``/<experiment>-<time>:
        metrics.jsonl, the trainer.logger backends, curves.png, summary.json, config.json, and the
        final policy as ``huggingface/``); returns every step's metrics. ``on_step(record)`` sees
        each record as it is logged."""
        history: list[dict] = []

        def record_step(record: dict) -> None:
            history.append(record)
            if on_step is not None:
                on_step(record)
            self.callbacks.dispatch(self, record)  # callbacks=: on_step_end, on_evaluate, on_save, on_log

        try:
            train_in_run_dir(self, on_step=record_step)
        finally:
            self.reward_manager.close()
        return history

    def save_pretrained(self, path) -> Path:
        """The current policy as an HF model directory (safetensors + config + tokenizer) at ``path``:
        exported from the running actor, or, after ``fit()``, the final policy it exported."""
        import shutil

        path = Path(path)
        if self.actor is not None:
            path.mkdir(parents=True, exist_ok=True)
            self.actor.call_all("export_hf_dir", str(path))
            return path
        final = getattr(self, "final_hf_dir", None)
        if final is None:
            raise RuntimeError("save_pretrained: nothing trained yet; call fit() first (or start() the trainer)")
        shutil.copytree(final, path, dirs_exist_ok=True)
        return path

    def run_loop(self, on_step: Callable[[dict], None] | None = None) -> list[dict]:
        """Train for ``total_steps()`` steps (validation per ``test_freq``); returns every step's metrics.
        Writes no files of its own (checkpoints aside); ``fit()`` and the CLI wrap it with the run dir.

        Starts the workers if needed and always tears them down at the end (also on error); before
        that, the final policy is exported to ``<run dir>/huggingface`` when a run dir is set.
        """
        t = self.cfg.trainer
        history: list[dict] = []
        try:
            self.start()
            batches = self.checkpoints.resume(self)  # restores step, data position, RNGs, KL (resume_mode)
            if self.rollout is not None:  # split placement: rollouts come from the pipeline (controller.pipeline)
                self.start_pipeline(batches)
            if t.val_before_train and self.val_dataset is not None:  # no val files: no validation
                with M.timer(record := {"step": self.global_step}, "validate"):
                    record.update(self.validate())
                history.append(record)
                if on_step:
                    on_step(record)
            for _ in range(self.total_steps() - self.global_step):
                if self.pipeline is not None:
                    item = self.pipeline.next(self.global_step)
                    record = self.step(item.rows, rollout=item)
                else:
                    record = self.step(next(batches), more_rows=lambda: next(batches))
                last = self.global_step == self.total_steps()
                if self.val_dataset is not None and t.test_freq > 0 and (self.global_step % t.test_freq == 0 or last):
                    with M.timer(record, "validate"):
                        record.update(self.validate())
                record.update(self.checkpoints.after_step(self, batches, last))  # save_freq, end of run
                history.append(record)
                if on_step:
                    on_step(record)
            if getattr(self, "run_dir", None) is not None:  # keep the trained policy before the workers go
                self.final_hf_dir = self.save_pretrained(self.run_dir / "huggingface")
        finally:
            self.close()
        return history
