"""A bad tool config is rejected before anything starts, through the command line (exit 2, one line per
problem naming the entry), and verl's multi_turn / agent keys are checked with their meaning."""

from __future__ import annotations

import pytest

TOOLS_YAML = """
tools:
  - class_name: tests.agent.no_such_module.Calculator
    config: {type: native}
    tool_schema: {type: function, function: {name: calc, description: adds, parameters: {type: object, properties: {}}}}
  - class_name: verl_lite.agent.tools.BaseTool
    config: {type: native}
    tool_schema: {type: function, function: {description: no name}}
"""


def test_bad_tool_config_exits_2_before_start(tmp_path, capsys):
    import ray

    from verl_lite.trainer import main_ppo

    path = tmp_path / "tools.yaml"
    path.write_text(TOOLS_YAML)
    was_running = ray.is_initialized()
    code = main_ppo.main(["actor_rollout_ref.rollout.multi_turn.enable=true",
                          "actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent",
                          f"actor_rollout_ref.rollout.multi_turn.tool_config_path={path}",
                          f"trainer.output_dir={tmp_path}"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "tools[0]: class_name 'tests.agent.no_such_module.Calculator' cannot be imported" in err
    assert "tools[1] (verl_lite.agent.tools.BaseTool): tool_schema function.name must be a non-empty string" in err
    # the default model's template cannot render tool turns: said now, beside the tools that failed to load
    assert "chat template renders 'tool' turns" in err
    assert "Traceback" not in err
    assert ray.is_initialized() == was_running  # nothing started


@pytest.mark.parametrize("override, needle", [
    ("actor_rollout_ref.rollout.multi_turn.tool_response_truncate_side=top", "tool_response_truncate_side='top'"),
    ("actor_rollout_ref.rollout.multi_turn.format=mistral", "format='mistral' is not a built tool-call format"),
    ("actor_rollout_ref.rollout.multi_turn.max_parallel_calls=0", "max_parallel_calls=0 must be >= 1"),
    ("actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent", "needs actor_rollout_ref.rollout.multi_turn.enable=true"),
    ("actor_rollout_ref.rollout.multi_turn.function_tool_path=t.py", "tools=[f, g]"),
])
def test_multi_turn_keys_are_checked(override, needle):
    from verl_lite.config import ConfigError, load_config, validate_config

    with pytest.raises(ConfigError) as e:
        validate_config(load_config([override]), world_size=1)
    assert any(needle in p for p in e.value.problems), e.value.problems


def test_verl_defaults_and_the_shipped_template(tool_tokenizer):
    from transformers import AutoTokenizer

    from verl_lite.agent import ChatGlue
    from verl_lite.config import load_config
    from verl_lite.config.loader import default_model_path

    mt = load_config([]).actor_rollout_ref.rollout.multi_turn
    assert (mt.enable, mt.max_parallel_calls, mt.max_tool_response_length, mt.tool_response_truncate_side,
            mt.format) == (False, 1, 256, "middle", "hermes")
    shipped = ChatGlue(AutoTokenizer.from_pretrained(default_model_path()))
    assert "does not render 'tool' messages" in shipped.problem("tool")  # its template has no tool role
    assert shipped.problem("user") is None
    assert ChatGlue(tool_tokenizer).problem("tool") is None


def test_tools_with_rows_that_run_single_turn_are_said_before_start(capsys):
    """verl's default loop (single_turn_agent) with tools configured: every row without agent_name would run one
    model turn and never see a tool. The run starts (verl does the same) with one warning line saying so."""
    from verl_lite.config import load_config
    from verl_lite.config.loader import package_path
    from verl_lite.trainer.ppo_trainer import PPOTrainer

    data = package_path("assets/tool-agent-data")
    overrides = [f"actor_rollout_ref.model.path={package_path('assets/tool-agent')}",
                 f"data.train_files={data}/train.parquet", f"data.val_files={data}/val.parquet",
                 "data.max_prompt_length=48", "data.max_response_length=144",
                 "actor_rollout_ref.rollout.multi_turn.enable=true",
                 f"actor_rollout_ref.rollout.multi_turn.tool_config_path={data}/tool_config.yaml",
                 f"reward.custom_reward_function.path={package_path('data/tool_task.py')}",
                 "reward.custom_reward_function.name=compute_score"]
    PPOTrainer(load_config(overrides))
    warnings = [line for line in capsys.readouterr().err.splitlines() if "have no agent_name" in line]
    assert len(warnings) == 1 and "default_agent_loop=single_turn_agent" in warnings[0]
    PPOTrainer(load_config(overrides + ["actor_rollout_ref.rollout.agent.default_agent_loop=tool_agent"]))
    assert "have no agent_name" not in capsys.readouterr().err
