"""The sections ``actor_rollout_ref.rollout.multi_turn`` and ``actor_rollout_ref.rollout.agent``: their fields,
defaults and rules, stated once here (``problems``: one line per problem, naming the key and the fix). What needs
the files the keys name (tool classes, schemas, interaction classes, the chat template) is checked by
``verl_lite.agent.preflight`` before any worker starts."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from verl_lite.agent.tool_calls import FORMATS
from verl_lite.agent.tools import TOOL_ERROR_MODES, TRUNCATE_SIDES


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class MultiTurnConfig:
    """Multi-turn rollouts with tools and interactions (verl's keys and meanings; docs/agents.md)."""

    enable: bool = False  # rollouts go through the agent loops (a row's agent_name, else agent.default_agent_loop)
    max_assistant_turns: Optional[int] = None  # model turns per trajectory at most; None = no limit
    max_user_turns: Optional[int] = None  # environment turns (tool-response rounds, user turns) at most; None = no limit
    max_parallel_calls: int = 1  # tool calls of one model turn that run (concurrently); later ones are dropped
    max_tool_response_length: int = 256  # characters of a tool response kept (verl: characters, not tokens)
    tool_response_truncate_side: str = "middle"  # left (keep the end) | right (keep the start) | middle (both ends)
    tool_config_path: Optional[str] = None  # verl tool-config YAML: tools: [{class_name, config, tool_schema}]
    interaction_config_path: Optional[str] = None  # interaction YAML: interaction: [{name, class_name, config}]
    format: str = "hermes"  # tool-call format of the model's text: hermes | llama3_json | gpt-oss (tool_calls.FORMATS)
    tool_timeout_s: float = 30.0  # bound on one tool call (seconds); past it the call is a timeout
    tool_error: str = "text"  # a tool that raises or times out: text (its error goes to the model) | fail (the run stops)
    tool_processes: Optional[int] = None  # tool processes per rollout worker (calls beyond them wait for one); null = 4 to 16 by CPU count
    escape_special_tokens: bool = True  # a special-token string in a tool's or user's text is plain text to the model; false: the control token
    batch_wait_s: Optional[float] = 1.0  # a model turn waits at most this long for other trajectories' turns to share its backend call; null = lockstep

    def problems(self, M: str) -> list[str]:
        """The section's own keys (``M`` names it); the paths' other rule is ``AgentLoopConfig.problems``'."""
        out: list[str] = []
        for name in ("max_assistant_turns", "max_user_turns"):
            v = getattr(self, name)
            if v is not None and not (_is_int(v) and v >= 1):
                out.append(f"{M}.{name}={v} must be a count >= 1 (or null: no limit)")
        for name in ("max_parallel_calls", "max_tool_response_length"):
            v = getattr(self, name)
            if not (_is_int(v) and v >= 1):
                out.append(f"{M}.{name}={v} must be >= 1")
        if self.tool_response_truncate_side not in TRUNCATE_SIDES:
            out.append(f"{M}.tool_response_truncate_side={self.tool_response_truncate_side!r} is unknown; choose one "
                       f"of {list(TRUNCATE_SIDES)}")
        if not isinstance(self.format, str) or self.format not in FORMATS:
            out.append(f"{M}.format={self.format!r} is not a built tool-call format; choose one of {list(FORMATS)}")
        if not (isinstance(self.tool_timeout_s, (int, float)) and self.tool_timeout_s > 0):
            out.append(f"{M}.tool_timeout_s={self.tool_timeout_s} must be > 0 seconds (the bound on one tool call)")
        if self.tool_processes is not None and not (_is_int(self.tool_processes) and self.tool_processes >= 1):
            out.append(f"{M}.tool_processes={self.tool_processes} must be >= 1 (or null: 4 to 16 by CPU count)")
        if self.batch_wait_s is not None and not (isinstance(self.batch_wait_s, (int, float)) and self.batch_wait_s >= 0):
            out.append(f"{M}.batch_wait_s={self.batch_wait_s} must be >= 0 seconds, or null (lockstep: every model "
                       f"turn waits for all live trajectories)")
        if self.tool_error not in TOOL_ERROR_MODES:
            out.append(f"{M}.tool_error={self.tool_error!r} is unknown; choose text (the error goes to the model) or "
                       f"fail (the run stops)")
        return out


@dataclass
class AgentLoopConfig:
    default_agent_loop: str = "single_turn_agent"  # agent loop of rows without agent_name: single_turn_agent | tool_agent | a registered name
    agent_loop_config_path: Optional[str] = None  # YAML list of {name, _target_: module.Class} custom agent loops

    def problems(self, R: str, mt: MultiTurnConfig) -> list[str]:
        """This section and ``mt`` (the rollout section ``R``'s ``multi_turn``) together: the files they name
        exist and are used (multi_turn.enable), and a default loop other than single-turn needs multi-turn."""
        M, G = f"{R}.multi_turn", f"{R}.agent"
        out = mt.problems(M)
        for key, path in ((f"{M}.tool_config_path", mt.tool_config_path),
                          (f"{M}.interaction_config_path", mt.interaction_config_path),
                          (f"{G}.agent_loop_config_path", self.agent_loop_config_path)):
            if path and not Path(path).is_file():
                out.append(f"{key}={path!r} does not exist")
            if path and not mt.enable:
                out.append(f"{key} is set but {M}.enable=false; set {M}.enable=true for multi-turn rollouts")
        if self.default_agent_loop != type(self)().default_agent_loop and not mt.enable:
            out.append(f"{G}.default_agent_loop={self.default_agent_loop!r} needs {M}.enable=true (with enable=false "
                       f"every rollout is single-turn)")
        if not isinstance(self.default_agent_loop, str) or not self.default_agent_loop:
            out.append(f"{G}.default_agent_loop must name a registered agent loop (single_turn_agent, tool_agent, ...)")
        return out
