"""``megatron.dtype=bfloat16`` end to end: PPO (actor + reference for the KL loss + critic) through
Ray on the shipped model, against the same run in float32.

At step 1 both runs see the same rollout (the HF rollout is float32 and both start from the same
weights), so their first actor and critic updates differ only by bf16 rounding: close (within the
parity suite's REF_TOL), and not identical (so the dtype did reach every engine).
"""

from __future__ import annotations

import math

import pytest

REF_TOL = 0.072  # tests/parity/test_bf16_parity.py: 2 * 2^-8 * sqrt(86)


def _overrides(dtype: str, out_dir: str) -> list[str]:
    from verl_lite.config import default_data_files, default_model_path

    train, val = default_data_files()
    return [f"{k}={v}" for k, v in {
        "actor_rollout_ref.model.path": default_model_path(), "data.train_files": train[0],
        "data.val_files": val[0], "data.train_batch_size": 4, "data.max_response_length": 8,
        "actor_rollout_ref.rollout.n": 4, "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 4, "actor_rollout_ref.actor.use_kl_loss": True,
        "algorithm.adv_estimator": "gae", "trainer.total_training_steps": 2, "trainer.test_freq": -1,
        "trainer.n_gpus_per_node": 1, "trainer.output_dir": out_dir,
        "actor_rollout_ref.actor.megatron.dtype": dtype, "critic.megatron.dtype": dtype,
    }.items()]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from verl_lite.config import load_config
    from verl_lite.controller import start_ray, stop_ray
    from verl_lite.trainer.ppo_trainer import PPOTrainer

    out = {}
    started = start_ray(num_cpus=2)
    try:
        for dtype in ("float32", "bfloat16"):
            trainer = PPOTrainer(load_config(_overrides(dtype, str(tmp_path_factory.mktemp(dtype)))))
            history = trainer.fit()
            out[dtype] = (history, trainer.update_history, trainer.critic_update_history)
    finally:
        if started:
            stop_ray()
    return out


def test_bf16_ppo_runs_and_matches_fp32_first_update(runs):
    (h32, a32, c32), (h16, a16, c16) = runs["float32"], runs["bfloat16"]
    assert [h["step"] for h in h16] == [h["step"] for h in h32] and h16[-1]["step"] == 2
    for ours, theirs, what in ((a16[0][0], a32[0][0], "actor"), (c16[0][0], c32[0][0], "critic")):
        for key in ("grad_norm", "loss"):
            a, b = ours[key], theirs[key]
            print(f"{what} first update {key}: bf16 {a:.6g} fp32 {b:.6g} rel {abs(a - b) / max(abs(b), 1e-3):.2e}")
            assert math.isfinite(a), (what, key, a)
            assert a != b, f"{what} {key}: bf16 equals fp32 bit for bit; the dtype did not reach the engine"
            assert abs(a - b) <= REF_TOL * max(abs(b), 1e-3), (what, key, a, b)
