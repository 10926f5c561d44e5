"""``trainer.v1.trainer_mode=separate_async`` through the real trainer (one local Ray, the tiny default job):
trajectories stream through the rollout pool, each step takes the oldest complete groups within
``max_off_policy_threshold``, updated weights land while trajectories run; and a run stopped right after a
checkpoint (its driver SIGKILLed mid-pipeline) resumes with no step repeated or skipped and every prompt it had
pulled trained (verl #7933)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.e2e.conftest import shared_ray, tiny_assets, tiny_overrides  # noqa: F401  (fixtures)

ROOT = Path(__file__).resolve().parents[2]

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
        self.rewards: dict[int, list[float]] = {}

    def on_step_end(self, step, metrics, **kwargs):  # before on_save (a stop there still sees the step)
        from verl_lite.trainer.tracking import COMPLETIONS_KEY

        if COMPLETIONS_KEY in metrics:
            self.by_step[step] = [row["prompt"] for row in metrics[COMPLETIONS_KEY]]
            self.rewards[step] = [row["reward"] for row in metrics[COMPLETIONS_KEY]]


class _RecordAndMark(_Prompts):
    """In the run that is killed: each step's prompts appended to ``log`` as they are trained, ``marker`` written
    once the step-``at`` checkpoint is saved."""

    def __init__(self, log: str, marker: str, at: int):
        super().__init__()
        self.log, self.marker, self.at = log, marker, at

    def on_step_end(self, step, metrics, **kwargs):
        super().on_step_end(step, metrics)
        with open(self.log, "a") as out:
            out.write(json.dumps({"step": step, "prompts": self.by_step.get(step, [])}) + "\n")

    def on_save(self, step):
        if step == self.at:
            Path(self.marker).write_text(str(step))


KILLED_RUN = """
import json, sys
from tests.async_rl.test_streamed import _fit, _RecordAndMark
assets, out, log, marker, keys = json.loads(sys.argv[1])
_fit(assets, out, [_RecordAndMark(log, marker, at=2)], **keys)
"""


def _fit(assets, tmp_path, callbacks=(), **extra):
    from verl_lite.config import load_config
    from verl_lite.trainer.ppo_trainer import PPOTrainer

    cfg = load_config(tiny_overrides(assets, **{**KEYS, "trainer.output_dir": str(tmp_path), **extra}))
    records = PPOTrainer(cfg, callbacks=list(callbacks), log_completions=True).fit()
    return [r for r in records if r.get("step", 0) >= 1 and "actor/pg_loss" in r]


# colocate_async: the actor's own workers stream, paused while they train; validation (the end of the run) samples
# on the same rollout, pausing the stream
MODES = {"separate_async": {}, "colocate_async": {"trainer.v1.trainer_mode": "colocate_async", "trainer.test_freq": STEPS}}


@pytest.mark.parametrize("mode", MODES)
def test_streamed_steps_stay_within_the_bound_and_train_every_prompt_once(tiny_assets, shared_ray, tmp_path, mode):  # noqa: F811
    """With DAPO's dynamic sampling on: a step takes further complete groups in place of those without spread."""
    prompts = _Prompts()
    records = _fit(tiny_assets, tmp_path, [prompts], **{"algorithm.filter_groups.enable": "true",
                                                       "algorithm.filter_groups.metric": "score", **MODES[mode]})
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    if mode == "colocate_async":  # validation sampled beside the paused stream, and the run went on to its end
        assert 0.0 <= records[-1]["val/accuracy"] <= 1.0
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
    # dynamic sampling: every trained group has spread in its scores; the dropped ones were replaced
    rewards = [r for step in sorted(prompts.rewards) for r in prompts.rewards[step]]
    assert all(len(set(rewards[g:g + N])) > 1 for g in range(0, len(rewards), N))
    assert all((r["dynamic_sampling/groups_dropped"] == 0) == (r["dynamic_sampling/generation_rounds"] == 1)
               for r in records)
    print("groups dropped per step:", [r["dynamic_sampling/groups_dropped"] for r in records])


@pytest.mark.parametrize("mode", MODES)
def test_a_stream_killed_mid_pipeline_resumes_with_no_step_repeated_or_skipped(tiny_assets, shared_ray, tmp_path,  # noqa: F811
                                                                               mode):
    """The driver is SIGKILLed right after its step-2 checkpoint, while the stream is running (groups outstanding,
    trajectories generating); the resumed run trains steps 3-5: no step repeated or skipped (verl #7933), no
    prompt trained twice, every prompt pulled and not trained before the kill trained after it."""
    keys = {"trainer.default_local_dir": str(tmp_path / "ckpt"), "trainer.save_freq": 2,
            "trainer.v1.trainer_mode": mode}
    log, marker = tmp_path / "steps.jsonl", tmp_path / "saved"
    # the killed driver starts a local Ray of its own, as the CLI does (its reaper stops it when the driver dies)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    args = [tiny_assets, str(tmp_path / "first"), str(log), str(marker), keys]
    driver = subprocess.Popen([sys.executable, "-c", KILLED_RUN, json.dumps(args)], env=env, cwd=ROOT,
                              stdout=subprocess.DEVNULL, stderr=open(tmp_path / "killed_run.log", "wb"))
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert driver.poll() is None, (tmp_path / "killed_run.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (tmp_path / "killed_run.log").read_text()[-3000:]
            time.sleep(0.05)
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait(60)
    first = _Prompts()
    for line in log.read_text().splitlines():
        record = json.loads(line)
        if record["step"] <= 2:  # a step that ran past the checkpoint before the kill is not in it
            first.by_step[record["step"]] = record["prompts"]
    state = torch.load(tmp_path / "ckpt" / "global_step_2" / "async_pipeline.pt", weights_only=True)
    assert state["policy_version"] == 2
    pulled = [row for item in state["in_flight"] for row in item["rows"]]
    assert len(pulled) >= BATCH  # at least the next step's prompts were outstanding
    # the saved prompts are a stream's: resuming them as one-step-off batches is refused before any worker starts
    from verl_lite.trainer.checkpointing import CheckpointRefused

    with pytest.raises(CheckpointRefused, match="streamed run's prompts"):
        _fit(tiny_assets, tmp_path / "refused", **{**keys, "trainer.v1.trainer_mode": "sync",
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
