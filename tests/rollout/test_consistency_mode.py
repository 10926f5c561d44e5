"""The consistency mode (``actor_rollout_ref.rollout.batch_invariant=true``) end to end: the actor's own
batch-invariant engine generates, so the log-prob the rollout reports for every sampled token is the trainer's,
bit for bit: ``rollout/logprob_diff_max`` is exactly 0.0 on every step of
- the default job (the shipped model and task), at 1 worker (one mini-batch: the update's own forward gives the
  old log-probs) and at DP2 with two mini-batches (a separate old-log-prob pass; each decode step's forward cut
  into micro-batches of at most 64 tokens), in fp32 and in bf16;
- the tool-agent recipe (multi-turn, tool calls, the environment's tokens masked), at 1 worker and DP2;
- a MoE GRPO run with routing replay R3 (the rollout's routing recorded and replayed), at 1 worker and DP2.
The same default job without the mode reports a nonzero difference (the HF rollout is another program).
Settings the mode cannot honour are refused before start (``tests/config``). Its runs are mostly start-up and
1-2 worker steps: the module runs in the suite's first phase, beside another one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.conftest import shared_ray, tiny_assets  # noqa: F401  (fixtures)

ROOT = Path(__file__).resolve().parents[2]
SMALL = {"data.train_batch_size": 4, "actor_rollout_ref.actor.ppo_mini_batch_size": 4, "actor_rollout_ref.rollout.n": 2,
         "trainer.total_training_steps": 2, "trainer.test_freq": -1, "trainer.val_before_train": False,
         "trainer.logger": "[jsonl]", "trainer.save_freq": -1}
DP2 = {"trainer.n_gpus_per_node": 2, "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 2}
R3 = {"actor_rollout_ref.actor.router_replay.mode": "R3", "actor_rollout_ref.rollout.enable_rollout_routing_replay": True}
ON = {"actor_rollout_ref.rollout.batch_invariant": True}


@pytest.fixture(scope="module")
def moe_model(tiny_assets, tmp_path_factory):  # noqa: F811
    from verl_lite.data import save_char_tokenizer
    from verl_lite.utils.tiny_model import make_tiny_moe_model

    model = make_tiny_moe_model(tmp_path_factory.mktemp("bi_moe") / "model", "qwen3_moe", vocab_size=104,
                                hidden_size=32, num_layers=2, num_experts=4, top_k=2, moe_intermediate_size=16, seed=1)
    save_char_tokenizer(model)
    return str(model)


def _run(tmp_path, recipe: str | None, overrides: dict, monkeypatch) -> list[dict]:
    from verl_lite.trainer import main_ppo

    monkeypatch.chdir(ROOT)  # a recipe's paths are the repository's
    settings = {**SMALL, **overrides, "trainer.output_dir": str(tmp_path),
                "trainer.default_local_dir": str(tmp_path / "checkpoints")}
    args = (["--recipe", recipe] if recipe else []) + [f"{k}={v}" for k, v in settings.items()]
    assert main_ppo.main(args) == 0
    rows = [json.loads(line) for line in next(tmp_path.glob("*/metrics.jsonl")).read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    return rows


BF16 = {"actor_rollout_ref.actor.megatron.dtype": "bfloat16", "actor_rollout_ref.rollout.dtype": "bfloat16"}
# a decode step's forward split into micro-batches of at most 64 tokens (the rollout's log-prob token budget)
SPLIT = {"actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": 64}
CASES = {"default": (None, {}), "default_dp2": (None, {**DP2, **SPLIT}), "default_bf16_dp2": (None, {**BF16, **DP2}),
         "tool_agent": ("tool_agent", {}),
         "tool_agent_dp2": ("tool_agent", DP2), "moe_r3": (None, R3), "moe_r3_dp2": (None, {**R3, **DP2})}


@pytest.mark.parametrize("case", list(CASES))
def test_rollout_log_probs_are_the_trainer_s_bit_for_bit(case, tmp_path, shared_ray, moe_model,  # noqa: F811
                                                        monkeypatch):
    recipe, overrides = CASES[case]
    if case.startswith("moe"):
        overrides = {**overrides, "actor_rollout_ref.model.path": moe_model}
    rows = _run(tmp_path, recipe, {**ON, **overrides}, monkeypatch)
    for r in rows:
        assert r["rollout/logprob_diff_max"] == 0.0, (r["step"], r["rollout/logprob_diff_max"])
        assert r["rollout/logprob_diff_mean"] == 0.0
        if case.startswith("tool_agent"):
            assert r["agent/turns_max"] >= 2  # multi-turn trajectories, the tool's tokens between the model's
        if case.startswith("moe"):
            assert r["actor/routing_mismatch"] == 0.0  # the replayed routing is the trainer's own


def test_without_the_mode_the_rollout_is_another_program(tmp_path, shared_ray, monkeypatch):  # noqa: F811
    rows = _run(tmp_path, None, {}, monkeypatch)
    assert all(r["rollout/logprob_diff_max"] > 0.0 for r in rows)
