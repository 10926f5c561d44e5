"""verl's interaction classes (``start_interaction`` / ``generate_response`` / ``finalize_interaction``) run as they
are, from verl's interaction-config YAML and from the Python API: the row's ``interaction_kwargs`` reach every call,
the scores become turn scores (None: none), every instance is finalized when its trajectory ends, whatever ended
it. A module that imports verl's base class is refused naming the one-line fix."""

from __future__ import annotations

import pytest

from tests.agent.conftest import ScriptedRollout
from tests.agent.test_agent_loop import _rows, _spec
from verl_lite.agent import AgentRunner, ToolConfigError
from verl_lite.agent.interaction import BaseInteraction, load_interaction_config
from verl_lite.agent.preflight import agent_spec
from verl_lite.config import load_config

OPEN: dict[str, dict] = {}  # instance id -> state, across the classes' instances (a tool process would not share it)


class Gsm8kLike(BaseInteraction):
    """verl's GSM8K interaction in shape: the answer is compared with the row's ground truth; a wrong answer
    gets 'try again' and no score (None), the right one ends the trajectory with score 1."""

    async def start_interaction(self, instance_id=None, ground_truth=None, **kwargs):
        OPEN[instance_id] = {"ground_truth": ground_truth, "name": kwargs.get("name"), "turns": 0}
        return instance_id

    async def generate_response(self, instance_id, messages, **kwargs):
        state = OPEN[instance_id]
        state["turns"] += 1
        answer = messages[-1]["content"]
        if answer == state["ground_truth"]:
            return True, "Correct.", 1.0, {}
        return False, "Try again.", None if state["turns"] < 2 else 0.0, {}

    async def finalize_interaction(self, instance_id, **kwargs):
        OPEN.pop(instance_id)


def _with_kwargs(rows):
    for row in rows:
        row["extra_info"] = {"interaction_kwargs": {"name": "gsm8k", "ground_truth": row["ground_truth"]}}
    return rows


def _script(turn, text):
    return "0" if turn < 3 else "x"  # row 0 (ground truth "0") right at once; row 1 ("2") never right


def test_a_verl_interaction_from_its_yaml_runs_as_in_verl(tool_tokenizer, tmp_path):
    config = tmp_path / "interaction.yaml"
    config.write_text(f"interaction:\n  - name: gsm8k\n    class_name: {__name__}.Gsm8kLike\n    config: {{}}\n")
    tok = tool_tokenizer
    out = AgentRunner(ScriptedRollout(tok, _script), tok, _spec(interaction_config_path=str(config),
                                                                  max_assistant_turns=4)).run(
        _with_kwargs(_rows(tok, 2)), None, {"n": 1, "do_sample": False})
    assert out[0]["turn_scores"] == [1.0] and out[0]["agent_stats"]["stop_reason"] == "interaction_done"
    # row 1: turn 1 scores None (no turn score), turn 2 scores 0.0, turn 3 too; the 4th turn hits the turn limit
    assert out[1]["turn_scores"] == [0.0, 0.0] and out[1]["agent_stats"]["stop_reason"] == "max_assistant_turns"
    assert OPEN == {}  # both instances finalized: the one that ended by the interaction and the one at the limit


def test_a_verl_interaction_object_from_the_python_api(tool_tokenizer):
    tok = tool_tokenizer
    cfg = load_config(["actor_rollout_ref.rollout.multi_turn.enable=true", "actor_rollout_ref.rollout.multi_turn."
                       "max_assistant_turns=2", "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent"])
    spec = agent_spec(cfg, interactions={"gsm8k": Gsm8kLike({"name": "gsm8k"})}, tokenizer=tok)
    out = AgentRunner(ScriptedRollout(tok, _script), tok, spec).run(_with_kwargs(_rows(tok, 2)), None,
                                                                    {"n": 1, "do_sample": False})
    assert [o["turn_scores"] for o in out] == [[1.0], []] and OPEN == {}


def test_a_module_importing_verls_base_class_names_the_fix(tmp_path, monkeypatch):
    (tmp_path / "verl_style_env.py").write_text(
        "from verl.interactions.base import BaseInteraction\n\nclass Env(BaseInteraction):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = tmp_path / "interaction.yaml"
    config.write_text("interaction:\n  - name: env\n    class_name: verl_style_env.Env\n")
    with pytest.raises(ToolConfigError) as err:
        load_interaction_config(str(config))
    assert "from verl_lite.agent.interaction import BaseInteraction" in str(err.value)
    assert "interaction[0]" in str(err.value)
