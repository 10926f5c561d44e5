"""The forward passes and optimizer steps of an RL step on the placement's actor and critic (steps 3-9 of
``ppo_trainer``). ``step``: the RL step (0-based); it seeds the shuffles and the token selection
(``utils.seeds``) and names the step in errors."""

from __future__ import annotations

import math
import random

from verl_lite.algorithms import (LOSS_NEEDS, NormalizationPlan, rollout_correction, select_cov_tokens,
                                  truncated_is_weights)
from verl_lite.algorithms.distillation import TEACHER_KEYS, teacher_keys, uses_topk
from verl_lite.controller import MicroBatching, RoleGroup
from verl_lite.controller.worker_group import WorkerError
from verl_lite.engine.engine import NonFiniteStepError
from verl_lite.engine.moe import mismatch_shares
from verl_lite.engine.model_files import read_config
from verl_lite.errors import NonFiniteTraining
from verl_lite.protocol import ROUTED_EXPERTS_KEY, Batch
from verl_lite.trainer import metrics as M
from verl_lite.utils.seeds import cov_selection_seed, shuffle_seed

ROLLOUT_COLUMNS = ["prompt_ids", "responses", "response_mask"]


def old_log_probs_from_update(cfg) -> bool:
    """True when the old log-probs provably equal the current policy's at the update: one epoch, one
    mini-batch per step, and nothing before the update reads them (no in-reward KL, no clip_cov/kl_cov
    selection, no tis_imp_ratio_cap, no rollout correction that needs the whole step first: verl's rejection
    dropping tokens from the loss's mask, batch-normalized IS weights), and not bypass mode (old = the
    rollout's). An off-policy step's rollout correction is then computed there too."""
    a, rc = cfg.actor_rollout_ref.actor, cfg.algorithm.rollout_correction
    return (a.ppo_epochs == 1 and a.ppo_mini_batch_size == cfg.data.train_batch_size
            and not cfg.algorithm.use_kl_in_reward and not LOSS_NEEDS[a.policy_loss.loss_mode]
            and a.tis_imp_ratio_cap <= 0 and not rc.needs_whole_step() and not rc.bypass_mode)


def correction_settings(cfg) -> dict:
    """``algorithm.rollout_correction`` as ``algorithms.rollout_correction``'s keyword arguments."""
    rc = cfg.algorithm.rollout_correction
    return {k: getattr(rc, k) for k in ("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize",
                                        "rollout_rs", "rollout_rs_threshold", "rollout_rs_threshold_lower")}


