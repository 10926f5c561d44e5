"""Agentic RL: multi-turn rollouts with tools and interactions (token in, token out).

- ``hermes``: parse ``<tool_call>{json}</tool_call>`` blocks of a model turn;
- ``tools``: Python functions and verl tool-config classes as bounded tools;
- ``interaction``: simulated users / environments with per-turn rewards;
- ``loop``: the agent loops (``single_turn_agent``, ``tool_agent``, your own by name) and the runner
  that batches every live trajectory's model turn into one rollout call;
- ``rules`` / ``preflight``: the config keys' checks, and what the files they name must hold.

See docs/agents.md.
"""

from verl_lite.agent.hermes import ToolCall, parse_tool_calls
from verl_lite.agent.interaction import Interaction, InteractionTurn
from verl_lite.agent.loop import (AGENT_LOOPS, AgentContext, AgentLoop, AgentRunner, AgentSpec, ChatGlue, Trajectory,
                                  register_agent_loop)
from verl_lite.agent.tools import BaseTool, FunctionTool, Tool, ToolConfigError, ToolFailure, ToolResult

__all__ = ["AGENT_LOOPS", "AgentContext", "AgentLoop", "AgentRunner", "AgentSpec", "BaseTool", "ChatGlue",
           "FunctionTool", "Interaction", "InteractionTurn", "Tool", "ToolCall", "ToolConfigError", "ToolFailure",
           "ToolResult", "Trajectory", "parse_tool_calls", "register_agent_loop"]
