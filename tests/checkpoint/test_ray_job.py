"""``ray job submit`` as the README documents it: the test starts the README's loopback Ray head (its
command read from the README, on free ports, with its own temp dir and HOME, so Ray's default token
authentication writes its token there), submits a 3-step job with ``--working-dir`` and no Ray
variables exported by hand, waits for SUCCEEDED, finds the metrics and the checkpoint under the absolute
``trainer.default_local_dir``, and stops only the processes it started (by a marker in their
environment), every one of them."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from tests.checkpoint.conftest import metrics, overrides
from tests.faults.conftest import processes_of, readme_loopback_head, stop_marked

BIN = Path(sys.executable).parent


def _submit_when_the_job_agent_is_up(command: list[str], env: dict, cwd: str,
                                     agent_wait_s: float = 90.0) -> subprocess.CompletedProcess:
    """``ray start`` returns before the head's dashboard agent has registered; until it has, the
    head answers a submission with "No available agent to submit job" (HTTP 500) and accepts
    nothing, so resubmitting is safe. Bounded: after ``agent_wait_s`` the last answer is returned."""
    deadline = time.monotonic() + agent_wait_s
    while True:
        res = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=cwd)
        if "No available agent" not in res.stdout + res.stderr or time.monotonic() > deadline:
            return res
        time.sleep(1.0)


@pytest.mark.skipif(shutil.which("ray", path=str(BIN)) is None, reason="the ray CLI is not installed next to python")
def test_ray_job_submit_loopback_head(tiny_assets, tmp_path):
    home = Path(tempfile.mkdtemp(prefix="vlh", dir="/tmp"))  # short: Ray's socket paths live under it
    marker = uuid.uuid4().hex
    unset_ray = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    argv, env, ports = readme_loopback_head(str(home / "r"), marker, base_env=unset_ray)
    env.update(HOME=str(home), PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", OMP_NUM_THREADS="1")
    dash = ports["--dashboard-port"]
    try:
        subprocess.run(argv, env=env, check=True, capture_output=True, text=True, timeout=120)
        workdir = tmp_path / "job"
        workdir.mkdir()
        shutil.copy(tiny_assets["reward"], workdir / "my_reward.py")  # travels with --working-dir
        out = tmp_path / "outputs"
        args = overrides(tiny_assets, out, **{
            "reward.custom_reward_function.path": "my_reward.py",  # relative: inside the uploaded working dir
            "trainer.total_training_steps": 3, "trainer.save_freq": 3, "trainer.n_gpus_per_node": 1,
            "trainer.logger": "[console,jsonl]"})
        res = _submit_when_the_job_agent_is_up(
            [str(BIN / "ray"), "job", "submit", "--address", f"http://127.0.0.1:{dash}",
             "--working-dir", str(workdir), "--", "python", "-m", "verl_lite.trainer.main_ppo", *args],
            env=env, cwd=str(tmp_path))
        log = res.stdout + res.stderr
        assert res.returncode == 0 and "succeeded" in log, log[-4000:]
        job_id = log.split("Job '", 1)[1].split("'", 1)[0]
        status = subprocess.run([str(BIN / "ray"), "job", "status", "--address", f"http://127.0.0.1:{dash}", job_id],
                                env=env, capture_output=True, text=True, timeout=120)
        assert "succeeded" in (status.stdout + status.stderr).lower(), status.stdout + status.stderr  # SUCCEEDED
        rows = metrics(out / "out")
        assert [r["step"] for r in rows] == [1, 2, 3]
        assert (out / "ckpt" / "global_step_3" / "complete").is_file()
        assert (out / "ckpt" / "global_step_3" / "huggingface" / "model.safetensors").is_file()
    finally:
        stop_marked(marker)
        left = processes_of(marker, str(home))
        shutil.rmtree(home, ignore_errors=True)
    assert left == [], f"processes of the head still alive after SIGKILL: {left}"
