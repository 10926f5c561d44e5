"""Tiny assets for the end-to-end runs: a random Qwen2 model with the char tokenizer, a small
synthetic-addition split, and a dense reward (so GRPO/GSPO advantages are non-zero even for an
untrained model). One local Ray is shared by the runs (`shared_ray`)."""

import sys
import tempfile
from pathlib import Path

import pytest
import ray

OUTPUT_DIR = str(Path(tempfile.gettempdir()) / "verl_lite_test_runs")
REWARD_SRC = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Dense toy reward: the fraction of digit characters in the response."""
    return sum(c.isdigit() for c in solution_str) / max(1, len(solution_str))
'''


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory):
    return build_tiny_assets(tmp_path_factory.mktemp("e2e_assets"))


def build_tiny_assets(root: Path) -> dict:
    """The tiny model, char tokenizer, synthetic task and reward file under ``root``; their paths."""
    from verl_lite.data import make_synthetic_task, save_char_tokenizer
    from verl_lite.utils import make_tiny_hf_model

    model = make_tiny_hf_model(root / "model", vocab_size=104, hidden_size=32, num_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, seed=0)
    save_char_tokenizer(model)
    train, val = make_synthetic_task(root / "data", n_train=64, n_val=8, seed=0)
    reward = root / "toy_reward.py"
    reward.write_text(REWARD_SRC)
    return {"model": str(model), "train": str(train), "val": str(val), "reward": str(reward)}


def tiny_overrides(assets, **extra) -> list[str]:
    base = {
        "actor_rollout_ref.model.path": assets["model"],
        "data.train_files": assets["train"],
        "data.val_files": assets["val"],
        "reward.custom_reward_function.path": assets["reward"],
        "data.train_batch_size": 4,
        "data.max_response_length": 6,
        "actor_rollout_ref.rollout.n": 4,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 2,
        "trainer.total_training_steps": 2,
        "trainer.test_freq": 2,
        "trainer.n_gpus_per_node": 1,
        "trainer.output_dir": OUTPUT_DIR,  # fit() writes a run directory, as the CLI does
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


@pytest.fixture(scope="module")
def shared_ray(request):
    """One local Ray for the session's runs, stopped when the session ends. Module-scoped so that it is
    started again (once) after a test of a Ray-free path (tests/faults, tests/trainer/test_failures,
    tests/multinode) stopped it: otherwise every later trainer would start and stop a Ray of its own."""
    from verl_lite.controller import start_ray, stop_ray

    if start_ray(num_cpus=2):
        request.config.add_cleanup(stop_ray)  # idempotent: a no-op when a test stopped it already
    yield
