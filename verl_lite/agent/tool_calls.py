"""Tool calls in a model's turn, in the format ``multi_turn.format`` names (verl's names): transformers'
``parse_response`` runs each format's response template (the data below); this module checks each call, and one that
cannot run is still a call, with ``error`` saying why (docs/agents.md, "Tool-call formats").
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

_BLOCK = {"content": "json", "content_args": {"allow_non_json": True}, "repeats": True}  # bad JSON stays text
_AS_IS = {"type": "function", "function": "{content}"}  # the block's object, checked by _checked
_TEXT = {"content_args": {"strip": False}, "repeats": True, "join": ""}  # the text around the calls, as it is
_HARMONY_CALL = (r"(?:\s*to=functions\.(?P<name>[^\s<]+)\s*<\|channel\|>commentary|<\|channel\|>commentary\s+"
                 r"to=functions\.(?P<name>[^\s<]+))[^<]*(?:<\|constrain\|>[^<]*)?<\|message\|>")


@dataclass(frozen=True)
class Format:
    template: dict  # transformers' response template: fields tool_calls and content
    special_tokens: tuple[str, ...] = ()  # tokens the calls are written with: kept when the turn is decoded
    stop_tokens: tuple[str, ...] = ()  # tokens that end a tool-call turn besides EOS: generation stops at each


FORMATS = {
    "hermes": Format({"start_anchor": "<|im_start|>assistant\n", "fields": {  # Qwen2.5, Qwen3, Hermes
        "tool_calls": {"open_pattern": "<tool_call>(?=.*?</tool_call>)", "close": "</tool_call>", **_BLOCK,
                       "transform": _AS_IS}, "content": _TEXT}}),
    "llama3_json": Format({"start_anchor": "<|start_header_id|>assistant<|end_header_id|>\n\n", "fields": {
        "tool_calls": {"open_pattern": r'^\s*<\|python_tag\|>|(?:^|(?<=\}\s*;))\s*(?=\{\s*"name"\s*:)',
                       "close_pattern": r"(?<=\})\s*;(?=\s*\{)|<\|eo[mt]_id\|>", **_BLOCK, "transform": _AS_IS},
        "content": _TEXT}}, stop_tokens=("<|eom_id|>",)),
    "gpt-oss": Format({"start_anchor": "<|start|>assistant", "fields": {  # harmony: a call ends at <|call|>
        "thinking": {"open": "<|channel|>analysis<|message|>", "close": "<|end|>"},
        "content": {"open_pattern": r"<\|channel\|>(?:final|commentary)<\|message\|>",
                    "close_pattern": r"<\|end\|>|<\|return\|>", "repeats": True, "join": ""},
        "tool_calls": {"open_pattern": _HARMONY_CALL, "close": "<|call|>", **_BLOCK,
                       "transform": {"type": "function", "function": {"name": "{name}", "arguments": "{content}"}}}}},
        special_tokens=("<|channel|>", "<|message|>", "<|call|>"), stop_tokens=("<|call|>",)),
}


@dataclass
class ToolCall:
    name: str  # "" when the block has no usable name
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # why this call cannot run (malformed JSON, unknown tool, ...); None = it can


def _json(text: str, what: str) -> tuple[Any, str | None]:
    """(the value, None), or (None, why ``text`` is not JSON)."""
    try:
        return json.loads(text), None
    except json.JSONDecodeError as e:
        return None, f"Invalid JSON in {what}: {e.msg} (line {e.lineno} column {e.colno})"


def _checked(block: Any, known: set[str] | None) -> ToolCall:
    """The call of one block the parser found; what keeps it from running is the call's ``error``."""
    if isinstance(block, str):  # the parser keeps a block that is not JSON as its text
        block, error = _json(block, "tool call")
        if error:
            return ToolCall("", error=error)
    if not isinstance(block, dict) or not isinstance(block.get("name"), str) or not block["name"]:
        return ToolCall("", error='Invalid tool call: expected {"name": <tool name>, "arguments": {...}}')
    name, args = block["name"], block.get("arguments", block.get("parameters", {}))  # Llama's: parameters
    if isinstance(args, str):  # arguments written as a JSON string
        args, error = _json(args, f"the arguments of '{name}'")
        if error:
            return ToolCall(name, error=error)
    if not isinstance(args, dict):
        return ToolCall(name, error=f"Invalid arguments for '{name}': expected a JSON object, got {args!r}")
    if known is not None and name not in known:
        return ToolCall(name, args, error=f"Unknown function '{name}'. Available tools: {sorted(known)}")
    return ToolCall(name, args)


def parse_tool_calls(text: str, known: set[str] | None = None, format: str = "hermes") -> tuple[str, list[ToolCall]]:
    """(the turn's content without its calls, the calls in order) of ``text`` in ``format`` (a key of FORMATS);
    ``known``: the tool names that exist (None: do not check names)."""
    from transformers.utils.chat_parsing import parse_response

    message = parse_response(text, FORMATS[format].template, prefix="")
    return message.get("content", ""), [_checked(c["function"], known) for c in message.get("tool_calls", [])]


def stop_token_ids(tokenizer, format: str) -> list[int]:
    """The ids of the format's stop tokens that ``tokenizer`` has (a tool-call turn ends at them)."""
    vocab = tokenizer.get_vocab()
    return [vocab[t] for t in FORMATS[format].stop_tokens if t in vocab]


def format_problem(tokenizer, format: str) -> str | None:
    """Why ``tokenizer`` cannot carry ``format``'s calls (None: it can): a token the calls are written with is
    missing (the format is another model family's)."""
    vocab = tokenizer.get_vocab()
    if missing := [t for t in FORMATS[format].special_tokens if t not in vocab]:
        return f"the tokenizer has no {', '.join(missing)} token(s), which {format} writes its tool calls with"
    return None
