"""Shared runs for the checkpoint tests: the CLI driver as a subprocess (so it can be SIGKILLed).

Every run trains the tiny e2e model (hidden 32, 2 layers) for a few steps with 4 prompts x 2
samples; its overrides are :func:`overrides`. ``Run`` starts ``python -m verl_lite.trainer.main_ppo``
in its own process group and can kill it with everything it started (Ray, workers) by pid.
The tiny assets and :func:`straight_run` are built once per pytest run (:func:`built_once`): its
pytest-xdist workers share them.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

import tests.e2e.conftest as e2e
from tests.e2e.conftest import tiny_overrides
from tests.faults.conftest import MARK_ENV, stop_marked

REPO = Path(__file__).resolve().parents[2]
TIMING_PREFIX = "timing_s/"


def overrides(assets: dict, root: Path, **extra) -> list[str]:
    """The e2e tiny run, sized for checkpoint tests: 4 steps, a checkpoint every 2, 2 workers."""
    return tiny_overrides(assets, **{
        "actor_rollout_ref.rollout.n": 2,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 4,
        "trainer.total_training_steps": 4,
        "trainer.test_freq": -1,
        "trainer.val_before_train": "false",
        "trainer.save_freq": 2,
        "trainer.n_gpus_per_node": 2,
        "trainer.output_dir": str(root / "out"),
        "trainer.default_local_dir": str(root / "ckpt"),
        "trainer.logger": "[jsonl]",
        **extra,
    })


class Run:
    """One CLI run in its own session; ``kill()`` SIGKILLs the driver and every process of the run (its tree, then
    every process carrying the run's marker)."""

    def __init__(self, args: list[str], log: Path, env: dict | None = None):
        self.log = log
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = open(log, "w")
        self.marker = uuid.uuid4().hex  # in every process of the run, those forked after a tree() snapshot too
        full_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}), **{MARK_ENV: self.marker})
        self.proc = subprocess.Popen([sys.executable, "-m", "verl_lite.trainer.main_ppo", *args], cwd=REPO,
                                     stdout=self._log_file, stderr=subprocess.STDOUT, env=full_env,
                                     start_new_session=True)

    def wait(self, timeout: float = 300) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self._log_file.close()

    def tree(self) -> list[psutil.Process]:
        try:
            root = psutil.Process(self.proc.pid)
            return [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def kill(self) -> None:
        """SIGKILL the driver, then every descendant recorded just before (by pid)."""
        procs = self.tree()
        for p in procs:
            try:
                p.send_signal(signal.SIGKILL)
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=20)
        # and whatever the snapshot missed (a worker's forked checkpoint writers: the reaper that would sweep them
        # was in the tree), by the run's marker
        left = stop_marked(self.marker)
        assert not left, f"processes of the killed run still alive: {left}"
        self.proc.wait(30)
        self._log_file.close()

    def text(self) -> str:
        return self.log.read_text()


def run_to_end(args: list[str], log: Path, env: dict | None = None, timeout: float = 400) -> str:
    run = Run(args, log, env)
    rc = run.wait(timeout)
    text = run.text()
    assert rc == 0, f"run failed (rc={rc}):\n{text[-4000:]}"
    return text


def metrics(out_dir: Path) -> list[dict]:
    files = sorted(p for p in Path(out_dir).glob("*/metrics.jsonl") if not p.parent.is_symlink())
    assert files, f"no metrics.jsonl under {out_dir}"
    return [json.loads(line) for line in files[-1].read_text().splitlines()]


def without_timing(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(TIMING_PREFIX)}


def wait_for(predicate, timeout: float, poll: float = 0.01) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(poll)
    return False


def hf_weights(directory: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(Path(directory) / "model.safetensors"))


def built_once(tmp_path_factory, name: str, build: Callable[[Path], dict]) -> dict:
    """``build(directory)`` done by the first process of this pytest run that asks, its JSON-able result kept
    beside it and read back by the others (pytest-xdist's workers: each would otherwise build its own)."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base  # the workers' basetemps' parent
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        done = shared / f"{name}.json"
        if done.is_file():
            return json.loads(done.read_text())
        directory = shared / name
        shutil.rmtree(directory, ignore_errors=True)  # what a build that failed left
        directory.mkdir()
        result = build(directory)
        done.write_text(json.dumps(result))
        return result


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory):
    """tests/e2e's tiny assets, built once per pytest run: a checkpoint's fingerprint holds the reward file's
    path, so the workers that share :func:`straight_run` must share these too."""
    return built_once(tmp_path_factory, "tiny_assets", e2e.build_tiny_assets)


@pytest.fixture(scope="session")
def straight_run(tiny_assets, tmp_path_factory):
    """4 steps at DP2 without interruption, checkpoints at 2 and 4; all four loggers (W&B offline). Built once
    per pytest run; every test reads it or copies from it."""

    def build(root: Path) -> dict:
        args = overrides(tiny_assets, root, **{"trainer.logger": "[console,jsonl,tensorboard,wandb]",
                                               "trainer.log_freq": 2})
        text = run_to_end(args, root / "driver.log", env={"WANDB_MODE": "offline", "WANDB_SILENT": "true"})
        return {"root": str(root), "log": text, "metrics": metrics(root / "out"), "ckpt": str(root / "ckpt")}

    run = built_once(tmp_path_factory, "straight", build)
    return {**run, "root": Path(run["root"]), "ckpt": Path(run["ckpt"])}


# ---------------------------------------------------------------------------- damaged / crafted checkpoints
def copy_checkpoints(src_root: Path, dst_root: Path, steps=(2, 4)) -> Path:
    """A private copy of some ``global_step_K`` directories of a saved run (to damage or craft); returns ``dst_root``."""
    import shutil

    for step in steps:
        shutil.copytree(src_root / f"global_step_{step}", dst_root / f"global_step_{step}")
    return dst_root


def reseal(checkpoint: Path) -> None:
    """Rewrite the checkpoint's manifest to match its files as they are now: what someone crafting a whole
    checkpoint directory would do, so that the checks behind the manifest are what is tested."""
    from verl_lite.trainer.checkpointing import COMPLETE, MANIFEST_KEY, build_manifest

    marker = json.loads((checkpoint / COMPLETE).read_text())
    marker[MANIFEST_KEY] = build_manifest(checkpoint)
    (checkpoint / COMPLETE).write_text(json.dumps(marker))


def run_refused(args: list[str], log: Path, timeout: float = 300) -> tuple[int, str]:
    """A CLI run expected to stop before training: (exit code, its output)."""
    run = Run(args, log)
    rc = run.wait(timeout)
    return rc, run.text()


def export_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """``python -m verl_lite.trainer.export ARGS`` from the repository root."""
    return subprocess.run([sys.executable, "-m", "verl_lite.trainer.export", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)
