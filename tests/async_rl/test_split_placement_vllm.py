"""Split placement with the vLLM backend (vLLM's CPU build, ``.venv-vllm``; skipped where vLLM cannot run):
rollout workers of their own (``hybrid_engine=false``) holding a vLLM engine, fed each policy version by
the pipeline, through the real trainer on one local Ray (3 steps per run).

The check that the rollout pool samples with the policy version it reports: the trainer recomputes the
log-probs of every sampled token with its own weights (``rollout_correction.rollout_is=token`` makes it),
and ``rollout/logprob_diff_max`` is the largest |vLLM's behaviour log-prob - the trainer's| of the step.

- staleness 0: every batch is sampled by the version the actor trains (``async/staleness`` 0), so the
  difference stays at float noise on every step (< 1e-3), the same as the colocated vLLM rollout's and the colocated
  stream's (``trainer.v1.trainer_mode=colocate_async``, nothing ahead: the worker loads each update into its own
  vLLM engine);
  a rollout pool that missed an update (or loaded it wrong) would sample with other weights, and with
  lr 1e-2 an update moves the log-probs by far more than that;
- staleness 1 (one-step-off): batch b is sampled by version max(0, b - 1); on the steps that train a
  batch one version behind, the difference is the update's own size (> 1e-2): the check above can fail.
"""

from __future__ import annotations

import math

import pytest

from tests.e2e.conftest import shared_ray  # noqa: F401  (fixture)
from verl_lite.rollout import vllm_available, vllm_unavailable_reason

pytestmark = pytest.mark.skipif(not vllm_available(), reason=f"vLLM cannot run here: {vllm_unavailable_reason()}")

STEPS = 3
# the shipped default job (its model: vLLM's CPU attention needs a real head size)
COMMON = {"trainer.total_training_steps": STEPS, "trainer.test_freq": 0, "trainer.val_before_train": "false",
          "trainer.logger": "[jsonl]", "actor_rollout_ref.actor.optim.lr": 1e-2,
          "actor_rollout_ref.rollout.name": "vllm", "algorithm.rollout_correction.rollout_is": "token"}
# weight syncs in buckets of 256 KiB: about a dozen per policy of the shipped model
SPLIT = {"actor_rollout_ref.hybrid_engine": "false", "actor_rollout_ref.rollout.n_gpus_per_node": 1,
         "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes": 0.25}
# the stream on the actor's own workers, nothing generated ahead: each step's groups are sampled after the last
# update was loaded into the worker's vLLM engine in process
COLOCATE_ASYNC_0 = {"trainer.v1.trainer_mode": "colocate_async", "trainer.v1.colocate_async.num_warmup_batches": 0}
NOISE = 1e-3  # |behaviour - trainer| log-prob of one token sampled by the trained version (vLLM CPU vs the engine)


def _fit(tmp_path, **extra) -> list[dict]:
    from verl_lite.config import load_config
    from verl_lite.trainer.ppo_trainer import PPOTrainer

    keys = {**COMMON, "trainer.output_dir": str(tmp_path), "trainer.default_local_dir": str(tmp_path / "ckpt"), **extra}
    cfg = load_config([f"{k}={v}" for k, v in keys.items()])
    return [r for r in PPOTrainer(cfg).fit() if r.get("step", 0) >= 1 and "actor/pg_loss" in r]


@pytest.fixture(scope="module")
def runs(shared_ray, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("split_vllm")
    return {"colocated": _fit(out / "colocated"),
            "colocate_async0": _fit(out / "colocate_async0", **COLOCATE_ASYNC_0),
            "split0": _fit(out / "split0", **SPLIT, **{"async_training.staleness_threshold": 0}),
            "split1": _fit(out / "split1", **SPLIT, **{"async_training.staleness_threshold": 1})}


def test_staleness_zero_vllm_pool_samples_the_trained_version(runs):
    for name in ("colocated", "colocate_async0", "split0"):
        records = runs[name]
        assert [r["step"] for r in records] == list(range(1, STEPS + 1)), name
        print(name, [(r["rollout/logprob_diff_max"], r["actor/grad_norm"], r["reward/mean"]) for r in records])
        for r in records:
            assert r["rollout/logprob_diff_max"] < NOISE, (name, r["step"], r["rollout/logprob_diff_max"])
            assert math.isfinite(r["actor/pg_loss"])
        assert records[0]["actor/grad_norm"] > 1e-3, "the check needs a first update that moves the policy"
    for r in runs["colocate_async0"]:
        assert r["training/off_policy/trajectory_staleness_worst/max"] == 0, r
    for r in runs["split0"]:
        assert r["async/staleness"] == 0 and r["async/policy_version"] == r["step"] - 1, r
        assert r["perf/weight_sync_bytes"] > 1 << 20 and r["perf/weight_sync_gb_per_s"] > 0, r


def test_one_step_off_vllm_pool_lags_by_at_most_one_version(runs):
    records = runs["split1"]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    print("split1", [(r["async/staleness"], r["rollout/logprob_diff_max"]) for r in records])
    for r in records:
        b = r["step"] - 1
        assert r["async/policy_version"] == max(0, b - 1), r
        assert r["async/staleness"] == b - r["async/policy_version"] <= 1
        assert math.isfinite(r["actor/pg_loss"]) and math.isfinite(r["actor/grad_norm"])
        if r["async/staleness"] == 1:  # sampled one update ago: the difference is the update's, not noise
            assert r["rollout/logprob_diff_max"] > 10 * NOISE, (r["step"], r["rollout/logprob_diff_max"])
        else:
            assert r["rollout/logprob_diff_max"] < NOISE, (r["step"], r["rollout/logprob_diff_max"])
    assert any(r["async/staleness"] == 1 for r in records)
