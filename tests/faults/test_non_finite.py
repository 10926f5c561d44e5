"""The fault matrix, non-finite training: a NaN / inf loss or gradient norm stops the run at that
step, through the real ``python -m verl_lite.trainer.main_ppo``, with one message naming the step
and the role, exit 1, ``status: failed``, and nothing of the bad step written as if it were good:
no metrics line for it, no checkpoint after it, no exported policy. (A NaN / inf reward is refused
earlier, naming the reward function: ``test_runtime_faults.py::test_reward_fault_stops_the_run``.)

- actor: a learning rate that blows the weights up (lr 1e10: Adam moves each weight by ~lr, so step 2's
  forward overflows float32 and its gradient norm is NaN on any machine; at lr 1e4 the softmax only
  saturated, and whether that gave NaN or a zero gradient depended on the CPU): step 1 trains and is
  checkpointed (``save_freq=1``), and the step-2 update's gradient norm is NaN.
- critic: a reward on the wrong scale (1e30 per digit) under GAE: the value loss overflows to inf
  at step 1, before the actor is touched.
"""

import json
import re

import pytest

from tests.faults.conftest import CliRun, tiny_assets, tiny_overrides  # noqa: F401

HUGE_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 1e30 * sum(c.isdigit() for c in solution_str)
'''

CASES = [
    # id, overrides, the step that fails, the message
    ("actor_lr_blows_up", {"actor_rollout_ref.actor.optim.lr": 1e10, "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
                           "trainer.total_training_steps": 3, "trainer.save_freq": 1}, 2,
     r"step 2: the actor's gradient norm is nan at its optimizer step 2 .*not finite; the run stopped there"),
    ("critic_loss_overflows", {"algorithm.adv_estimator": "gae", "trainer.total_training_steps": 1}, 1,
     r"step 1: the critic's gradient norm is inf at its optimizer step 1 \(loss inf\), not finite"),
]


@pytest.mark.parametrize("name,extra,bad_step,pattern", CASES, ids=[c[0] for c in CASES])
def test_non_finite_step_stops_the_run(name, extra, bad_step, pattern, tiny_assets, tmp_path):  # noqa: F811
    overrides = {"trainer.val_before_train": "false", "trainer.test_freq": -1, "trainer.logger": "[jsonl]",
                 "trainer.output_dir": str(tmp_path / "runs"), "trainer.default_local_dir": str(tmp_path / "ckpt"),
                 **extra}
    if name.startswith("critic"):
        (tmp_path / "huge_reward.py").write_text(HUGE_REWARD)
        overrides["reward.custom_reward_function.path"] = str(tmp_path / "huge_reward.py")
    run = CliRun(tiny_overrides(tiny_assets, **overrides)).wait(timeout=300)
    assert run.code == 1, f"exit {run.code}:\n{run.err[-4000:]}"
    assert "Traceback" not in run.err, run.err[-4000:]
    errors = [ln for ln in run.err.splitlines() if ln.startswith("verl_lite: ") and not ln.startswith("verl_lite: warning")]
    assert len(errors) == 1 and re.search(pattern, errors[0]), f"/{pattern}/ is not the one message:\n{run.err[-4000:]}"
    assert run.leftover() == [], "processes of the run left behind"

    run_dir = tmp_path / "runs" / "latest"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["steps"] == bad_step - 1, summary
    logged = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(1, bad_step)), f"metrics.jsonl holds steps {logged}"
    saved = sorted(p.name for p in (tmp_path / "ckpt").glob("global_step_*")) if (tmp_path / "ckpt").exists() else []
    assert saved == [f"global_step_{k}" for k in range(1, bad_step) if extra.get("trainer.save_freq")], saved
    assert not (run_dir / "huggingface").exists(), "the final policy was exported after a non-finite step"
