"""``--recipe tool_agent`` through the command line: 2 RL steps of the shipped tool-agent model on the
shipped calculator task (the full learning run is recorded in docs/agents.md, not a test).

- the warm-started model calls the ``calculator`` in its rollouts: tool calls, 2+ turns, environment
  tokens (mask 0) beside model tokens, the tool's latency, every multi-turn metric in metrics.jsonl;
- the held-out accuracy and tool-call rate of step 0 (greedy, through Ray workers, the tool config's
  class and the recipe's reward file) are those ``scripts/make_tool_agent_model.py`` measured in-process
  with the agent runner when it stopped SFT (``sft_summary.json``);
- the curve plots the tool-call rate.
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.e2e.conftest import shared_ray  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parents[2]
MULTI_TURN_METRICS = ("agent/turns_mean", "agent/turns_max", "agent/env_turns_mean", "agent/tool_calls_mean",
                      "agent/tool_call_rate", "agent/tool_errors", "agent/tool_timeouts", "agent/model_tokens_mean",
                      "agent/env_tokens_mean", "agent/model_token_fraction", "agent/tool_latency_s/calculator")


def test_tool_agent_recipe_calls_the_tool(tmp_path, shared_ray, monkeypatch):  # noqa: F811
    from verl_lite.trainer import main_ppo

    monkeypatch.chdir(ROOT)  # the recipe's paths are the repository's
    overrides = {"data.train_batch_size": 4, "actor_rollout_ref.actor.ppo_mini_batch_size": 4,
                 "actor_rollout_ref.rollout.n": 4, "trainer.total_training_steps": 2, "trainer.test_freq": 2,
                 "trainer.logger": "[jsonl]", "trainer.output_dir": str(tmp_path),
                 "trainer.default_local_dir": str(tmp_path / "checkpoints")}
    assert main_ppo.main(["--recipe", "tool_agent"] + [f"{k}={v}" for k, v in overrides.items()]) == 0
    run_dir = next(tmp_path.glob("*/metrics.jsonl")).parent
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        missing = [k for k in MULTI_TURN_METRICS if k not in r]
        assert not missing, missing
        assert r["agent/tool_calls_mean"] > 0 and r["agent/tool_call_rate"] > 0
        assert r["agent/turns_max"] >= 2 and r["agent/env_tokens_mean"] > 0
        assert 0 < r["agent/model_token_fraction"] < 1
        assert r["agent/tool_timeouts"] == 0
    sft = json.loads((ROOT / "verl_lite/assets/tool-agent/sft_summary.json").read_text())
    start = rows[0]
    assert abs(start["val/accuracy"] - sft["final_val_accuracy"]) <= 2 / 256, (start, sft["final_val_accuracy"])
    assert abs(start["val/tool_call_rate"] - sft["final_val_tool_call_rate"]) <= 2 / 256
    assert "val/tool_call_rate" in rows[-1]
    assert (run_dir / "curves.png").is_file()
