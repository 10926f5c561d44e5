"""Agentic RL: multi-turn rollouts with tools and interactions, token in, token out (docs/agents.md): the tool-call
parsers, tools, interactions, the agent loops and their runner, and the checks before start.
"""

from verl_lite.agent.interaction import Interaction, InteractionTurn
from verl_lite.agent.loop import (AGENT_LOOPS, AgentContext, AgentLoop, AgentRunner, AgentSpec, ChatGlue, Trajectory,
                                  register_agent_loop)
from verl_lite.agent.tool_calls import ToolCall, parse_tool_calls
from verl_lite.agent.tools import BaseTool, FunctionTool, Tool, ToolConfigError, ToolFailure, ToolResult

__all__ = ["AGENT_LOOPS", "AgentContext", "AgentLoop", "AgentRunner", "AgentSpec", "BaseTool", "ChatGlue",
           "FunctionTool", "Interaction", "InteractionTurn", "Tool", "ToolCall", "ToolConfigError", "ToolFailure",
           "ToolResult", "Trajectory", "parse_tool_calls", "register_agent_loop"]
