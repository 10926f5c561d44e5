"""The PPO-family loop on a single controller (verl's step order; its stages: docs/architecture.md).

    trainer = PPOTrainer(cfg)            # validates the config; nothing started yet
    history = trainer.fit()              # starts Ray + role groups, trains, validates, tears down

One RL step (``step``): the rollout source's scored batch -> old log-probs (unless the update's own forward gives
them) -> ref / teacher log-probs, values -> in-reward KL -> advantages -> critic update -> actor update -> the
source's ``after_update`` -> metrics. No formula lives here (``verl_lite.algorithms``); GRPO, GSPO, DAPO, PPO ...
differ only by config.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from verl_lite.agent.metrics import agent_metrics
from verl_lite.agent.preflight import single_turn_rows_warning, agent_spec, enable_for_python_tools
from verl_lite.algorithms import (apply_kl_penalty, compute_advantage, estimator_needs, explained_variance,
                                  get_kl_controller)
from verl_lite.config import validate_config
from verl_lite.config.preflight import check_model_files, preflight
from verl_lite.errors import Problems
from verl_lite.protocol import Batch, response_lengths
from verl_lite.trainer import metrics as M
from verl_lite.trainer import validation
from verl_lite.trainer.api import (check_reward_inputs, load_tokenizer, make_datasets, make_reward,
                                   reward_functions_only, use_api_arguments)
from verl_lite.trainer.callbacks import CallbackList
from verl_lite.trainer.checkpointing import CheckpointManager, DataCursor
from verl_lite.trainer.placement import PlacedRole, Placement
from verl_lite.trainer.rollout_sources import ColocatedRollouts, open_rollout_source
from verl_lite.trainer.rollout_stage import Rollouts
from verl_lite.trainer.run_lock import lock_checkpoint_dir
from verl_lite.trainer.tracking import COMPLETIONS_KEY
from verl_lite.trainer.training_run import train_in_run_dir
from verl_lite.trainer.trl_args import use_trl_arguments
from verl_lite.trainer.update_stage import Updates, old_log_probs_from_update


class PPOTrainer:
    """The RL loop, and the Python API (docs/python_api.md: the rewards, datasets and TRL's argument names).
    Rewards: ``reward_funcs`` (TRL-style, weighed by ``reward_weights``; a model entry is the reward-model role:
    ``api.use_reward_models``), or ``reward_fn`` in verl's signature, or the configured
    ``reward.custom_reward_function``."""

    # the placement's started roles (None before start() and after close()); reward_model is the driver's scorer
    actor, critic, rollout, reward_model, pool = (PlacedRole() for _ in range(5))

    def __init__(self, cfg, reward_fn: Callable | None = None, world_size: int | None = None,
                 worker_timeout_s: float | None = None, reward_funcs=None, reward_weights=None,
                 train_dataset=None, val_dataset=None, problems=None,
                 model=None, processing_class=None, callbacks=None, generation_kwargs: dict | None = None,
                 log_completions: bool = False, push_to_hub: bool = False, tools=None, interactions=None,
                 eval_dataset=None, peft_config=None, rollout_func=None, environment_factory=None,
                 reward_processing_classes=None, args=None, optimizers=(None, None), quantization_config=None):
        """Pre-flight, before anything starts: every problem of the config (``problems``: what ``load_config``
        found), the model files, the tokenizer, the reward, the agent (``tools`` / ``interactions`` turn on
        multi-turn rollouts, docs/agents.md) and the data, in one error."""
        self.cfg, self.reward_manager, self.agent = cfg, None, None
        if tools or interactions:
            enable_for_python_tools(cfg)
        problems = problems if problems is not None else Problems()
        trl = problems.check(use_trl_arguments, cfg, args, optimizers, quantization_config, reward_weights,
                             generation_kwargs, log_completions, push_to_hub)  # TRL's GRPOConfig: trl_args.py
        reward_weights, generation_kwargs, log_completions, push_to_hub = trl or (
            reward_weights, generation_kwargs, log_completions, push_to_hub)
        self.callbacks, self.log_completions = CallbackList(callbacks), bool(log_completions)
        if eval_dataset is not None:  # TRL's name of the held-out set
            if val_dataset is not None:
                raise ValueError("give val_dataset or eval_dataset (TRL's name of the same thing), not both")
            val_dataset = eval_dataset
        self.generation_kwargs = problems.check(use_api_arguments, cfg, model, processing_class,
                                                dict(generation_kwargs or {}), push_to_hub, peft_config,
                                                reward_funcs, reward_weights, reward_processing_classes,
                                                rollout_func=rollout_func, environment_factory=environment_factory) or {}
        self.layout = problems.check(validate_config, cfg, world_size=world_size)
        # a broken config.json, or a policy path already refused (a hub id that cannot be fetched: the tokenizer's
        # loader would retry the hub for a minute), before the tokenizer reads it
        model_ok = (problems.passes(check_model_files, cfg)
                    and not problems.mentions("actor_rollout_ref.model.path", "actor_rollout_ref.model.tokenizer_path"))
        self.tokenizer = problems.check(load_tokenizer, cfg) if model_ok else None
        if not problems.mentions("reward.custom_reward_function"):
            self.reward_manager = problems.check(make_reward, cfg, self.tokenizer, reward_fn,
                                                 *reward_functions_only(reward_funcs, reward_weights))
        if self.tokenizer is not None and not problems.mentions("multi_turn", "rollout.agent"):
            self.agent = problems.check(agent_spec, cfg, tools, interactions, self.tokenizer)  # AgentSpec or None
        data_ok = self.tokenizer is not None and not problems.mentions("data.train_files", "data.val_files")
        datasets = problems.check(make_datasets, cfg, self.tokenizer, self.agent, train_dataset,
                                  val_dataset) if data_ok else None
        self.train_dataset, self.val_dataset = datasets or (None, None)
        if datasets is not None:
            problems.check(preflight, cfg, *datasets, self.tokenizer)
            if not (problems.lines or problems.errors):  # LR schedules count RL steps: known with the data
                problems.lines += self._schedule_problems()
            if self.reward_manager is not None:
                problems.check(check_reward_inputs, cfg, self.reward_manager, *datasets)
        try:
            problems.raise_if_any()
        except BaseException:
            if self.reward_manager is not None:
                self.reward_manager.close()
            raise
        if (warning := single_turn_rows_warning(self.agent, self.train_dataset)) is not None:
            print(f"verl_lite: warning: {warning}", file=sys.stderr, flush=True)
        self.world_size = self.layout.world_size
        self.estimator_needs = estimator_needs(cfg.algorithm.adv_estimator)
        self.use_critic = "critic" in self.estimator_needs
        self.need_ref = cfg.actor_rollout_ref.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
        self.kl_ctrl = get_kl_controller(**vars(cfg.algorithm.kl_ctrl)) if cfg.algorithm.use_kl_in_reward else None
        self.placement = Placement(cfg, self.layout, worker_timeout_s or cfg.trainer.worker_timeout_s)
        self.rollouts = Rollouts(cfg, self.tokenizer, self.reward_manager, self.agent, self.generation_kwargs,
                                 self.placement)
        self.updates = Updates(cfg, self.placement)
        self.source = ColocatedRollouts(self.rollouts)  # run_loop opens the run's own (open_rollout_source)
        self.resumed_async_state = None  # a checkpoint's in-flight rollout batches (checkpointing.ASYNC_FILE)
        self._checkpoint_lock = None  # trainer.default_local_dir's run lock, held from start() to close()
        self.global_step = 0
        self.update_history: list[list[dict]] = []  # per RL step: the actor's per-optimizer-step results
        self.critic_update_history: list[list[dict]] = []  # the same for the critic
        self.run_dir = None  # set by fit() / the CLI: where the run's files go
        self.final_hf_dir = None
        self.checkpoints = CheckpointManager(cfg, self.train_dataset)  # trainer.save_freq / resume_mode / default_local_dir

    def start(self) -> None:
        """Lock ``trainer.default_local_dir``, check the checkpoint to resume, start Ray and place the roles."""
        if self.actor is not None:
            return
        self._checkpoint_lock = self._checkpoint_lock or lock_checkpoint_dir(self.cfg.trainer)  # before Ray starts
        try:
            self.checkpoints.prepare_resume()  # a damaged or unsafe checkpoint is refused before Ray starts
            # the LR schedules count RL steps (verl's rule: OptimConfig)
            self.placement.start(self.use_critic, self.need_ref, self.total_steps(), self.total_steps(),
                                 self.tokenizer, self.agent)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Stop the rollout source and the placement, release the checkpoint lock (idempotent)."""
        self.source.close()
        self.source = ColocatedRollouts(self.rollouts)
        self.placement.close()
        if self._checkpoint_lock is not None:
            self._checkpoint_lock.release()
            self._checkpoint_lock = None

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc):
        self.close()

    def steps_per_epoch(self) -> int:
        return len(self.train_dataset) // self.cfg.data.train_batch_size

    def total_steps(self) -> int:
        t = self.cfg.trainer
        return t.total_training_steps if t.total_training_steps is not None else t.total_epochs * self.steps_per_epoch()

    def _schedule_problems(self) -> list[str]:
        roles = [("actor_rollout_ref.actor.optim", self.cfg.actor_rollout_ref.actor.optim)]
        if "critic" in estimator_needs(self.cfg.algorithm.adv_estimator):
            roles.append(("critic.optim", self.cfg.critic.optim))
        unit = "the run's RL steps"
        return [line for key, optim in roles for line in optim.schedule_problems(key, self.total_steps(), unit)]

    def _train_batches(self) -> DataCursor:
        """Prompt batches (lists of dataset rows) forever, one epoch after another."""
        return self.checkpoints.data_cursor()

    def step(self, batches: Iterator[list[dict]]) -> dict[str, Any]:
        """One RL step; returns its metrics. ``batches``: the data cursor the colocated source samples from
        (a pipeline pulls from the cursor it was opened on)."""
        cfg, step = self.cfg, self.global_step
        m: dict[str, Any] = {"step": step + 1}
        recompute_old = not old_log_probs_from_update(cfg)
        update_actor = step >= cfg.trainer.critic_warmup
        with M.timer(m, "step"):
            with M.timer(m, "generate"):
                batch, scores, reward_extra = self.source.next(step, batches, m)
            if "agent_stats" in batch:  # multi-turn: turns, tool calls / errors / timeouts / latency, token kinds
                m.update(agent_metrics(batch["agent_stats"], batch["turn_scores"]))
            if self.log_completions and self._is_logging_step(step + 1):
                m[COMPLETIONS_KEY] = self._completion_rows(batch, scores, reward_extra)
            mask = batch["response_mask"]
            last = (response_lengths(mask) - 1).clamp(min=0)
            token_scores = torch.zeros_like(mask)
            token_scores[torch.arange(len(batch)), last] = scores
            baselines = None
            if "baseline_rollout" in self.estimator_needs:
                with M.timer(m, "baseline_rollout"):
                    baselines = self.rollouts.greedy_baseline(batch, step)
                m.update(M.stats("remax/baseline_reward", baselines))
            if recompute_old:
                self.updates.old_log_probs_and_correction(batch, m)
            m["actor/old_log_prob_recomputed"] = float(recompute_old and not cfg.algorithm.rollout_correction.bypass_mode)
            if self.need_ref:
                with M.timer(m, "ref_log_prob"):
                    batch.set("ref_log_probs", self.updates.compute_ref_log_probs(batch)["ref_log_probs"])
            if cfg.distillation.enabled:
                with M.timer(m, "teacher_log_prob"):
                    for key, value in self.updates.compute_teacher_log_probs(batch).items():
                        batch.set(key, value)
            values = None
            if self.use_critic:
                with M.timer(m, "values"):
                    values = self.updates.compute_values(batch)
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
                    critic_updates = self.updates.update_critic(batch, step)
                m.update({f"critic/{k}": v for k, v in M.mean_dicts(critic_updates).items()})
                m["critic/explained_variance"] = explained_variance(values, returns, mask)
                m["critic/values_mean"] = M.masked_mean(values, mask)
                m["critic/returns_mean"] = M.masked_mean(returns, mask)
            updates: list[dict] = []
            if update_actor:
                with M.timer(m, "update_actor"):
                    updates = self.updates.update_actor(batch, step)
                self.source.after_update(step, m)  # split placement: the new policy to the pipeline
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

    def validate(self) -> dict[str, float]:
        """Held-out prompts, decoded per ``rollout.val_kwargs`` (greedy by default): mean score and accuracy."""
        return validation.validate(self.rollouts, self.val_dataset, self.global_step, self.run_dir)

    def fit(self, on_step: Callable[[dict], None] | None = None) -> list[dict]:
        """Train, writing the same run directory as the CLI (``training_run``); returns every step's metrics.
        ``on_step(record)`` sees each record as it is logged."""
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
        path = Path(path)
        if self.actor is not None:
            path.mkdir(parents=True, exist_ok=True)
            self.actor.call_all("export_hf_dir", str(path))
            return path
        if self.final_hf_dir is None:
            raise RuntimeError("save_pretrained: nothing trained yet; call fit() first (or start() the trainer)")
        shutil.copytree(self.final_hf_dir, path, dirs_exist_ok=True)
        return path

    def run_loop(self, on_step: Callable[[dict], None] | None = None) -> list[dict]:
        """Train for ``total_steps()`` steps (validation per ``test_freq``); returns every step's metrics. Always
        tears the workers down, after exporting the final policy to ``<run dir>/huggingface`` when one is set."""
        t = self.cfg.trainer
        history: list[dict] = []
        try:
            self.start()
            batches = self.checkpoints.resume(self)  # restores step, data position, RNGs, KL (resume_mode)
            self.source = open_rollout_source(self.rollouts, batches, self.global_step, self.total_steps(),
                                              self.resumed_async_state)
            if t.val_before_train and self.val_dataset is not None:  # no val files: no validation
                with M.timer(record := {"step": self.global_step}, "validate"):
                    record.update(self.validate())
                history.append(record)
                if on_step:
                    on_step(record)
            for _ in range(self.total_steps() - self.global_step):
                record = self.step(batches)
                last = self.global_step == self.total_steps()
                if self.val_dataset is not None and t.test_freq > 0 and (self.global_step % t.test_freq == 0 or last):
                    with M.timer(record, "validate"):
                        record.update(self.validate())
                record.update(self.checkpoints.after_step(self, batches, last))  # save_freq, end of run
                history.append(record)
                if on_step:
                    on_step(record)
                if self.callbacks.stop_requested:  # a transformers callback's control.should_training_stop
                    break
            if self.run_dir is not None:  # keep the trained policy before the workers go
                self.final_hf_dir = self.save_pretrained(self.run_dir / "huggingface")
        finally:
            self.close()
        return history
