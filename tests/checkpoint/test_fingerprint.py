"""A checkpoint records what it was trained from (verl_lite.trainer.fingerprint): the model, the train
data and the math keys. A run with other data in the same checkpoint directory is refused before Ray
starts, naming the difference and the key that overrides it; the same run resumes; layout keys do not
count; the override resumes anyway; a checkpoint saved without a fingerprint is resumed and says so."""

from __future__ import annotations

import json

import pytest

from tests.checkpoint.conftest import copy_checkpoints, overrides, reseal, run_refused
from verl_lite.trainer.fingerprint import FILE, OVERRIDE_KEY


def _other_train_file(assets: dict, path) -> str:
    """The tiny train split minus its last rows: valid data, but not the data the checkpoint saw."""
    import pyarrow.parquet as pq

    table = pq.read_table(assets["train"])
    pq.write_table(table.slice(0, table.num_rows - 8), path)
    return str(path)


def _manager(assets: dict, root, **extra):
    from verl_lite.config import load_config
    from verl_lite.trainer.checkpointing import CheckpointManager

    return CheckpointManager(load_config(overrides(assets, root, **extra)))


def test_the_saved_fingerprint_is_the_runs(straight_run, tiny_assets, tmp_path):
    """What the save wrote equals what the same config computes now; the file is in the manifest."""
    ckpt = straight_run["ckpt"] / "global_step_4"
    saved = json.loads((ckpt / FILE).read_text())
    assert FILE in json.loads((ckpt / "complete").read_text())["files"]
    mgr = _manager(tiny_assets, straight_run["root"], **{"trainer.logger": "[console,jsonl,tensorboard,wandb]",
                                                        "trainer.log_freq": 2})
    assert saved == json.loads(json.dumps(mgr.fingerprint()))
    assert saved["model"]["weights"] and saved["model"]["config"] and saved["data"]["sha256"][0]


def test_other_data_in_the_same_directory_is_refused_before_ray(straight_run, tiny_assets, tmp_path):
    root = copy_checkpoints(straight_run["ckpt"], tmp_path / "ckpt", steps=(4,))
    other = _other_train_file(tiny_assets, tmp_path / "other.parquet")
    rc, text = run_refused(overrides(tiny_assets, tmp_path, **{"data.train_files": other,
                                                               "trainer.total_training_steps": 6}),
                           tmp_path / "refused.log")
    assert rc == 2, text[-3000:]
    assert f"{root / 'global_step_4'} was trained by another run" in text
    assert "the training data (data.train_files: saved [train.parquet], now [other.parquet])" in text
    assert f"{OVERRIDE_KEY}=true" in text and "trainer.resume_mode=disable" in text
    assert "Traceback" not in text and "resumed from" not in text
    assert all(not p.read_text().strip() for p in (tmp_path / "out").glob("*/metrics.jsonl"))  # no step ran


def test_math_keys_refuse_layout_keys_do_not_and_the_override_resumes(straight_run, tiny_assets, tmp_path, capsys):
    from verl_lite.trainer.checkpointing import CheckpointRefused

    copy_checkpoints(straight_run["ckpt"], tmp_path / "ckpt", steps=(4,))
    same = _manager(tiny_assets, tmp_path, **{"trainer.n_gpus_per_node": 1, "trainer.total_training_steps": 6,
                                              "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 1})
    same.prepare_resume()  # another layout and micro-batch size: the same math
    assert same._checked[0].name == "global_step_4"

    lr = {"actor_rollout_ref.actor.optim.lr": 3e-4, "algorithm.adv_estimator": "rloo",
          "algorithm.rollout_correction.rollout_is": "token", "distillation.distillation_loss.loss_mode": "k1"}
    with pytest.raises(CheckpointRefused) as refused:
        _manager(tiny_assets, tmp_path, **lr).prepare_resume()
    message = str(refused.value)
    assert "actor_rollout_ref.actor.optim.lr (saved 0.0001, now 0.0003)" in message
    assert "algorithm.adv_estimator (saved 'grpo', now 'rloo')" in message and "the training data" not in message
    assert "algorithm.rollout_correction.rollout_is (saved None, now 'token')" in message
    assert "distillation.distillation_loss.loss_mode (saved 'k3', now 'k1')" in message

    forced = _manager(tiny_assets, tmp_path, **lr, **{OVERRIDE_KEY: "true"})
    forced.prepare_resume()
    assert forced._checked[0].name == "global_step_4"
    assert f"although it differs ({OVERRIDE_KEY}=true)" in capsys.readouterr().err


def test_a_checkpoint_without_fingerprint_resumes_and_says_so(straight_run, tiny_assets, tmp_path, capsys):
    root = copy_checkpoints(straight_run["ckpt"], tmp_path / "ckpt", steps=(4,))
    (root / "global_step_4" / FILE).unlink()
    reseal(root / "global_step_4")
    mgr = _manager(tiny_assets, tmp_path, **{"actor_rollout_ref.actor.optim.lr": 3e-4})
    mgr.prepare_resume()
    assert mgr._checked[0].name == "global_step_4"
    assert "saved without a fingerprint" in capsys.readouterr().err
