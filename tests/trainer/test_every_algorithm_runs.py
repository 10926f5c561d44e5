"""Every (advantage estimator, policy loss) pair that validation accepts runs end to end, and every
shipped recipe trains from the CLI.

- Pre-flight: every pair of the registries is accepted with a valid config; a pair that cannot run
  (e.g. a group estimator with rollout.n = 1) is rejected with one line naming the key.
- Runs: ONE trainer starts the roles (Ray, megatron engines, rollout, and the critic that gae needs)
  for every estimator, and then every policy loss takes 2 RL steps on those running workers: a fresh
  ``PPOTrainer`` built from the pair's own config takes over the started role groups (the roles do
  not depend on the loss or the estimator; only gae's trainer gets the critic), so the driver path
  of each pair (old-log-prob pass or not, cov-mask selection, the loss config sent to the workers)
  is exactly the CLI's. Each pair's metrics must be
  finite and hold the algorithm's own metric (gae: value loss; remax: the greedy baseline reward;
  clip_cov / kl_cov: the selected-token fraction).
- Recipes: ``main_ppo.main(["--recipe", ...])`` for each shipped recipe, 2 steps on the shipped
  model and task (DAPO reports the groups it dropped).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest

from tests.e2e.conftest import shared_ray, tiny_assets, tiny_overrides  # noqa: F401  (fixtures)
from verl_lite.algorithms import ADVANTAGE_ESTIMATORS, POLICY_LOSSES

ESTIMATORS = sorted(ADVANTAGE_ESTIMATORS)
LOSSES = sorted(POLICY_LOSSES)
RECIPES = Path(__file__).resolve().parents[2] / "recipes"
RC = "algorithm.rollout_correction"
ESTIMATOR_METRIC = {"gae": "critic/vf_loss", "remax": "remax/baseline_reward/mean"}
LOSS_METRIC = {"clip_cov": "actor/cov_selected_frac", "kl_cov": "actor/cov_selected_frac",
               "vanilla": "actor/pg_clipfrac"}
# tiny and fast: 2 prompts x 4 samples, one optimizer step per RL step, no validation
FAST = {"data.train_batch_size": 2, "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
        "data.max_response_length": 4, "trainer.total_training_steps": 2, "trainer.test_freq": 0,
        "trainer.val_before_train": "false", "trainer.logger": "[jsonl]"}


def pair_overrides(assets, estimator: str, loss: str, **extra) -> list[str]:
    return tiny_overrides(assets, **FAST, **{"algorithm.adv_estimator": estimator,
                                             "actor_rollout_ref.actor.policy_loss.loss_mode": loss}, **extra)


def test_every_registered_pair_is_accepted_before_start(tiny_assets):
    from verl_lite.config import load_config, validate_config

    for estimator in ESTIMATORS:
        for loss in LOSSES:
            validate_config(load_config(pair_overrides(tiny_assets, estimator, loss)))


def test_a_pair_that_cannot_run_is_rejected_with_the_key(tiny_assets):
    from verl_lite.algorithms import ESTIMATOR_NEEDS
    from verl_lite.config import ConfigError, load_config, validate_config

    grouped = [e for e in ESTIMATORS if "groups" in ESTIMATOR_NEEDS[e]]
    assert {"grpo", "rloo"} <= set(grouped)
    for estimator in grouped:
        with pytest.raises(ConfigError) as info:
            validate_config(load_config(pair_overrides(tiny_assets, estimator, "vanilla",
                                                       **{"actor_rollout_ref.rollout.n": 1})))
        lines = str(info.value).strip().splitlines()
        assert any("actor_rollout_ref.rollout.n" in line and estimator in line for line in lines), lines


def _finite(record: dict) -> list[str]:
    """Keys whose value is not a finite number (metrics.jsonl writes non-finite floats as null)."""
    return [k for k, v in record.items() if v is None or (isinstance(v, float) and not math.isfinite(v))]


@pytest.fixture(scope="class")
def roles(tiny_assets, shared_ray):  # noqa: F811
    """gae's started roles (actor + critic), for the tests of TestOnStartedRoles; closed after its last test."""
    from verl_lite.config import load_config
    from verl_lite.trainer.ppo_trainer import PPOTrainer

    first = PPOTrainer(load_config(pair_overrides(tiny_assets, "gae", LOSSES[0])))
    first.start()
    try:
        yield first
    finally:
        first.close()


