"""Split placement through the real trainer (one local Ray, 5 steps per run; staleness 0 against the
colocated run, bit for bit: ``test_staleness_zero_exact.py``):

- staleness 1 (one-step-off): batch b is sampled by policy version max(0, b - 1), no batch trains
  more than one version behind, and the run's losses stay finite;
- resume: a one-step-off run stopped right after its step-2 checkpoint (the pipeline one batch ahead,
  sampled by version 1) and resumed gives the uninterrupted run's steps 3-5 (within 1e-6)."""

from __future__ import annotations

import math

import pytest

from tests.e2e.conftest import shared_ray, tiny_assets, tiny_overrides  # noqa: F401  (fixtures)

STEPS = 5
COMMON = {"trainer.total_training_steps": STEPS, "trainer.test_freq": 0, "trainer.val_before_train": "false",
          "trainer.logger": "[jsonl]", "actor_rollout_ref.actor.optim.lr": 1e-2}
SPLIT = {"actor_rollout_ref.hybrid_engine": "false", "actor_rollout_ref.rollout.n_gpus_per_node": 1}
COMPARED = ("reward/mean", "advantages/mean", "actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/ppo_kl",
            "response_length/mean")


def _fit(assets, tmp_path, **extra) -> list[dict]:
    from verl_lite.config import load_config
    from verl_lite.trainer.ppo_trainer import PPOTrainer

    cfg = load_config(tiny_overrides(assets, **{**COMMON, "trainer.output_dir": str(tmp_path), **extra}))
    return [r for r in PPOTrainer(cfg).fit() if r.get("step", 0) >= 1 and "actor/pg_loss" in r]


@pytest.fixture(scope="module")
def runs(tiny_assets, shared_ray, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("split")
    return {"split1": _fit(tiny_assets, out / "split1", **SPLIT, **{"async_training.staleness_threshold": 1})}


def test_one_step_off_trains_no_batch_older_than_the_bound(runs):
    records = runs["split1"]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        b = r["step"] - 1  # 0-based batch index
        assert r["async/policy_version"] == max(0, b - 1), r
        assert r["async/staleness"] == b - r["async/policy_version"] <= 1
        assert math.isfinite(r["actor/pg_loss"]) and math.isfinite(r["actor/grad_norm"])
    assert any(r["async/staleness"] == 1 for r in records)  # the bound is used, not only respected


class _StopAfterSave:
    """Ends the run right after its first checkpoint, as a crash there would (callbacks= of the API)."""

    def on_save(self, step):
        raise RuntimeError(f"stopped after the step-{step} checkpoint")


def test_one_step_off_resume_equals_the_uninterrupted_run(runs, tiny_assets, tmp_path):  # noqa: F811
    from verl_lite.config import load_config
    from verl_lite.trainer.callbacks import CallbackError
    from verl_lite.trainer.ppo_trainer import PPOTrainer

    keys = {**COMMON, **SPLIT, "async_training.staleness_threshold": 1, "trainer.output_dir": str(tmp_path),
            "trainer.default_local_dir": str(tmp_path / "ckpt"), "trainer.save_freq": 2}
    with pytest.raises(CallbackError, match="stopped after the step-2 checkpoint"):
        PPOTrainer(load_config(tiny_overrides(tiny_assets, **keys)), callbacks=[_StopAfterSave()]).fit()
    resumed = [r for r in PPOTrainer(load_config(tiny_overrides(tiny_assets, **keys, **{"trainer.resume_mode": "auto"})))
               .fit() if r.get("step", 0) >= 1 and "actor/pg_loss" in r]
    assert [r["step"] for r in resumed] == [3, 4, 5]
    for a, b in zip(runs["split1"][2:], resumed):
        for key in (*COMPARED, "async/policy_version", "async/staleness"):
            assert math.isclose(a[key], b[key], rel_tol=1e-6, abs_tol=1e-6), (a["step"], key, a[key], b[key])
