"""Tools the agent loop can call, as :class:`Tool` objects (``name``, OpenAI ``schema``, ``invoke``): Python
functions (``PPOTrainer(tools=...)``, called with the model's arguments as keywords) and the classes of verl's
``multi_turn.tool_config_path`` YAML. Each call runs in a tool process for at most ``multi_turn.tool_timeout_s``;
a raise or a timeout is error text, or a :class:`ToolFailure` with ``tool_error=fail`` (docs/agents.md, "Tools").
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import json
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from verl_lite.agent.tool_process import (POOL_SIZE, ToolCallTimeout, ToolProcessDied, ToolProcessPool,
                                          ToolProcessStartError, pickled_tools)
from verl_lite.errors import BadInput, RunFailure

TRUNCATE_SIDES = ("left", "right", "middle")
VERL_TOOLS_FIX = ("; verl is not installed here: a tool class of your own imports verl's base class from verl_lite "
                  "instead (from verl_lite.agent.tools import BaseTool), the rest runs as it is; verl's shipped tools "
                  "(verl.tools.*) are not included: give their logic as a function (PPOTrainer(tools=[...])) or a class")
TOOL_ERROR_MODES = ("text", "fail")
START_FIX = "make the tool importable and picklable in a fresh process (docs/agents.md, Tools)"


class ToolConfigError(BadInput):
    """A tool config / tool list is unusable (exit 2, before any worker starts); one problem a line."""

    def __init__(self, what: str, fix: str | None = None):
        super().__init__(what, fix)
        self.problems = what.splitlines() if fix is None else [str(self)]


class ToolFailure(RunFailure):
    """A tool raised or timed out and ``multi_turn.tool_error=fail`` makes that a run failure."""


# ---------------------------------------------------------------------------------------------- schemas
def schema_problem(schema: Any) -> str | None:
    """Why ``schema`` is not an OpenAI function-tool schema (None: it is)."""
    if not isinstance(schema, dict) or schema.get("type") != "function" or not isinstance(schema.get("function"), dict):
        return "must be {type: function, function: {name, description, parameters}}"
    fn = schema["function"]
    if not isinstance(fn.get("name"), str) or not fn["name"].strip():
        return "function.name must be a non-empty string"
    if "description" in fn and not isinstance(fn["description"], str):
        return "function.description must be a string"
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict) or params.get("type") != "object" or not isinstance(params.get("properties", {}), dict):
        return "function.parameters must be {type: object, properties: {...}}"
    required = params.get("required", [])
    if not isinstance(required, list) or any(r not in params.get("properties", {}) for r in required):
        return "function.parameters.required must list names of function.parameters.properties"
    return None


# ---------------------------------------------------------------------------------------------- tools
@dataclass
class ToolResult:
    text: str
    reward: float | None = None
    metrics: dict = field(default_factory=dict)


def as_text(value: Any) -> str:
    """A tool's response as the text the model reads (verl's rule): a string as it is, None as nothing, a response
    object by its ``.text``, anything else (a dict, a list, a number) as JSON; str() where JSON cannot carry it."""
    text = getattr(value, "text", value)
    if text is None or isinstance(text, str):
        return text or ""
    try:
        return json.dumps(text, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(text)


def _class_result(raw: Any) -> ToolResult:
    """A verl tool class's ``execute`` value -> ToolResult: ``(response, reward[, metrics])`` or the response."""
    reward, metrics = None, {}
    if isinstance(raw, tuple) and raw:
        raw, reward, metrics = (list(raw) + [None, {}])[:3]
    return ToolResult(as_text(raw), None if reward is None else float(reward), dict(metrics or {}))


async def maybe_await(value):
    return await value if inspect.isawaitable(value) else value


class Tool:
    """A callable tool: ``name``, ``schema`` (OpenAI function schema), ``invoke(arguments) -> ToolResult``
    (blocking; the executor bounds it)."""

    name: str
    schema: dict

    def invoke(self, arguments: dict) -> ToolResult:
        raise NotImplementedError