class TestOnStartedRoles:
    """The pairs (and the dynamic-sampling bound) on one started set of roles, shut down at the end of
    the class (before the recipe runs below need the Ray's CPUs)."""

    @staticmethod
    def take_over(trainer, roles):
        trainer.actor, trainer.pool = roles.actor, roles.pool
        trainer.critic = roles.critic if trainer.use_critic else None
        return trainer

    @pytest.mark.parametrize("estimator", ESTIMATORS)
    def test_every_loss_runs_two_steps_with_each_estimator(self, tiny_assets, roles, estimator):
        from verl_lite.config import load_config
        from verl_lite.trainer.ppo_trainer import PPOTrainer

        variants = [(loss, {}) for loss in LOSSES]
        if estimator == "grpo":  # truncated importance weights reach the loss; bypass mode's two loss types
            variants.append(("vanilla", {"actor_rollout_ref.actor.tis_imp_ratio_cap": 2.0}))
            variants += [("vanilla", {f"{RC}.bypass_mode": "true", f"{RC}.loss_type": kind,
                                      f"{RC}.rollout_is": "token"}) for kind in ("ppo_clip", "reinforce")]
        for loss, extra in variants:
            trainer = self.take_over(PPOTrainer(load_config(pair_overrides(tiny_assets, estimator, loss, **extra))),
                                     roles)
            assert trainer.cfg.actor_rollout_ref.actor.policy_loss.loss_mode == loss
            assert (trainer.critic is not None) == (estimator == "gae")
            batches = trainer._train_batches()
            history = [trainer.step(batches) for _ in range(2)]
            bypass = extra.get(f"{RC}.loss_type")
            loss_metric = "actor/ppo_kl" if bypass == "reinforce" else LOSS_METRIC.get(loss)
            for record in history:
                assert not _finite(record), (estimator, loss, _finite(record))
                assert record["actor/num_updates"] == 1
                for key in (ESTIMATOR_METRIC.get(estimator), loss_metric, "actor/grad_norm"):
                    if key is not None:
                        assert key in record, (estimator, loss, key)
            if loss in ("clip_cov", "kl_cov"):  # the selection needs the old log-probs of the mini-batch
                assert history[0]["actor/old_log_prob_recomputed"] == 1.0
            if "actor_rollout_ref.actor.tis_imp_ratio_cap" in extra:
                assert 0 < history[0]["rollout/is_weight_mean"] <= 2.0
            if bypass:  # old = the rollout's log-probs: no old-log-prob pass; the weights from the update's forward
                assert history[0]["actor/old_log_prob_recomputed"] == 0.0
                assert "rollout_corr/is_weight_mean" in history[0], sorted(history[0])
                # which loss ran: PPO-clip reports its clip fraction, REINFORCE (-A w log pi) has no clip
                assert ("actor/pg_clipfrac" in history[0]) is (bypass == "ppo_clip"), sorted(history[0])
            if loss == "kl_cov":  # always selects at least one token (clip_cov only inside its window)
                assert history[0]["actor/cov_selected_frac"] > 0, (estimator, loss)

    def test_dynamic_sampling_bound_is_a_clear_error(self, tiny_assets, roles):
        """The toy reward never reaches 1.0, so every group's `acc` is constant: every round drops every
        group and the bound (max_num_gen_batches) ends the step with an error naming the key."""
        from verl_lite.config import load_config
        from verl_lite.errors import RunFailure, describe
        from verl_lite.trainer.ppo_trainer import PPOTrainer
        from verl_lite.trainer.rollout_stage import DynamicSamplingError

        trainer = self.take_over(PPOTrainer(load_config(pair_overrides(tiny_assets, "grpo", "vanilla", **{
            "algorithm.filter_groups.enable": "true", "algorithm.filter_groups.max_num_gen_batches": 2}))), roles)
        batches = trainer._train_batches()
        with pytest.raises(DynamicSamplingError, match="max_num_gen_batches") as info:
            trainer.step(batches)
        assert isinstance(info.value, RunFailure) and describe(info.value)[0] == 1
        assert re.search(r"found only [01] of 2 prompt groups", str(info.value)), str(info.value)


@pytest.fixture(scope="module")
def shipped():
    from verl_lite.config import default_data_files, default_model_path

    train, val = default_data_files()
    return {"actor_rollout_ref.model.path": default_model_path(), "data.train_files": train[0],
            "data.val_files": val[0]}


