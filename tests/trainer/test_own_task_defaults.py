"""A task of one's own gets no silent default of the shipped one (issue 23, items 1, 3 and 6):

- the run name and checkpoint directory come from the data and the model, so a run with other data
  never lands in (and resumes from) the default job's checkpoints; a loaded config holds them;
- own train data without val files: no validation, and the summary says so (CLI run), and the
  console's ETA appears once two trained steps are measured (not from the first, which warms up);
- ``model.path`` as an HF hub id: fetched from the HF cache (a fake cache in huggingface_hub's layout,
  offline) and pre-flight passes; not cached and offline (CLI) or no network: one line, exit 2, how to
  pass a local directory, and no second problem about a tokenizer_path the user never set.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import tiny_assets, tiny_overrides  # noqa: F401  (fixture)

REPO = Path(__file__).resolve().parents[2]


def _cli(args: list[str], env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "verl_lite.trainer.main_ppo", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})))


# ---------------------------------------------------------------------------- names and val files
def test_run_names_come_from_the_data_and_the_model(tmp_path):
    from verl_lite.config import config_to_dict, default_model_path, load_config
    from verl_lite.config.loader import use_train_data
    from verl_lite.data.dataset import IN_MEMORY

    default = load_config([])
    assert default.trainer.experiment_name == "grpo_synthetic-addition-train_tiny-addition"
    assert default.trainer.default_local_dir == str(Path.cwd() / "checkpoints" / "verl_lite" /
                                                    default.trainer.experiment_name)
    assert default.data.val_files and default.data.val_files[0].endswith("synthetic-addition/val.parquet")

    own = load_config([f"data.train_files={tmp_path / 'reverse.parquet'}", "algorithm.adv_estimator=rloo"])
    assert own.trainer.experiment_name == "rloo_reverse_tiny-addition"
    assert own.trainer.default_local_dir != default.trainer.default_local_dir  # never the default job's checkpoints
    assert own.data.val_files == []  # own train data, no val files: no validation, not the shipped val split
    trainer = config_to_dict(own)["trainer"]
    assert None not in (trainer["experiment_name"], trainer["default_local_dir"])  # what config.json holds

    split = load_config([f"data.train_files={tmp_path / 'gsm8k' / 'train.parquet'}",
                         f"actor_rollout_ref.model.path={default_model_path()}/"])
    assert split.trainer.experiment_name == "grpo_gsm8k-train_tiny-addition"  # a split's stem: its directory too
    named = load_config([f"data.train_files={tmp_path / 'a.parquet'}", "trainer.experiment_name=mine"])
    assert named.trainer.experiment_name == "mine" and named.trainer.default_local_dir.endswith("/verl_lite/mine")

    # the Python API's train_dataset: the derived names follow it, the shipped val split goes with the shipped train
    api = load_config([])
    use_train_data(api, IN_MEMORY)
    assert api.trainer.experiment_name == "grpo_in-memory-dataset_tiny-addition" and api.data.val_files == []
    assert api.trainer.default_local_dir.endswith("/grpo_in-memory-dataset_tiny-addition")
    kept = load_config(["trainer.experiment_name=mine", "data.val_files=/x/v.parquet"])
    use_train_data(kept, IN_MEMORY)
    assert kept.trainer.experiment_name == "mine" and kept.data.val_files == ["/x/v.parquet"]


def test_own_data_without_val_files_has_no_validation_and_the_eta_waits_for_two_steps(tiny_assets, tmp_path):
    args = tiny_overrides(tiny_assets, **{"data.val_files": "null", "trainer.test_freq": 1,
                                          "trainer.val_before_train": "true", "trainer.total_training_steps": 3,
                                          "trainer.output_dir": str(tmp_path), "trainer.logger": "[console,jsonl]"})
    res = _cli(args)
    assert res.returncode == 0, res.stderr[-4000:]
    run_dir = next(p for p in tmp_path.iterdir() if p.is_dir() and not p.is_symlink())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and not any("val/accuracy" in r for r in rows)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["no_validation"] == "no validation set: data.val_files is empty" and summary["val_steps"] == []
    assert "no validation (no validation set: data.val_files is empty)" in res.stdout
    assert json.loads((run_dir / "config.json").read_text())["data"]["val_files"] == []

    etas = {int(m.group(1)): m.group(2) for m in re.finditer(r" step (\d+)/3 .*?\| eta (\S+) \|", res.stdout)}
    assert etas.keys() == {1, 2, 3}, res.stdout
    assert etas[1] == "-" and etas[2] != "-"  # the first step warms up: no estimate from it alone


def test_summary_line_names_the_first_and_last_validated_steps():
    from verl_lite.trainer.training_run import accuracy_line

    once = {"initial_val_accuracy": 0.352, "final_val_accuracy": 0.352, "initial_val_step": 2, "final_val_step": 2}
    assert accuracy_line(once) == "held-out accuracy 0.352 (validated once, at step 2)"
    both = dict(once, initial_val_accuracy=0.1, initial_val_step=0)
    assert accuracy_line(both) == ("held-out accuracy 0.100 (first validated step 0) -> 0.352 (last validated "
                                   "step 2), +25.2 points")
    none = {"initial_val_accuracy": None, "no_validation": "trainer.test_freq <= 0 and trainer.val_before_train=false"}
    assert accuracy_line(none) == "no validation (trainer.test_freq <= 0 and trainer.val_before_train=false)"


# ---------------------------------------------------------------------------- HF hub ids
def _fake_hub_cache(model_dir: str, root: Path, repo: str = "tiny-org/tiny-model") -> Path:
    """``model_dir`` laid out as huggingface_hub's cache holds a downloaded snapshot of ``repo``."""
    entry = root / f"models--{repo.replace('/', '--')}"
    revision = "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(model_dir, entry / "snapshots" / revision)
    (entry / "refs").mkdir()
    (entry / "refs" / "main").write_text(revision)
    return entry / "snapshots" / revision