class FunctionTool(Tool):
    """A plain Python function (sync or async) as a tool; the schema is generated from its signature."""

    def __init__(self, fn: Callable, schema: dict | None = None):
        from transformers.utils import get_json_schema

        if not callable(fn):
            raise ToolConfigError(f"tools: {fn!r} is not callable; give functions with type hints and a docstring")
        label = getattr(fn, "__name__", repr(fn))
        if schema is None:
            try:
                schema = get_json_schema(fn)
            except Exception as e:  # DocstringParsingException / TypeHintParsingException
                raise ToolConfigError(
                    f"tools: cannot build the schema of {label!r}: {e}",
                    "give it a type hint on every parameter and a Google-style docstring with an Args: block "
                    "(transformers.utils.get_json_schema)") from None
        schema = {k: v for k, v in schema.items()}
        schema["function"] = {k: v for k, v in schema.get("function", {}).items() if k != "return"}
        if (why := schema_problem(schema)) is not None:
            raise ToolConfigError(f"tools: the schema of {label!r} {why}")
        self.fn, self.schema, self.name = fn, schema, schema["function"]["name"]

    def invoke(self, arguments: dict) -> ToolResult:
        out = self.fn(**arguments)  # an async function's awaitable runs on a fresh event loop, this thread's own
        return ToolResult(as_text(asyncio.run(maybe_await(out)) if inspect.isawaitable(out) else out))


class BaseTool:
    """verl's tool class shape (subclass it, or any class with these methods): one instance per
    config entry; per call ``create`` -> ``execute`` -> ``release``, each sync or async."""

    def __init__(self, config: dict, tool_schema: dict):
        self.config, self.tool_schema = config, tool_schema
        self.name = tool_schema["function"]["name"]

    async def create(self, instance_id: str | None = None, **kwargs) -> tuple[str, Any]:
        import uuid

        return instance_id or uuid.uuid4().hex, None

    async def execute(self, instance_id: str, parameters: dict, **kwargs) -> tuple[Any, float, dict]:
        raise NotImplementedError

    async def release(self, instance_id: str, **kwargs) -> None:
        return None


class ClassTool(Tool):
    """An instance of a tool class from the config (``create`` / ``execute`` / ``release`` per call).
    ``source`` (class name, config): how a tool process rebuilds it instead of unpickling the instance."""

    def __init__(self, instance, schema: dict, source: tuple[str, dict] | None = None):
        self.instance, self.schema, self.name = instance, schema, schema["function"]["name"]
        self.source = source

    def __reduce__(self):
        if self.source is None:
            return ClassTool, (self.instance, self.schema)
        return _class_tool_from_config, (*self.source, self.schema)

    def invoke(self, arguments: dict) -> ToolResult:
        async def lifecycle():
            inst = self.instance
            created = await maybe_await(inst.create()) if hasattr(inst, "create") else None
            instance_id = created[0] if isinstance(created, tuple) else created
            try:
                return _class_result(await maybe_await(inst.execute(instance_id, arguments)))
            finally:
                if hasattr(inst, "release"):
                    await maybe_await(inst.release(instance_id))

        return asyncio.run(lifecycle())


def _class_tool_from_config(class_name: str, config: dict, schema: dict) -> ClassTool:
    """A config entry's tool, built as :func:`load_tool_config` builds it (in a tool process)."""
    instance = _import_class(class_name)(config=config, tool_schema=schema)
    return ClassTool(instance, schema, (class_name, config))


# ---------------------------------------------------------------------------------------------- config file
def imports_missing_verl(err: BaseException) -> bool:
    """``err`` is a user module's import of verl (or a part of it) where verl is not installed."""
    return isinstance(err, ImportError) and (err.name or "").split(".")[0] == "verl"


def _import_class(class_name: str):
    module_name, _, attr = class_name.rpartition(".")
    if not module_name:
        raise ImportError(f"{class_name!r} is not a dotted module path (module.Class)")
    return getattr(importlib.import_module(module_name), attr)


