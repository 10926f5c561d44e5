"""Extending a run with a decaying LR (verl's ``optim.use_checkpoint_opt_param_scheduler``).

A PPO run (actor + critic, both with warm-up 2 and linear decay) trains 2 steps and saves; the same
command with ``trainer.total_training_steps=4`` resumes it. verl's default (false) keeps the step
count and continues the NEW run's schedule, which decays over the new length; ``true`` keeps the
checkpoint's schedule, which has already decayed to ``min_lr``. The schedule counts RL steps (verl's rule):
RL step s trains at megatron's lr of schedule step s - 1 (the first step of a warm-up at 0), the same for its
2 optimizer steps (4 prompts, mini-batches of 2); the formula is written out here.
"""

from __future__ import annotations

import pytest

from tests.checkpoint.conftest import Run, metrics, overrides, run_to_end

LR, MIN_LR, WARMUP = 1e-4, 1e-5, 1
ROLES = {"actor": "actor_rollout_ref.actor.optim", "critic": "critic.optim"}


def expected_lr(k: int, decay_steps: int) -> float:
    """megatron's OptimizerParamScheduler at schedule step k (init_lr 0 with warm-up, linear decay)."""
    if k <= WARMUP:
        return LR * k / WARMUP
    if k > decay_steps:
        return MIN_LR
    return MIN_LR + (LR - MIN_LR) * (1.0 - (k - WARMUP) / (decay_steps - WARMUP))


def expected_step_lr(rl_step: int, total_rl_steps: int) -> float:
    return expected_lr(rl_step - 1, total_rl_steps)


def _args(assets, root, **extra) -> list[str]:
    schedule = {f"{section}.{key}": value for section in ROLES.values() for key, value in
                (("lr", LR), ("min_lr", MIN_LR), ("lr_warmup_steps", WARMUP), ("lr_decay_style", "linear"))}
    return overrides(assets, root, **{"algorithm.adv_estimator": "gae", "trainer.total_training_steps": 2,
                                      "trainer.n_gpus_per_node": 1,
                                      "trainer.save_freq": 2, **schedule, **extra})


def _check_lrs(rows: list[dict], steps: list[int], lr_of) -> None:
    assert [r["step"] for r in rows] == steps
    for r in rows:
        for role in ROLES:
            want = lr_of(r["step"])
            assert r[f"{role}/lr"] == pytest.approx(want, rel=1e-9, abs=1e-15), (role, r["step"], r[f"{role}/lr"], want)


def test_extending_a_decaying_run_follows_the_new_schedule_unless_asked(tiny_assets, tmp_path):
    run_to_end(_args(tiny_assets, tmp_path, **{"trainer.output_dir": str(tmp_path / "out1")}), tmp_path / "first.log")
    _check_lrs(metrics(tmp_path / "out1"), [1, 2], lambda s: expected_step_lr(s, 2))
    saved = tmp_path / "ckpt" / "global_step_2"

    # the same command, 4 steps: resumes at step 2 and continues the 4-step schedule (verl's default); and
    # (at the same time, to save wall time) use_checkpoint_opt_param_scheduler=true from the same checkpoint
    # into another directory: the checkpoint's 2-step schedule is kept (already at min_lr)
    extend = Run(_args(tiny_assets, tmp_path, **{"trainer.output_dir": str(tmp_path / "out2"),
                                                 "trainer.total_training_steps": 4}), tmp_path / "extended.log")
    keep = {f"{section}.use_checkpoint_opt_param_scheduler": "true" for section in ROLES.values()}
    other = tmp_path / "kept"
    kept = Run(_args(tiny_assets, other, **{"trainer.total_training_steps": 3, "trainer.resume_mode": "resume_path",
                                            "trainer.resume_from_path": str(saved), **keep}), other / "kept.log")
    for run in (extend, kept):
        assert run.wait(400) == 0, f"run failed:\n{run.text()[-4000:]}"

    rows = metrics(tmp_path / "out2")
    _check_lrs(rows, [3, 4], lambda s: expected_step_lr(s, 4))
    assert all(r[f"{role}/lr"] > MIN_LR for r in rows for role in ROLES)
    text = extend.text()
    for role in ROLES:
        line = next((ln for ln in text.splitlines() if f"{role} resumed at step 2:" in ln), None)
        assert line is not None, text[-3000:]
        assert (f"schedule step 2, lr schedule linear decay from {LR:g} to {MIN_LR:g} at step 4, warmup 1 "
                f"(this run's), next lr {expected_lr(2, 4):.6g}; the checkpoint's was linear decay from {LR:g} to "
                f"{MIN_LR:g} at step 2, warmup 1") in line, line

    _check_lrs(metrics(other / "out"), [3], lambda s: expected_step_lr(s, 2))
    text = kept.text()
    for role in ROLES:
        assert (f"{role} resumed at step 2: schedule step 2, lr schedule linear decay from {LR:g} to {MIN_LR:g} "
                f"at step 2, warmup 1 (kept from the checkpoint), next lr {MIN_LR:g}") in text, text[-3000:]
