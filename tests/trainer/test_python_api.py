"""The Python API as a TRL user would use it: examples/python_api.py (two weighted reward
functions) and examples/custom_reward_loop.py (one async batched reward over the whole batch that
reads the prompt, in-memory rows) run for 2 steps; fit() writes the CLI's run directory, the
reward functions' own scores appear in metrics.jsonl, and save_pretrained keeps a policy that
loads with transformers."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tests.e2e.conftest import shared_ray  # noqa: F401  (fixture)

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_reward_functions_and_save_pretrained(tmp_path, shared_ray):
    import transformers

    trainer, history = _load("python_api").main(str(tmp_path), steps=2)
    run_dir = trainer.run_dir
    assert run_dir.parent == tmp_path and (run_dir / "summary.json").is_file() and (run_dir / "curves.png").is_file()
    rows = _rows(run_dir)
    assert [r["step"] for r in rows] == [r["step"] for r in history] == [0, 1, 2]
    for r in rows[1:]:  # total = 1.0 * exact + 0.5 * trailing_digits, per sample, so also in the mean
        expected = r["reward/exact/mean"] + 0.5 * r["reward/trailing_digits/mean"]
        assert abs(r["reward/mean"] - expected) < 1e-5, r
    policy = tmp_path / "exported"
    trainer.save_pretrained(policy)
    model = transformers.AutoModelForCausalLM.from_pretrained(policy)
    reference = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "huggingface")
    for (name, a), (_, b) in zip(model.state_dict().items(), reference.state_dict().items()):
        assert torch.equal(a, b), name


def test_custom_reward_loop_reads_the_prompt(tmp_path, shared_ray):
    trainer, history = _load("custom_reward_loop").main(str(tmp_path), steps=2)
    rows = _rows(trainer.run_dir)
    assert all("reward/judge/mean" in r for r in rows[1:])
    assert all(abs(r["reward/judge/mean"] - r["reward/mean"]) < 1e-6 for r in rows[1:])
    assert json.loads((trainer.run_dir / "config.json").read_text())["data"]["train_files"] == "<in-memory dataset>"


def test_reward_function_errors_name_the_function(tmp_path):
    from verl_lite.reward import RewardError
    from verl_lite.reward.functions import RewardFunctions

    class Tok:
        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(97 + i) for i in ids)

    def short(completions, **kwargs):
        return [1.0]

    def needs_answer(completions, answer):
        return [0.0] * len(completions)

    with pytest.raises(RewardError, match="short returned 1 scores for 2 samples"):
        RewardFunctions([short], Tok())([[0], [1]], ["d", "d"], ["x", "y"])
    with pytest.raises(RewardError, match=r"needs_answer needs \['answer'\]"):
        RewardFunctions(needs_answer, Tok())([[0]], ["d"], ["x"])
    scores, extra = RewardFunctions(needs_answer, Tok())([[0]], ["d"], ["x"], [{"answer": "a"}])
    assert scores.tolist() == [0.0] and extra["needs_answer"] == [0.0]


def test_a_transformers_callback_stops_the_run(tmp_path, shared_ray):  # noqa: F811
    """``control.should_training_stop`` (TRL's and transformers' way to stop early) ends fit() after that step,
    with the final policy exported."""
    from transformers import TrainerCallback

    from tests.e2e.conftest import REWARD_SRC, tiny_overrides
    from verl_lite.config import load_config
    from verl_lite.data import make_synthetic_task, save_char_tokenizer
    from verl_lite.trainer.ppo_trainer import PPOTrainer
    from verl_lite.utils import make_tiny_hf_model

    class StopAtTwo(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step >= 2

    model = make_tiny_hf_model(tmp_path / "model", vocab_size=104, hidden_size=32, num_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, seed=0)
    save_char_tokenizer(model)
    train, val = make_synthetic_task(tmp_path / "data", n_train=64, n_val=8, seed=0)
    (tmp_path / "reward.py").write_text(REWARD_SRC)
    assets = {"model": str(model), "train": str(train), "val": str(val), "reward": str(tmp_path / "reward.py")}
    cfg = load_config(tiny_overrides(assets, **{"trainer.total_training_steps": 4, "trainer.test_freq": 0,
                                                "trainer.val_before_train": "false", "trainer.logger": "[jsonl]",
                                                "trainer.output_dir": str(tmp_path / "out")}))
    trainer = PPOTrainer(cfg, callbacks=[StopAtTwo()])
    history = trainer.fit()
    assert [r["step"] for r in history] == [1, 2]
    assert (trainer.run_dir / "huggingface" / "model.safetensors").is_file()


def test_a_trl_grpo_config_trains_with_trls_schedule(tmp_path, shared_ray):  # noqa: F811
    """``args=GRPOConfig(...)`` as a TRL user writes it (bf16, KL loss, grpo loss) runs end to end: two steps at
    transformers' linear schedule (lr x (T - k) / T per optimizer step, one per RL step here), the KL loss on,
    the run directory under ``output_dir``."""
    import trl

    from verl_lite.config import load_config
    from verl_lite.trainer.ppo_trainer import PPOTrainer

    def exact(completions, ground_truth, **kwargs):
        return [float(c.strip() == str(g)) for c, g in zip(completions, ground_truth)]

    args = trl.GRPOConfig(output_dir=str(tmp_path), use_cpu=True, max_completion_length=6, num_generations=4,
                          per_device_train_batch_size=8, max_steps=2, beta=0.04, use_bias_correction_kl=False,
                          loss_type="grpo", learning_rate=1e-4, logging_steps=1, save_strategy="no")
    trainer = PPOTrainer(load_config([]), reward_funcs=[exact], args=args)
    history = trainer.fit()
    assert [r["step"] for r in history] == [1, 2]
    assert [r["actor/lr"] for r in history] == pytest.approx([1e-4, 5e-5])
    assert all("actor/kl_loss" in r for r in history) and trainer.run_dir.parent == tmp_path