def imported_class(class_name: str, method: str, where: str, problems: list[str], label: str = "",
                   verl_fix: str = "") -> type | None:
    """The class ``class_name`` (module.Class) if it imports and has ``method`` (``"name(args)"``); else None, the
    reason appended to ``problems`` (with ``verl_fix`` where the module imports verl, which is not installed)."""
    try:
        cls = _import_class(class_name)
    except Exception as e:
        fix = verl_fix if imports_missing_verl(e) else ""
        problems.append(f"{where}: {label}{class_name!r} cannot be imported ({type(e).__name__}: {e}){fix}")
        return None
    if not callable(getattr(cls, method.split("(")[0], None)):
        problems.append(f"{where}: {class_name} has no {method} method")
        return None
    return cls


def yaml_entries(key: str, path: str, section: str | None, fields: str) -> list:
    """The non-empty list ``section`` of the YAML file at ``path`` (None: the file is that list), set by config key
    ``key``; a missing file, bad YAML or no such list raises :class:`ToolConfigError` naming the key and ``fields``."""
    from omegaconf import OmegaConf

    if not Path(path).is_file():
        raise ToolConfigError(f"{key}={path!r} does not exist")
    try:
        data = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    except Exception as e:
        raise ToolConfigError(f"{key}={path!r} is not valid YAML: {e}") from None
    entries = data if section is None else data.get(section) if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        shape = f"[{{{fields}}}]" if section is None else f"'{section}: [{{{fields}}}]'"
        raise ToolConfigError(f"{key}={path!r} must hold a non-empty list {shape}")
    return entries


def load_tool_config(path: str) -> list[Tool]:
    """The tools of a verl tool-config YAML (docs/agents.md, "Tools"); raises :class:`ToolConfigError` with
    every problem of the file, one per line, naming the entry."""
    entries = yaml_entries("actor_rollout_ref.rollout.multi_turn.tool_config_path", path, "tools",
                           "class_name, config, tool_schema")
    tools, problems = [], []
    for i, entry in enumerate(entries):
        where = f"{path}: tools[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
            problems.append(f"{where} needs class_name (module.Class), config and tool_schema")
            continue
        name, schema, config = entry["class_name"], entry.get("tool_schema"), entry.get("config") or {}
        if (why := schema_problem(schema)) is not None:
            problems.append(f"{where} ({name}): tool_schema {why}")
        elif not isinstance(config, dict):
            problems.append(f"{where}: config must be a mapping")
        elif config.get("type", "native") != "native":
            problems.append(f"{where}: config.type={config.get('type')!r}: only 'native' tools are built")
        elif cls := imported_class(name, "execute(instance_id, parameters)", where, problems, "class_name ",
                                   VERL_TOOLS_FIX):
            try:
                tools.append(ClassTool(cls(config=config, tool_schema=schema), schema, (name, config)))
            except Exception as e:
                problems.append(f"{where}: {name}(config=..., tool_schema=...) raised {type(e).__name__}: {e}")
    if problems:
        raise ToolConfigError("\n".join(problems))
    return tools


def build_tools(functions=None, tool_config_path: str | None = None) -> list[Tool]:
    """The run's tools: the config file's classes, then the Python functions; names must be unique."""
    tools = load_tool_config(tool_config_path) if tool_config_path else []
    for f in functions or []:
        tools.append(f if isinstance(f, Tool) else FunctionTool(f))
    if dup := sorted(n for n, c in Counter(t.name for t in tools).items() if c > 1):
        raise ToolConfigError(f"tools: the name(s) {dup} are given more than once; each tool needs its own name")
    unpicklable = [problem for t in tools if (problem := _pickling_problem(t)) is not None]
    if unpicklable:
        raise ToolConfigError("\n".join(unpicklable))
    return tools


def _pickling_problem(tool: Tool) -> str | None:
    """Why ``tool`` cannot travel to a tool process (None: it can)."""
    try:
        pickled_tools([tool])
    except Exception as e:
        return (f"tools: {tool.name!r} cannot be sent to a tool process ({type(e).__name__}: {e}); every call runs "
                f"in a process of its own (docs/agents.md), so a tool must be picklable: keep locks, open files, "
                f"clients and the like out of what it captures and create them on its first call")
    return None


