"""``trainer.v1.trainer_mode=separate_async`` through the real trainer (one local Ray, the tiny default job):
trajectories stream through the rollout pool, each step takes the oldest complete groups within
``max_off_policy_threshold``, updated weights land while trajectories run; and a run stopped right after a
checkpoint resumes with no step repeated or skipped and every prompt it had pulled trained (verl #7933)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.e2e.conftest import shared_ray, tiny_assets, tiny_overrides  # noqa: F401  (fixtures)

STEPS = 5
KEYS = {"trainer.total_training_steps": STEPS, "trainer.test_freq": 0, "trainer.val_before_train": "false",
        "trainer.logger": "[jsonl]", "actor_rollout_ref.actor.optim.lr": 1e-2,
        "trainer.v1.trainer_mode": "separate_async", "actor_rollout_ref.rollout.n_gpus_per_node": 1}
THRESHOLD = 8  # verl's default max_off_policy_threshold
BATCH, N = 4, 4  # tiny_overrides: data.train_batch_size, rollout.n


class _Prompts:
    """Records the prompts each step trained on (``log_completions`` rows), by step."""

    def __init__(self):
        self.by_step: dict[int, list[str]] = {}

    def on_step_end(self, step, metrics, **kwargs):  # before on_save (a stop there still sees the step)
        from verl_lite.trainer.tracking import COMPLETIONS_KEY

        if COMPLETIONS_KEY in metrics:
            self.by_step[step] = [row["prompt"] for row in metrics[COMPLETIONS_KEY]]


class _StopAfterSave:
    def on_save(self, step):
        raise RuntimeError(f"stopped after the step-{step} checkpoint")


def _fit(assets, tmp_path, callbacks=(), **extra):
    from verl_lite.config import load_config
    from verl_lite.trainer.ppo_trainer import PPOTrainer

    cfg = load_config(tiny_overrides(assets, **{**KEYS, "trainer.output_dir": str(tmp_path), **extra}))
    records = PPOTrainer(cfg, callbacks=list(callbacks), log_completions=True).fit()
    return [r for r in records if r.get("step", 0) >= 1 and "actor/pg_loss" in r]


def test_streamed_steps_stay_within_the_bound_and_train_every_prompt_once(tiny_assets, shared_ray, tmp_path):  # noqa: F811
    prompts = _Prompts()
    records = _fit(tiny_assets, tmp_path, [prompts])
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for r in records:
        assert 0 <= r["training/off_policy/trajectory_staleness_worst/max"] <= THRESHOLD - 1
        assert r["training/off_policy/trajectory_staleness/min"] >= 0
        assert r["training/off_policy/trajectory_spans/min"] >= 1
        assert math.isfinite(r["actor/pg_loss"]) and math.isfinite(r["actor/grad_norm"])
    # the batch after the first was generated while step 1 trained: off-policy by a version, corrected for
    assert any(r["training/off_policy/trajectory_staleness_worst/max"] >= 1 for r in records)
    trained = [p for step in sorted(prompts.by_step) for p in prompts.by_step[step]]
    assert len(prompts.by_step) == STEPS and len(trained) == STEPS * BATCH * N
    assert all(trained[i] == trained[i - i % N] for i in range(len(trained)))  # a group's n samples, together
    groups = trained[::N]
    assert len(set(groups)) == len(groups)  # the fixture's prompts are distinct: none trained twice


def test_a_resumed_stream_repeats_no_step_and_trains_what_it_had_pulled(tiny_assets, shared_ray, tmp_path):  # noqa: F811
    from verl_lite.trainer.callbacks import CallbackError

    keys = {"trainer.default_local_dir": str(tmp_path / "ckpt"), "trainer.save_freq": 2}
    first = _Prompts()
    with pytest.raises(CallbackError, match="stopped after the step-2 checkpoint"):
        _fit(tiny_assets, tmp_path / "first", [first, _StopAfterSave()], **keys)
    state = torch.load(tmp_path / "ckpt" / "global_step_2" / "async_pipeline.pt", weights_only=True)
    assert state["policy_version"] == 2
    pulled = [row for item in state["in_flight"] for row in item["rows"]]
    assert len(pulled) >= BATCH  # at least the next step's prompts were outstanding
    # the saved prompts are a stream's: resuming them as one-step-off batches is refused before any worker starts
    from verl_lite.trainer.checkpointing import CheckpointRefused

    with pytest.raises(CheckpointRefused, match="streamed run's prompts"):
        _fit(tiny_assets, tmp_path / "refused", **keys, **{"trainer.v1.trainer_mode": "sync",
                                                           "actor_rollout_ref.hybrid_engine": "false",
                                                           "trainer.resume_mode": "auto"})
    second = _Prompts()
    resumed = _fit(tiny_assets, tmp_path / "second", [second], **keys, **{"trainer.resume_mode": "auto"})
    assert [r["step"] for r in resumed] == [3, 4, 5]
    assert sorted(first.by_step) == [1, 2] and sorted(second.by_step) == [3, 4, 5]
    before = {p for s in first.by_step.values() for p in s}
    after = [p for s in (3, 4, 5) for p in second.by_step[s]]
    assert not before & set(after)  # no prompt trained twice across the stop
    # nothing lost: every prompt pulled and not trained before the stop is trained after it (submitted first)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_assets["model"])
    saved = [tokenizer.decode(list(row["prompt_ids"]), skip_special_tokens=False) for row in pulled]
    assert set(saved) <= set(after[::N])