# tool_agent: its own model and task (multi-turn), run by tests/agent/test_tool_agent_recipe.py
@pytest.mark.parametrize("recipe", sorted(p.stem for p in RECIPES.glob("*.yaml")
                                           if p.stem not in ("tp2pp2_cpu", "tool_agent")))
def test_recipe_trains_from_the_cli(recipe, shipped, tmp_path, shared_ray):
    from verl_lite.trainer import main_ppo

    overrides = {**shipped, "data.train_batch_size": 4, "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
                 "actor_rollout_ref.rollout.n": 4, "trainer.total_training_steps": 2, "trainer.test_freq": 2,
                 "trainer.logger": "[jsonl]", "trainer.output_dir": str(tmp_path)}
    argv = ["--recipe", str(RECIPES / f"{recipe}.yaml")] + [f"{k}={v}" for k, v in overrides.items()]
    assert main_ppo.main(argv) == 0
    rows = [json.loads(line) for line in next(tmp_path.glob("*/metrics.jsonl")).read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[-1]["val/accuracy"] is not None
    for r in rows[1:]:
        assert not _finite(r), (recipe, _finite(r))
    if recipe == "ppo":
        assert "critic/vf_loss" in rows[1] and "critic/explained_variance" in rows[1]
    if recipe == "dapo":
        assert "dynamic_sampling/groups_dropped" in rows[1] and "reward/overlong_penalty_mean" in rows[1]
    if recipe == "distill":  # the teacher's pass is timed like the reference's; its KL is logged per step
        assert rows[1]["timing_s/teacher_log_prob"] > 0 and "actor/distillation/kl" in rows[1], sorted(rows[1])
    if recipe == "remax":
        assert "remax/baseline_reward/mean" in rows[1]
    if recipe == "async":  # two batches ahead: step 2 trains groups all sampled by version 0 (a step old)
        assert [r["training/off_policy/trajectory_staleness/max"] for r in rows[1:]] == [0, 1], rows
    if recipe == "one_step_off":  # batch 2 was sampled by version 1 (one step old), importance-weighted
        assert [r.get("async/staleness") for r in rows[1:]] == [0, 1] and "rollout_corr/is_weight_mean" in rows[2]


def test_the_distill_recipe_with_the_teacher_on_workers_of_its_own(shipped, tmp_path, shared_ray):  # noqa: F811
    """verl's ``distillation.teacher_model.enable_resource_pool`` / ``n_gpus_per_node`` / ``nnodes``: the teacher on
    one worker of its own while the actor has two; it scores the same rollouts as the teacher colocated on the
    actor's two workers: the same distillation KL and update at the first step (its layout changes the sums' order
    only). With the top-k forward KL as the loss (``forward_kl_topk``, its gradient through the student's
    log-probs at the teacher's top-k ids), so the top-k path runs end to end in both placements."""
    from verl_lite.trainer import main_ppo

    T = "distillation.teacher_model"
    L = "distillation.distillation_loss"
    topk = {f"{L}.loss_mode": "forward_kl_topk", f"{L}.topk": 8, f"{L}.use_policy_gradient": "false"}
    rows = {}
    for name, extra in (("colocated", {}), ("own", {f"{T}.enable_resource_pool": "true", f"{T}.n_gpus_per_node": 1,
                                                   f"{T}.nnodes": 1})):
        out = tmp_path / name
        overrides = {**shipped, "data.train_batch_size": 4, "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
                     "actor_rollout_ref.rollout.n": 2, "trainer.total_training_steps": 1, "trainer.test_freq": 0,
                     "trainer.val_before_train": "false", "trainer.n_gpus_per_node": 2, "trainer.logger": "[jsonl]",
                     "trainer.output_dir": str(out), **topk, **extra}
        argv = ["--recipe", str(RECIPES / "distill.yaml")] + [f"{k}={v}" for k, v in overrides.items()]
        assert main_ppo.main(argv) == 0
        row = [json.loads(line) for line in next(out.glob("*/metrics.jsonl")).read_text().splitlines()][-1]
        assert row["step"] == 1 and row["timing_s/teacher_log_prob"] > 0
        assert 0 < row["actor/distillation/teacher_mass"] <= 1 and 0 < row["actor/distillation/student_mass"] <= 1
        rows[name] = row
    for key in ("actor/distillation/kl", "actor/distillation/teacher_mass", "actor/grad_norm"):
        assert rows["own"][key] == pytest.approx(rows["colocated"][key], rel=1e-5, abs=1e-9), key
    assert rows["own"]["actor/distillation/kl"] > 0


def test_a_teacher_of_another_size_and_layout(shipped, tmp_path, shared_ray):  # noqa: F811
    """A teacher larger than the student (Qwen3, 192 wide, 6 layers, tied embeddings, against the student's Qwen2,
    128 wide, 4 layers) in a layout of its own (TP2 over the actor's two DP workers) scores the student's samples:
    two steps of each loss family (k3 as a loss, top-k forward KL as a per-token reward) train, with the teacher
    timed and its KL logged."""
    from verl_lite.data import save_char_tokenizer
    from verl_lite.trainer import main_ppo
    from verl_lite.utils import make_tiny_hf_model

    teacher = make_tiny_hf_model(tmp_path / "teacher", "qwen3", vocab_size=128, hidden_size=192, num_layers=6,
                                 num_attention_heads=6, num_key_value_heads=2, intermediate_size=384,
                                 tie_word_embeddings=True, seed=4)
    save_char_tokenizer(teacher)
    L = "distillation.distillation_loss"
    for name, loss in (("k3", {f"{L}.loss_mode": "k3", f"{L}.use_policy_gradient": "false"}),
                       ("topk", {f"{L}.loss_mode": "forward_kl_topk", f"{L}.topk": 16})):
        out = tmp_path / name
        overrides = {**shipped, "data.train_batch_size": 4, "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
                     "actor_rollout_ref.rollout.n": 2, "trainer.total_training_steps": 2, "trainer.test_freq": 0,
                     "trainer.val_before_train": "false", "trainer.n_gpus_per_node": 2, "trainer.logger": "[jsonl]",
                     "trainer.output_dir": str(out), "distillation.teacher_model.model_path": str(teacher),
                     "distillation.teacher_model.megatron.tensor_model_parallel_size": 2, **loss}
        argv = ["--recipe", str(RECIPES / "distill.yaml")] + [f"{k}={v}" for k, v in overrides.items()]
        assert main_ppo.main(argv) == 0
        rows = [json.loads(line) for line in next(out.glob("*/metrics.jsonl")).read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2], name
        for r in rows:
            assert r["timing_s/teacher_log_prob"] > 0 and r["actor/distillation/kl"] > 0, (name, r)
            assert math.isfinite(r["actor/grad_norm"]), (name, r)


def test_ppo_with_the_critic_on_workers_of_its_own(shipped, tmp_path, shared_ray):  # noqa: F811
    """``critic.num_workers``: the critic on one worker of its own beside the actor's one gives the colocated
    critic's first update (value loss, explained variance) and the same actor update; across nodes it is refused
    before start."""
    from verl_lite.config import ConfigError, load_config, validate_config
    from verl_lite.trainer import main_ppo

    rows = {}
    for name, extra in (("colocated", {}), ("own", {"critic.num_workers": 1})):
        out = tmp_path / name
        overrides = {**shipped, "data.train_batch_size": 4, "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
                     "actor_rollout_ref.rollout.n": 2, "trainer.total_training_steps": 1, "trainer.test_freq": 0,
                     "trainer.val_before_train": "false", "trainer.logger": "[jsonl]", "trainer.output_dir": str(out),
                     **extra}
        argv = ["--recipe", str(RECIPES / "ppo.yaml")] + [f"{k}={v}" for k, v in overrides.items()]
        assert main_ppo.main(argv) == 0
        rows[name] = [json.loads(line) for line in next(out.glob("*/metrics.jsonl")).read_text().splitlines()][-1]
    for key in ("critic/vf_loss", "critic/explained_variance", "actor/pg_loss", "actor/grad_norm"):
        assert rows["own"][key] == pytest.approx(rows["colocated"][key], rel=1e-6, abs=1e-9), key
    with pytest.raises(ConfigError, match="a critic on workers of its own is placed on one node only"):
        validate_config(load_config([f"--recipe={RECIPES / 'ppo.yaml'}", "critic.num_workers=2",
                                     "trainer.nnodes=2", "trainer.n_gpus_per_node=1"]))