# ---------------------------------------------------------------------------------------------- truncation
def truncate_response(text: str, limit: int, side: str) -> str:
    """verl's truncation of a tool response longer than ``limit`` characters: ``left`` keeps the end,
    ``right`` the start, ``middle`` both halves, each with a ``(truncated)`` marker."""
    if limit <= 0 or len(text) <= limit:
        return text
    if side == "left":
        return "(truncated)..." + text[-limit:]
    if side == "right":
        return text[:limit] + "...(truncated)"
    half = limit // 2
    return text[:half] + "...(truncated)..." + text[len(text) - half:]


# ---------------------------------------------------------------------------------------------- execution
@dataclass
class ToolOutcome:
    name: str
    text: str  # what goes into the conversation
    status: str  # ok | error | timeout | invalid (the call could not run: bad JSON, unknown tool)
    latency_s: float = 0.0
    reward: float | None = None


class ToolExecutor:
    """Runs a turn's tool calls concurrently in tool processes, each bounded by ``timeout_s`` (docs/agents.md,
    "Tools"); :meth:`close` kills the tool processes (also done when it is collected, or its process dies)."""

    def __init__(self, tools: list[Tool], timeout_s: float, max_response_length: int, truncate_side: str,
                 on_error: str = "text", processes: int | None = None):
        self.tools = {t.name: t for t in tools}
        self.timeout_s, self.limit, self.side, self.on_error = timeout_s, max_response_length, truncate_side, on_error
        self.pool = ToolProcessPool(tools, processes or POOL_SIZE) if tools else None
        self.warned: set[str] = set()  # tools whose first timeout was reported on stderr

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()

    @property
    def names(self) -> set[str]:
        return set(self.tools)

    async def warm(self) -> None:
        """Start the tool processes now (see ``ToolProcessPool.warm``); a start-up failure is a ToolFailure."""
        if self.pool is not None:
            try:
                await self.pool.warm()
            except ToolProcessStartError as e:
                raise ToolFailure(f"tools: {e}", START_FIX) from None

    async def run(self, calls) -> list[ToolOutcome]:
        """One outcome per call (``verl_lite.agent.tool_calls.ToolCall``), in order."""
        return list(await asyncio.gather(*(self._one(c) for c in calls)))

    async def _one(self, call) -> ToolOutcome:
        if call.error is not None:
            return ToolOutcome(call.name or "<invalid>", call.error, "invalid")

        start = time.perf_counter()
        try:
            reply = await self.pool.call(call.name, call.arguments, self.timeout_s)
        except ToolCallTimeout as e:
            self._warn_timeout(call.name)
            return self._failed(call.name, f"did not return within {self.timeout_s}s" + (f" ({e})" if str(e) else ""),
                                "timeout", start)
        except ToolProcessDied as e:
            return self._failed(call.name, str(e), "error", start)
        except ToolProcessStartError as e:
            raise ToolFailure(f"tool {call.name!r}: {e}", START_FIX) from None
        except TypeError as e:  # arguments that JSON cannot carry (a custom loop's call)
            return self._failed(call.name, f"{type(e).__name__}: {e}", "error", start)
        if "error" in reply:
            return self._failed(call.name, reply["error"], "error", start)
        text = truncate_response(reply["text"], self.limit, self.side)
        return ToolOutcome(call.name, text, "ok", time.perf_counter() - start, reply["reward"])

    def _warn_timeout(self, name: str) -> None:
        """One stderr line the first time ``name`` times out (the conversation gets the error text each time)."""
        if name not in self.warned and self.on_error != "fail":
            self.warned.add(name)
            print(f"verl_lite: warning: tool {name!r} did not return within actor_rollout_ref.rollout.multi_turn."
                  f"tool_timeout_s={self.timeout_s}s; its tool process was killed and the call answered with the "
                  f"error (agent/tool_timeouts counts them)", file=sys.stderr, flush=True)

    def _failed(self, name: str, what: str, status: str, start: float) -> ToolOutcome:
        if self.on_error == "fail":
            raise ToolFailure(f"tool {name!r} {'timed out: ' if status == 'timeout' else 'failed: '}{what}",
                              "fix the tool, raise actor_rollout_ref.rollout.multi_turn.tool_timeout_s, or set "
                              "multi_turn.tool_error=text to answer the model with the error instead")
        return ToolOutcome(name, f"Error executing tool '{name}': {what}", status, time.perf_counter() - start)
