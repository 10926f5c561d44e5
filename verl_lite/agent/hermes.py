"""Tool calls in the hermes format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

A block that is not a JSON object with a string ``name`` and an object ``arguments`` (or that names an
unknown tool) is still a call, with ``error`` saying what is wrong, so the loop answers it with that error
text instead of dropping it silently (the model learns from the answer; verl does the same).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)" + re.escape(TOOL_CALL_END), re.DOTALL)
FORMATS = ("hermes",)


@dataclass
class ToolCall:
    name: str  # "" when the block has no usable name
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # why this call cannot run (malformed JSON, unknown tool, ...); None = it can
    raw: str = ""  # the block's text between the markers


def _one_call(raw: str, known: set[str] | None) -> ToolCall:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return ToolCall("", error=f"Invalid JSON in tool call: {e.msg} (line {e.lineno} column {e.colno})", raw=raw)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return ToolCall("", error='Invalid tool call: expected {"name": <tool name>, "arguments": {...}}', raw=raw)
    name, args = obj["name"], obj.get("arguments", {})
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    if not isinstance(args, dict):
        return ToolCall(name, error=f"Invalid arguments for '{name}': expected a JSON object, got {args!r}", raw=raw)
    if known is not None and name not in known:
        return ToolCall(name, args, error=f"Unknown function '{name}'. Available tools: {sorted(known)}", raw=raw)
    return ToolCall(name, args, raw=raw)


def parse_tool_calls(text: str, known: set[str] | None = None) -> tuple[str, list[ToolCall]]:
    """(content without the call blocks, the calls in order; text without both markers has none). ``known``:
    the tool names that exist (None: do not check names)."""
    if TOOL_CALL_START not in text or TOOL_CALL_END not in text:
        return text, []
    calls = [_one_call(m.strip(), known) for m in _BLOCK.findall(text)]
    return _BLOCK.sub("", text), calls
