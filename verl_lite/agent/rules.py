"""The rules of ``actor_rollout_ref.rollout.multi_turn`` and ``actor_rollout_ref.rollout.agent``.

``agent_config_problems`` checks the keys (one line per problem, naming the key and the fix);
``verl_lite.rollout.rules`` collects them with the rollout section. What needs the files the keys name
(tool classes, schemas, interaction classes, the chat template) is checked by
``verl_lite.agent.preflight`` before any worker starts.
"""

from __future__ import annotations

from pathlib import Path

from verl_lite.agent.hermes import FORMATS
from verl_lite.agent.tools import TOOL_ERROR_MODES, TRUNCATE_SIDES

DEFAULT_LOOP = "single_turn_agent"


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def agent_config_problems(R: str, rollout) -> list[str]:
    """``rollout`` = the rollout section named ``R`` (its ``multi_turn`` and ``agent`` subsections)."""
    mt, ag = rollout.multi_turn, rollout.agent
    M, G = f"{R}.multi_turn", f"{R}.agent"
    out: list[str] = []
    for name in ("max_assistant_turns", "max_user_turns"):
        v = getattr(mt, name)
        if v is not None and not (_is_int(v) and v >= 1):
            out.append(f"{M}.{name}={v} must be a count >= 1 (or null: no limit)")
    for name in ("max_parallel_calls", "max_tool_response_length"):
        v = getattr(mt, name)
        if not (_is_int(v) and v >= 1):
            out.append(f"{M}.{name}={v} must be >= 1")
    if mt.tool_response_truncate_side not in TRUNCATE_SIDES:
        out.append(f"{M}.tool_response_truncate_side={mt.tool_response_truncate_side!r} is unknown; choose one of "
                   f"{list(TRUNCATE_SIDES)}")
    if mt.format not in FORMATS:
        out.append(f"{M}.format={mt.format!r}: only the {list(FORMATS)} tool-call format is built")
    if not (isinstance(mt.tool_timeout_s, (int, float)) and mt.tool_timeout_s > 0):
        out.append(f"{M}.tool_timeout_s={mt.tool_timeout_s} must be > 0 seconds (the bound on one tool call)")
    if mt.tool_error not in TOOL_ERROR_MODES:
        out.append(f"{M}.tool_error={mt.tool_error!r} is unknown; choose text (the error goes to the model) or fail "
                   f"(the run stops)")
    for key, path in ((f"{M}.tool_config_path", mt.tool_config_path),
                      (f"{M}.interaction_config_path", mt.interaction_config_path),
                      (f"{G}.agent_loop_config_path", ag.agent_loop_config_path)):
        if path and not Path(path).is_file():
            out.append(f"{key}={path!r} does not exist")
        if path and not mt.enable:
            out.append(f"{key} is set but {M}.enable=false; set {M}.enable=true for multi-turn rollouts")
    if ag.default_agent_loop != DEFAULT_LOOP and not mt.enable:
        out.append(f"{G}.default_agent_loop={ag.default_agent_loop!r} needs {M}.enable=true (with enable=false every "
                   f"rollout is single-turn)")
    if not isinstance(ag.default_agent_loop, str) or not ag.default_agent_loop:
        out.append(f"{G}.default_agent_loop must name a registered agent loop (single_turn_agent, tool_agent, ...)")
    return out