@pytest.fixture
def offline_hub(tmp_path, monkeypatch):
    """huggingface_hub offline, with an empty cache of its own (this process: the constants it reads)."""
    from huggingface_hub import constants

    cache = tmp_path / "hf_cache"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def test_a_cached_hub_id_resolves_and_passes_preflight(tiny_assets, offline_hub):
    from verl_lite.config import load_config
    from verl_lite.trainer.ppo_trainer import PPOTrainer

    snapshot = _fake_hub_cache(tiny_assets["model"], offline_hub)
    cfg = load_config(tiny_overrides(tiny_assets, **{"actor_rollout_ref.model.path": "tiny-org/tiny-model"}))
    m = cfg.actor_rollout_ref.model
    assert Path(m.path) == snapshot and Path(m.tokenizer_path) == snapshot
    assert cfg.trainer.experiment_name.endswith("_tiny-model")  # the repository's name, not the revision hash
    trainer = PPOTrainer(cfg)  # pre-flight: config, model files, tokenizer, data, reward (nothing started)
    try:
        assert len(trainer.train_dataset) == 64 and trainer.tokenizer is not None
    finally:
        trainer.reward_manager.close()


def test_a_hub_id_without_network_is_one_line(tiny_assets, tmp_path):
    """Offline (HF_HUB_OFFLINE=1) and not cached, through the CLI: one problem line, exit 2."""
    res = _cli(["actor_rollout_ref.model.path=tiny-org/not-cached", "trainer.total_training_steps=1"],
               env={"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "empty_cache")}, timeout=120)
    assert res.returncode == 2, res.stderr[-3000:]
    problems = [ln for ln in res.stderr.splitlines() if ln.startswith("  - ")]
    assert len(problems) == 1, res.stderr
    line = problems[0]
    assert "actor_rollout_ref.model.path='tiny-org/not-cached' is neither a local directory nor in the HF cache" in line
    assert "HF_HUB_OFFLINE is set" in line and "pass the local directory: actor_rollout_ref.model.path=DIR" in line
    assert "tokenizer_path" not in res.stderr and "Traceback" not in res.stderr


def test_a_hub_id_with_the_hub_unreachable_is_one_line_at_once(tiny_assets, tmp_path):
    """Online mode, not cached, the hub unreachable (a closed loopback port as HF_ENDPOINT), through the CLI:
    one problem line, exit 2, and no request retried (the hub client's back-off, 5 retries per request, took
    51 s and printed 10 'Retrying' lines before the line; the tokenizer's loader retried after the model's)."""
    res = _cli(["actor_rollout_ref.model.path=tiny-org/not-cached", "trainer.total_training_steps=1"],
               env={"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_CACHE": str(tmp_path / "empty_cache")}, timeout=120)
    assert res.returncode == 2, res.stderr[-3000:]
    problems = [ln for ln in res.stderr.splitlines() if ln.startswith("  - ")]
    assert len(problems) == 1 and "and there is no network" in problems[0], res.stderr
    assert "Retrying" not in res.stdout + res.stderr and "Traceback" not in res.stderr, res.stderr[-3000:]


def test_no_network_is_said(offline_hub, monkeypatch):
    """Online mode but the hub unreachable (a closed local port as its endpoint)."""
    from huggingface_hub import constants

    from verl_lite.engine.model_files import model_dir_problem, resolve_model_dir

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    assert resolve_model_dir("tiny-org/unreachable") == "tiny-org/unreachable"
    line = model_dir_problem("actor_rollout_ref.model.path", "tiny-org/unreachable")
    assert "nor in the HF cache, and there is no network" in line and "hf download tiny-org/unreachable" in line
    missing = model_dir_problem("actor_rollout_ref.model.path", "/no/such/dir")
    assert "is not an HF model directory" in missing  # an absolute path is never taken for a hub id


def test_curves_are_drawn_beside_the_shutdown_and_a_failed_plot_is_a_warning(tmp_path, capsys):
    """The run's end draws curves.png in a thread while the workers stop; the file is whole when the summary is
    written, and a plot that cannot be written is one warning, never the run's error."""
    from verl_lite.trainer.training_run import PLOT_TIMEOUT_S, _draw_in_background

    records = [{"step": s, "reward/mean": 0.1 * s, "val/accuracy": 0.2 * s} for s in (1, 2, 3)]
    thread = _draw_in_background(records, tmp_path / "curves.png")
    thread.join(PLOT_TIMEOUT_S)
    assert not thread.is_alive() and (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert capsys.readouterr().err == ""
    thread = _draw_in_background(records, tmp_path / "no_such_dir" / "curves.png")
    thread.join(PLOT_TIMEOUT_S)
    err = capsys.readouterr().err
    assert "verl_lite: warning: could not draw" in err and "no_such_dir" in err, err
