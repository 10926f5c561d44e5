"""Exact resume: a run SIGKILLed after its step-2 checkpoint (in the middle of saving step 4) and
resumed gives the same steps 3-4 as a run that was never interrupted: metrics identical, final actor
weights bit-identical. Resumed at another layout (saved at DP2, resumed at TP2) the weights agree
to float noise. Half-written checkpoints are skipped with a message; the previous one is used."""

from __future__ import annotations

import shutil

import torch

from tests.checkpoint.conftest import (
    Run,
    hf_weights,
    metrics,
    overrides,
    wait_for,
    without_timing,
)

RELATIVE_TOL = 1e-6


def _kill_during_step4_save(assets, root):
    """Start the 4-step run; SIGKILL it (with its Ray and workers) while global_step_4 is being written."""
    run = Run(overrides(assets, root), root / "killed.log")
    ckpt = root / "ckpt"
    saving = wait_for(lambda: any(ckpt.glob(".tmp-global_step_4-*")), timeout=300, poll=0.002)
    run.kill()
    assert saving, f"the run never started saving step 4:\n{run.text()[-3000:]}"
    return ckpt


def _relative_diff(a: dict, b: dict) -> float:
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in a)
    den = sum(float(a[k].double().pow(2).sum()) for k in a)
    return (num / den) ** 0.5


def test_kill_resume_is_exact_and_skips_half_written(straight_run, tiny_assets, tmp_path):
    ckpt = _kill_during_step4_save(tiny_assets, tmp_path)
    assert (ckpt / "global_step_2" / "complete").is_file()
    assert not (ckpt / "global_step_4").exists(), "the killed save must not look like a checkpoint"
    # also a checkpoint directory whose save died before the marker (e.g. copied or older format)
    shutil.copytree(ckpt / "global_step_2", ckpt / "global_step_3")
    (ckpt / "global_step_3" / "complete").unlink()

    # the resume (auto: the newest complete checkpoint) and, at the same time (to save wall time), the same
    # step-2 checkpoint resumed at another layout (TP2 instead of DP2) into a directory of its own
    resume = Run(overrides(tiny_assets, tmp_path, **{"trainer.output_dir": str(tmp_path / "out2")}),
                 tmp_path / "resumed.log")
    other = tmp_path / "tp2"
    tp2_run = Run(overrides(tiny_assets, other, **{
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": 2,
        "trainer.resume_mode": "resume_path", "trainer.resume_from_path": str(ckpt / "global_step_2")}),
        other / "resumed.log")
    for run, rc in [(run, run.wait(400)) for run in (resume, tp2_run)]:
        assert rc == 0, f"run failed:\n{run.text()[-4000:]}"
    text = resume.text()
    assert "skipping" in text and "global_step_3: no 'complete' marker" in text, text[-3000:]
    assert ".tmp-global_step_4" in text and "a save that did not finish" in text
    assert f"resumed from {ckpt / 'global_step_2'} (step 2" in text

    resumed = metrics(tmp_path / "out2")
    straight = {r["step"]: r for r in straight_run["metrics"]}
    assert [r["step"] for r in resumed] == [3, 4]
    for r in resumed:
        assert without_timing(r) == without_timing(straight[r["step"]]), r["step"]
    final = hf_weights(ckpt / "global_step_4" / "huggingface")
    ref = hf_weights(straight_run["ckpt"] / "global_step_4" / "huggingface")
    assert final.keys() == ref.keys()
    for k in ref:
        assert torch.equal(final[k], ref[k]), k

    # the same checkpoint resumed at another layout: TP2 instead of DP2
    text = tp2_run.text()
    assert "not restored: the layout differs" in text
    rows = metrics(other / "out")
    assert [r["step"] for r in rows] == [3, 4]
    for r in rows:
        s = straight[r["step"]]
        assert r.keys() == s.keys()
        for k, v in without_timing(r).items():
            if isinstance(v, float):
                assert abs(v - s[k]) <= 1e-4 * max(1.0, abs(s[k])), (r["step"], k, v, s[k])
            else:
                assert v == s[k], (r["step"], k)
    tp2 = hf_weights(other / "ckpt" / "global_step_4" / "huggingface")
    assert _relative_diff(ref, tp2) <= RELATIVE_TOL, _relative_diff(ref, tp2)


def test_retention_keeps_newest(straight_run, tiny_assets, tmp_path):
    """max_actor_ckpt_to_keep=1 with a resume that adds nothing new keeps exactly the newest checkpoint."""
    src = straight_run["ckpt"]
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    from omegaconf import OmegaConf

    from verl_lite.trainer.checkpointing import CheckpointManager, list_checkpoints

    cfg = OmegaConf.create({"trainer": {"default_local_dir": str(dst), "project_name": "p", "experiment_name": "e",
                                        "save_freq": 2, "max_actor_ckpt_to_keep": 1, "resume_mode": "auto",
                                        "resume_from_path": None}})
    mgr = CheckpointManager(cfg)
    assert [s for s, _ in list_checkpoints(dst)] == [2, 4]
    mgr._retain()
    assert [s for s, _ in list_checkpoints(dst)] == [4]
    assert not list(dst.glob(".old-*"))
