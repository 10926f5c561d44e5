"""Short GRPO and GSPO runs of the whole loop (Ray, megatron engine, HF rollout, reward) with 1
worker and with 4 workers in two layouts. For the same seed the rollouts are the same in every
layout (per-prompt seeds), so the first optimizer step's loss and grad norm must match the
1-worker run (rel 1e-5): the multi-worker layouts compute the same gradient as one process."""

import math

import pytest

from tests.e2e.conftest import tiny_overrides

# At the first update the ratio is 1 and GRPO advantages have zero group mean, so the policy
# term is ~0; the entropy bonus makes the loss value itself a non-trivial check. GSPO also runs
# the reference engine (KL loss).
ALGOS = {
    "grpo": {"algorithm.adv_estimator": "grpo", "actor_rollout_ref.actor.entropy_coeff": 0.01},
    "gspo": {"algorithm.adv_estimator": "grpo", "actor_rollout_ref.actor.policy_loss.loss_mode": "gspo",
             "actor_rollout_ref.actor.loss_agg_mode": "seq-mean-token-mean",
             "actor_rollout_ref.actor.entropy_coeff": 0.01, "actor_rollout_ref.actor.use_kl_loss": True},
}
# PPO: the critic (GAE) in a layout of its own, colocated on the same 4 workers
ALGOS["ppo"] = {"algorithm.adv_estimator": "gae", "critic.optim.lr": 1e-3}
LAYOUTS = {
    "1": {},
    "tp2pp2": {"trainer.n_gpus_per_node": 4, "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": 2,
               "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size": 2},
    "dp2tp2": {"trainer.n_gpus_per_node": 4, "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": 2},
}
LAYOUTS["tp2pp2_critic_dp2tp2"] = {**LAYOUTS["tp2pp2"], "critic.megatron.tensor_model_parallel_size": 2}
# GRPO and GSPO in both 4-worker layouts, PPO with actor TP2xPP2 and critic DP2xTP2
# (a 4-worker run costs ~40-60 s on 2 cores).
MATRIX = [(a, lay) for a in ("grpo", "gspo") for lay in ("tp2pp2", "dp2tp2")] + [("ppo", "tp2pp2_critic_dp2tp2")]

_runs: dict = {}


def run(assets, algo, layout):
    key = (algo, layout)
    if key not in _runs:
        from verl_lite.config import default_data_files, default_model_path, load_config
        from verl_lite.trainer.ppo_trainer import PPOTrainer

        # the shipped checkpoint and data with the built-in verifier: responses of varied length
        # (so GRPO's token-mean and GSPO's sequence-level objective differ) and mixed rewards
        train, val = default_data_files()
        shipped = {"actor_rollout_ref.model.path": default_model_path(), "data.train_files": train[0],
                   "data.val_files": val[0], "reward.custom_reward_function.path": "null",
                   "data.max_response_length": 10}
        cfg = load_config(tiny_overrides(assets, **shipped, **ALGOS[algo], **LAYOUTS[layout]))
        trainer = PPOTrainer(cfg)
        history = trainer.fit()
        _runs[key] = (history, trainer.update_history, trainer.critic_update_history)
    return _runs[key]


def _rel(a, b):
    return abs(a - b) / max(abs(b), 1e-12)


@pytest.mark.parametrize("algo,layout", MATRIX)
def test_first_update_matches_one_worker(tiny_assets, shared_ray, algo, layout):
    ref_hist, ref_updates, ref_critic = run(tiny_assets, algo, "1")
    hist, updates, critic = run(tiny_assets, algo, layout)
    # both runs finished every step and validated before and after training
    assert [r["step"] for r in hist] == [r["step"] for r in ref_hist] == [0, 1, 2]
    assert hist[-1].get("val/accuracy") is not None and hist[0].get("val/accuracy") is not None
    # the same rollouts: identical rewards and response lengths at step 1
    for k in ("reward/mean", "reward/max", "reward/min", "response_length/mean"):
        assert hist[1][k] == ref_hist[1][k], k
    first, ref_first = updates[0][0], ref_updates[0][0]
    print(f"{algo} {layout}: loss {first['loss']!r} vs {ref_first['loss']!r}, "
          f"grad_norm {first['grad_norm']!r} vs {ref_first['grad_norm']!r}")
    assert abs(ref_first["loss"]) > 1e-6 and ref_first["grad_norm"] > 1e-6, "the check needs a non-trivial update"
    assert _rel(first["loss"], ref_first["loss"]) < 1e-5, (first["loss"], ref_first["loss"])
    assert _rel(first["grad_norm"], ref_first["grad_norm"]) < 1e-5, (first["grad_norm"], ref_first["grad_norm"])
    if algo == "ppo":  # the critic's first update (clipped value loss) matches too
        c, ref_c = critic[0][0], ref_critic[0][0]
        assert ref_c["vf_loss"] > 1e-6 and ref_c["grad_norm"] > 1e-6
        assert _rel(c["vf_loss"], ref_c["vf_loss"]) < 1e-5, (c["vf_loss"], ref_c["vf_loss"])
        assert _rel(c["grad_norm"], ref_c["grad_norm"]) < 1e-5, (c["grad_norm"], ref_c["grad_norm"])
        assert all(len(u) == 2 for u in critic)
    # weight sync: after the first update the rollout samples from the updated actor, so its
    # log-probs agree with the engine's recompute (a stale rollout would be off by ~lr-sized steps)
    assert hist[2]["rollout/logprob_diff_max"] < 1e-4 and ref_hist[2]["rollout/logprob_diff_max"] < 1e-4
    # two mini-batches per step, two steps; every number finite
    assert len(updates) == 2 and all(len(u) == 2 for u in updates)
    assert all(math.isfinite(v) for u in updates for s in u for v in s.values())


def test_grpo_and_gspo_are_different_objectives(tiny_assets, shared_ray):
    """Guards the matrix above against a degenerate batch (equal lengths make the two coincide)."""
    grpo = run(tiny_assets, "grpo", "1")[1][0][0]
    gspo = run(tiny_assets, "gspo", "1")[1][0][0]
    assert _rel(grpo["loss"], gspo["loss"]) > 1e-3 and _rel(grpo["grad_norm"], gspo["grad_norm"]) > 1e-3
