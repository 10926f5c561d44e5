"""examples/tool_agent.py (two plain functions as tools, one of them async, through the Python API) runs
for 2 steps on the shipped tiny model: the agent metrics and the validation tool-call rate reach
metrics.jsonl, and the environment tokens never count as model tokens."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from tests.e2e.conftest import shared_ray  # noqa: F401  (fixture)

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tool_agent.py"


def test_tool_agent_example_runs(tmp_path, shared_ray):  # noqa: F811
    spec = importlib.util.spec_from_file_location("example_tool_agent", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    trainer, history = module.main(str(tmp_path), steps=2)
    rows = [json.loads(line) for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        assert r["agent/turns_mean"] >= 1 and r["agent/turns_max"] <= 3
        assert 0.0 <= r["agent/model_token_fraction"] <= 1.0
        assert r["agent/model_tokens_mean"] + r["agent/env_tokens_mean"] > 0
    assert "val/tool_call_rate" in rows[0] and "val/tool_call_rate" in rows[-1]
    assert trainer.agent.tool_schemas[1]["function"]["name"] == "multiply"


def test_curves_show_the_tool_call_rate_beside_accuracy(tmp_path):
    from verl_lite.trainer.metrics import plot_curves, reward_panel_lines

    records = [{"step": 0, "val/accuracy": 0.1, "val/tool_call_rate": 0.0},
               {"step": 1, "reward/mean": 0.2, "agent/tool_call_rate": 0.5},
               {"step": 2, "reward/mean": 0.3, "agent/tool_call_rate": 0.75, "val/accuracy": 0.4, "val/tool_call_rate": 1.0}]
    lines = {label: points for label, points, _, _ in reward_panel_lines(records)}
    assert lines["train tool-call rate (multi-turn)"] == [(1, 0.5), (2, 0.75)]
    assert lines["held-out tool-call rate"] == [(0, 0.0), (2, 1.0)]
    assert lines["held-out accuracy (greedy)"] == [(0, 0.1), (2, 0.4)]
    assert not any("tool" in label for label, *_ in reward_panel_lines([{"step": 1, "reward/mean": 0.2}]))
    assert plot_curves(records, tmp_path / "curves.png").stat().st_size > 0
