"""model.enable_gradient_checkpointing does what it does in verl: megatron activation recompute
(full, uniform, 1 layer) in the engine the config builds -- the layers run under megatron's
CheckpointFunction and the losses and gradient norms equal the run without recompute."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def test_recompute_runs_the_layers_under_checkpointing_with_the_same_math(tmp_path):
    probe = Path(__file__).with_name("recompute_probe.py")
    proc = subprocess.run([sys.executable, str(probe), str(tmp_path / "model")], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["plain"]["checkpoint_calls"] == 0
    assert out["recompute"]["checkpoint_calls"] == 4 * 2 * 2  # layers x micro-batches x steps
    for plain, recompute in zip(out["plain"]["steps"], out["recompute"]["steps"]):
        assert abs(plain["loss"] - recompute["loss"]) < 1e-6 and abs(plain["grad_norm"] - recompute["grad_norm"]) < 1e-6
