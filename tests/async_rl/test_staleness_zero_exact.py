"""Staleness 0 is the synchronous run, bit for bit: the same job colocated and with a rollout pool of its own at
``async_training.staleness_threshold=0`` gives equal metrics (every key but timings and the pipeline's own) and
byte-equal final weights, for GRPO and PPO with a critic (the tiny task) and for the tool agent (the shipped model, its
calculator, 2 multi-turn steps; there the gen-vs-train gap metrics within 1e-5: ``ROLLOUT_GAP``). One local Ray shared
by the four runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.conftest import shared_ray, tiny_assets, tiny_overrides  # noqa: F401  (fixtures)

ROOT = Path(__file__).resolve().parents[2]
# the weight syncs in buckets of 10 KB: many per policy (every bucket's tensors land where one object's would)
SPLIT0 = {"actor_rollout_ref.hybrid_engine": "false", "async_training.staleness_threshold": 0,
          "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes": 0.01}
NOT_COMPARED = ("timing_s/", "async/", "agent/tool_latency_s", "perf/weight_sync_")
# the gen-vs-train gap: the HF rollout's log-probs depend on its batch in the last bits (rollout/hf_rollout.py), and
# the pool batches an agent's turns otherwise than the colocated loop; the trained weights and every other metric
# do not read them (on-policy), so these are compared within 1e-5, the rest bit for bit
ROLLOUT_GAP = ("rollout/logprob_diff_", "rollout_corr/")


def _run(overrides: list[str], out: Path) -> tuple[list[dict], bytes]:
    from verl_lite.trainer import main_ppo

    assert main_ppo.main(overrides + [f"trainer.output_dir={out}", f"trainer.default_local_dir={out / 'ckpt'}",
                                      "trainer.logger=[jsonl]"]) == 0
    (run_dir,) = [p.parent for p in out.glob("*/metrics.jsonl") if not p.parent.is_symlink()]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return records, (run_dir / "huggingface" / "model.safetensors").read_bytes()


def _compared(record: dict, skip: tuple = ()) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(NOT_COMPARED + skip)}


def _pair(overrides: list[str], out: Path, monkeypatch):
    monkeypatch.chdir(ROOT)  # recipes name the repository's files
    return (_run(overrides, out / "colocated"),
            _run(overrides + [f"{k}={v}" for k, v in SPLIT0.items()], out / "split0"))


def _assert_same(pair, rollout_gap_bitwise: bool = True):
    (sync_records, sync_weights), (split_records, split_weights) = pair
    assert [r.get("step") for r in sync_records] == [r.get("step") for r in split_records]
    skip = () if rollout_gap_bitwise else ROLLOUT_GAP
    for a, b in zip(sync_records, split_records):
        assert _compared(a, skip) == _compared(b, skip), a.get("step")
        gap = {k: (a[k], b.get(k)) for k in a if k.startswith(ROLLOUT_GAP)}
        assert all(v is not None and abs(u - v) <= 1e-5 for u, v in gap.values()), gap
        if a.get("step", 0) >= 1 and "actor/pg_loss" in a:  # the pool sampled it with the policy of the step before
            assert (b["async/staleness"], b["async/policy_version"]) == (0, a["step"] - 1)
    assert sync_weights == split_weights


@pytest.mark.parametrize("estimator", ["grpo", "gae"])  # the default job's estimator; PPO with a critic
def test_the_tiny_task(estimator, tiny_assets, shared_ray, tmp_path, monkeypatch):  # noqa: F811
    overrides = tiny_overrides(tiny_assets, **{"algorithm.adv_estimator": estimator, "trainer.total_training_steps": 3,
                                               "trainer.test_freq": 3, "actor_rollout_ref.actor.optim.lr": 1e-2})
    _assert_same(_pair(overrides, tmp_path, monkeypatch))


@pytest.mark.parametrize("recipe", ["tool_agent"])
def test_the_tool_agent(recipe, shared_ray, tmp_path, monkeypatch):  # noqa: F811
    overrides = ["--recipe", recipe, "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                 "actor_rollout_ref.rollout.n=4", "trainer.total_training_steps=2", "trainer.test_freq=0",
                 "trainer.val_before_train=false"]
    _assert_same(_pair(overrides, tmp_path, monkeypatch), rollout_gap_bitwise=False)