class Updates:
    """Forward passes and updates of the placement's ``actor`` / ``critic`` (read when called)."""

    def __init__(self, cfg, placement):
        self.cfg, self.placement = cfg, placement
        # ``actor_loss``'s rollout correction: where the old log-probs come from the update's own forward (on-policy:
        # the mismatch metrics only), and always in bypass mode (verl: from the current policy, per micro-batch)
        rc = cfg.algorithm.rollout_correction
        bypass = rc.bypass_mode
        self.loss_correction = ({**correction_settings(cfg), "bypass_mode": bypass, "loss_type": rc.loss_type}
                                if bypass or old_log_probs_from_update(cfg) else None)
        # the ids the student scores: a top-k distillation teacher chooses among these only
        topk = cfg.distillation.enabled and uses_topk(cfg.distillation.distillation_loss.loss_mode)
        student = read_config(cfg.actor_rollout_ref.model.path) if topk else None
        self.student_vocab_size = (student or {}).get("vocab_size")

    def _log_probs(self, method: str, section, batch: Batch, role: RoleGroup | None = None, *args) -> dict:
        """``role``'s (default: the actor's) ``method`` over ``batch`` at the rollout's temperature (then ``args``),
        micro-batched by ``section``'s ``log_prob_*`` keys."""
        sizing = MicroBatching.of(section.log_prob_use_dynamic_bsz, section.log_prob_micro_batch_size_per_gpu,
                                  section.log_prob_max_token_len_per_gpu)
        columns = ROLLOUT_COLUMNS + ([ROUTED_EXPERTS_KEY] if role is None and ROUTED_EXPERTS_KEY in batch else [])
        return (role or self.placement.actor).infer(method, batch.columns(columns), sizing,
                                                    self.cfg.actor_rollout_ref.rollout.temperature, *args)

    def compute_old_log_probs(self, batch: Batch) -> dict:
        return self._log_probs("compute_log_prob", self.cfg.actor_rollout_ref.rollout, batch)

    def compute_ref_log_probs(self, batch: Batch) -> dict:
        return self._log_probs("compute_ref_log_prob", self.cfg.actor_rollout_ref.ref, batch)

    def compute_teacher_log_probs(self, batch: Batch) -> dict:
        """The distillation teacher's pass, micro-batched like the reference's: its log-probs of the sampled tokens
        (``teacher_log_probs``), or for a top-k loss its top-k log-probs and ids among the student's vocabulary."""
        loss = self.cfg.distillation.distillation_loss
        topk = (loss.topk, self.student_vocab_size) if uses_topk(loss.loss_mode) else ()
        return self._log_probs("compute_teacher_log_prob", self.cfg.actor_rollout_ref.ref, batch,
                               self.placement.teacher, *topk)

    def old_log_probs_and_correction(self, batch: Batch, m: dict) -> None:
        """The old policy's log-probs and entropy into ``batch``, and the rollout policy against it: the mismatch
        metrics (log-prob gap, KL, verl's off-policy metrics; with routing replay the routing mismatch) always;
        off-policy the rollout correction's weights; verl's rejection leaves the rejected tokens out of
        ``response_mask``. Bypass mode: the old log-probs are the rollout's (the loss corrects)."""
        if self.cfg.algorithm.rollout_correction.bypass_mode:
            batch.set("old_log_probs", batch["rollout_log_probs"])
            return
        with M.timer(m, "old_log_prob"):
            old = self.compute_old_log_probs(batch)
            batch.set("old_log_probs", old["log_probs"]).set("entropy", old["entropy"])
        if ROUTED_EXPERTS_KEY in old:  # R2: the routing of this pass, for the update to replay
            batch.set(ROUTED_EXPERTS_KEY, old[ROUTED_EXPERTS_KEY])
        if "routing_compared" in old:  # routing replay: how far the trainer's own routing is from the rollout's
            shares = mismatch_shares(old["routing_mismatched"], old["routing_compared"])
            m.update({f"rollout/{name}": share for name, share in shares.items()})
        mask = batch["response_mask"]
        corr = rollout_correction(old["log_probs"], batch["rollout_log_probs"], mask, **correction_settings(self.cfg))
        m.update({k: float(v) for k, v in corr.metrics.items()})  # the gen-vs-train gap, every step it is measured
        cap = self.cfg.actor_rollout_ref.actor.tis_imp_ratio_cap
        if cap > 0:  # rollout/trainer mismatch correction on the policy loss
            batch.set("is_weights", truncated_is_weights(old["log_probs"], batch["rollout_log_probs"], mask, cap))
            m["rollout/is_weight_mean"] = M.masked_mean(batch["is_weights"], mask)
        if corr.weights is not None:
            batch.set("is_weights", corr.weights)
        if self.cfg.algorithm.rollout_correction.drops_rejected():
            batch.set("response_mask", corr.keep.to(mask.dtype))

    def compute_values(self, batch: Batch):
        c = self.cfg.critic
        sizing = MicroBatching.of(c.use_dynamic_bsz, c.forward_micro_batch_size_per_gpu, c.forward_max_token_len_per_gpu)
        return self.placement.critic.infer("compute_values", batch.columns(ROLLOUT_COLUMNS), sizing)["values"]

    def _mini_batch_rows(self, num_trajectories: int, prompts_per_mini_batch: int, shuffle: bool,
                         epoch: int, salt: int, step: int) -> list[list[int]]:
        size = prompts_per_mini_batch * self.cfg.actor_rollout_ref.rollout.n
        order = list(range(num_trajectories))
        if shuffle:
            random.Random(shuffle_seed(self.cfg.trainer.seed, step, epoch, salt)).shuffle(order)
        return [order[k:k + size] for k in range(0, num_trajectories, size)]

    def mini_batches(self, num_trajectories: int, epoch: int, step: int) -> list[list[int]]:
        """Trajectory indices of each actor mini-batch of one epoch (whole prompt groups unless shuffled)."""
        a = self.cfg.actor_rollout_ref.actor
        return self._mini_batch_rows(num_trajectories, a.ppo_mini_batch_size, a.shuffle, epoch, 0, step)

    @staticmethod
    def _plans(batch: Batch, keys: list[str], rows_per_epoch, epochs: int, mode: str, horizon: float,
               role: str, step: int) -> list[tuple[Batch, NormalizationPlan]]:
        """(mini-batch, NormalizationPlan of the WHOLE mini-batch) for every optimizer step, in order.
        A mini-batch with no valid token (N = 0) is rejected here, before any dispatch."""
        out = []
        for epoch in range(epochs):
            for k, rows in enumerate(rows_per_epoch(epoch)):
                mini = batch.select(rows).columns(keys)
                if not bool((mini["response_mask"] != 0).any()):
                    raise ValueError(
                        f"{role} mini-batch {k} of epoch {epoch} at step {step} has no valid response "
                        f"token (N = 0): the loss is undefined; check the rollout (max_response_length) and the data"
                    )
                out.append((mini, NormalizationPlan.from_mask(mini["response_mask"], mode, horizon=horizon)))
        return out

    def update_actor(self, batch: Batch, step: int) -> list[dict]:
        """ppo_epochs x mini-batches optimizer steps; returns per-step results merged over DP. With distillation
        the batch holds ``teacher_log_probs`` (the step's teacher pass)."""
        a = self.cfg.actor_rollout_ref.actor
        d = self.cfg.distillation
        missing = [k for k in teacher_keys(d.distillation_loss.loss_mode) if k not in batch] if d.enabled else []
        if a.router_replay.mode == "R3" and ROUTED_EXPERTS_KEY not in batch:
            missing.append(ROUTED_EXPERTS_KEY)  # the rollout records it (enable_rollout_routing_replay)
        if missing:
            raise ValueError(f"the actor's update needs {missing} in the batch (the teacher's pass; R3: the rollout's "
                             f"routing)")
        wanted = ("old_log_probs", "ref_log_probs", "is_weights", ROUTED_EXPERTS_KEY) + TEACHER_KEYS + (
            ("rollout_log_probs",) if self.loss_correction is not None else ())
        keys = ROLLOUT_COLUMNS + ["advantages"] + [k for k in wanted if k in batch]
        plans = self._plans(batch, keys, lambda epoch: self.mini_batches(len(batch), epoch, step), a.ppo_epochs,
                            a.loss_agg_mode, a.loss_scale_factor, "actor", step)
        if LOSS_NEEDS[a.policy_loss.loss_mode] & {"cov_mask"}:
            return self._update_actor_with_cov_selection(plans, step)
        return self._train_actor(plans, step)

    def _train_actor(self, plans, step: int, end_of_step: bool = True) -> list[dict]:
        arr = self.cfg.actor_rollout_ref
        sizing = MicroBatching.of(arr.actor.use_dynamic_bsz, arr.actor.ppo_micro_batch_size_per_gpu,
                                  arr.actor.ppo_max_token_len_per_gpu)
        d = self.cfg.distillation
        return self._train_role("actor", self.placement.actor, "update_actor", plans, step, sizing, arr.actor,
                                arr.rollout.temperature, self.loss_correction, end_of_step,
                                d.distillation_loss if d.enabled else None)

    def _update_actor_with_cov_selection(self, plans, step: int) -> list[dict]:
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
                                         seed=cov_selection_seed(self.cfg.trainer.seed, step, k), log_probs=current)
            steps += self._train_actor([(mini.set("cov_mask", selected), plan)], step, k == len(plans) - 1)
        return steps

    def update_critic(self, batch: Batch, step: int) -> list[dict]:
        """Critic epochs x mini-batches optimizer steps of the clipped value loss."""
        c = self.cfg.critic
        rows = lambda epoch: self._mini_batch_rows(len(batch), c.ppo_mini_batch_size, c.shuffle,  # noqa: E731
                                                   epoch, 1, step)
        plans = self._plans(batch, ROLLOUT_COLUMNS + ["old_values", "returns"], rows, c.ppo_epochs, c.loss_agg_mode,
                            self.cfg.actor_rollout_ref.actor.loss_scale_factor, "critic", step)
        sizing = MicroBatching.of(c.use_dynamic_bsz, c.ppo_micro_batch_size_per_gpu, c.ppo_max_token_len_per_gpu)
        return self._train_role("critic", self.placement.critic, "update_critic", plans, step, sizing,
                                c.cliprange_value)

    @staticmethod
    def _train_role(role: str, group: RoleGroup, method: str, plans, step: int, *args) -> list[dict]:
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
            raise _non_finite(role, step, f"gradient norm is {e.grad_norm} at its optimizer step "
                                          f"{e.optimizer_step}{loss}") from err
        for k, s in enumerate(steps):
            bad = {key: s[key] for key in ("loss", "grad_norm") if key in s and not math.isfinite(s[key])}
            if bad:
                what = " and ".join(f"{key.replace('_', ' ')} is {v}" for key, v in bad.items())
                raise _non_finite(role, step, f"{what} in update {k + 1} of {len(steps)} of this step")
        return steps


def _non_finite(role: str, step: int, detail: str) -> NonFiniteTraining:
    section = "actor_rollout_ref.actor" if role == "actor" else "critic"
    return NonFiniteTraining(
        f"step {step + 1}: the {role}'s {detail}, not finite; the run stopped there (the step is "
        f"not logged, checkpointed or exported)",
        f"check the reward's scale, {section}.optim.lr and the model weights, then resume from the last "
        f"checkpoint")
