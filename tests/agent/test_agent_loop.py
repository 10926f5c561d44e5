"""The agent loop's parts against independent expectations: the hermes parser, tool truncation, bounded
tool calls (raising, hanging, concurrent), and the loop over a scripted rollout backend (token/mask/log-prob
layout, one batched call per turn, turn and length limits, interactions, custom loops by name)."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.agent.conftest import ScriptedRollout
from verl_lite.agent import (AgentLoop, AgentRunner, AgentSpec, Interaction, InteractionTurn, ToolConfigError,
                             ToolFailure, parse_tool_calls, register_agent_loop)
from verl_lite.agent.tool_calls import ToolCall
from verl_lite.agent.preflight import multi_turn_values
from verl_lite.agent.tools import FunctionTool, ToolExecutor, truncate_response
from verl_lite.agent.config import MultiTurnConfig


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


async def mul(a: int, b: int) -> int:
    """Multiply two integers (async).

    Args:
        a: the first factor
        b: the second factor
    """
    await asyncio.sleep(0)
    return a * b


def call(name, **args):
    import json

    return "<tool_call>" + json.dumps({"name": name, "arguments": args}, separators=(",", ":")) + "</tool_call>"


# ------------------------------------------------------------------------------------------- parser
def test_parser_text_around_calls_and_several_calls():
    text = "I will add." + call("add", a=1, b=2) + "and" + call("mul", a=3, b=4) + "done"
    content, calls = parse_tool_calls(text, {"add", "mul"})
    assert content == "I will add.anddone"
    assert [(c.name, c.arguments, c.error) for c in calls] == [("add", {"a": 1, "b": 2}, None),
                                                               ("mul", {"a": 3, "b": 4}, None)]


def test_parser_malformed_json_unknown_tool_and_no_call():
    content, calls = parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>', {"add"})
    assert len(calls) == 1 and calls[0].error.startswith("Invalid JSON")
    _, calls = parse_tool_calls(call("divide", a=1), {"add", "mul"})
    assert calls[0].name == "divide" and "Unknown function 'divide'" in calls[0].error and "['add', 'mul']" in calls[0].error
    _, calls = parse_tool_calls('<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>', {"add"})
    assert "expected a JSON object" in calls[0].error
    _, calls = parse_tool_calls('<tool_call>["add"]</tool_call>', {"add"})
    assert calls[0].error.startswith("Invalid tool call")
    assert parse_tool_calls("no call <tool_call> unterminated", {"add"}) == ("no call <tool_call> unterminated", [])


def test_truncation_left_right_middle_as_verl():
    text = "abcdefghij"
    assert truncate_response(text, 4, "left") == "(truncated)...ghij"
    assert truncate_response(text, 4, "right") == "abcd...(truncated)"
    assert truncate_response(text, 4, "middle") == "ab...(truncated)...ij"
    assert truncate_response(text, 10, "left") == text


# ------------------------------------------------------------------------------------------- tools
def test_function_schema_from_hints_and_docstring():
    tool = FunctionTool(add)
    assert tool.name == "add"
    params = tool.schema["function"]["parameters"]
    assert params["properties"]["a"] == {"type": "integer", "description": "the first number"}
    assert params["required"] == ["a", "b"]

    def undocumented(x):
        return x

    with pytest.raises(ToolConfigError, match="undocumented"):
        FunctionTool(undocumented)


def _run(executor, calls):
    return asyncio.run(executor.run(calls))


def test_raising_tool_is_error_text_or_a_run_failure():
    def boom(x: int) -> int:
        """Fails.

        Args:
            x: anything
        """
        raise RuntimeError("disk on fire")

    ex = ToolExecutor([FunctionTool(boom), FunctionTool(mul)], 5.0, 256, "middle", "text")
    out = _run(ex, [ToolCall("boom", {"x": 1}), ToolCall("mul", {"a": 6, "b": 7})])
    assert out[0].status == "error" and "disk on fire" in out[0].text and "boom" in out[0].text
    assert (out[1].status, out[1].text) == ("ok", "42")  # the async tool, next to the failing one
    ex.on_error = "fail"
    with pytest.raises(ToolFailure, match="boom"):
        _run(ex, [ToolCall("boom", {"x": 1})])


def test_hanging_tool_is_bounded_by_its_timeout():
    def hang(x: int) -> str:
        """Never returns in time.

        Args:
            x: anything
        """
        time.sleep(30)
        return "late"

    ex = ToolExecutor([FunctionTool(hang), FunctionTool(add)], 0.5, 256, "middle", "text")
    start = time.perf_counter()
    out = _run(ex, [ToolCall("hang", {"x": 1}), ToolCall("add", {"a": 1, "b": 1})])
    assert time.perf_counter() - start < 20  # far below the tool's 30 s: it was stopped (a loaded machine's margin)
    assert out[0].status == "timeout" and "did not return within 0.5s" in out[0].text
    assert out[1].text == "2"


def test_calls_of_a_turn_run_concurrently(tmp_path):
    """Each call marks its arrival, then waits (up to 30 s) for the other three: calls run one after another would
    leave the first alone. A barrier, not a clock: a loaded machine that starts the processes late still passes."""
    arrivals = str(tmp_path)

    def meet(x: int) -> str:
        """Marks its arrival and waits for the turn's other calls.

        Args:
            x: this call's index
        """
        import os
        import time as clock

        open(os.path.join(arrivals, str(x)), "w").close()
        deadline = clock.monotonic() + 30
        while len(os.listdir(arrivals)) < 4 and clock.monotonic() < deadline:
            clock.sleep(0.01)
        return f"{x} {'met' if len(os.listdir(arrivals)) == 4 else 'alone'}"

    ex = ToolExecutor([FunctionTool(meet)], 60.0, 256, "middle", "text")
    out = _run(ex, [ToolCall("meet", {"x": i}) for i in range(4)])
    assert [o.text for o in out] == [f"{i} met" for i in range(4)], "the four calls of one turn did not run at once"


# ------------------------------------------------------------------------------------------- loop
def _spec(**mt) -> AgentSpec:
    values = multi_turn_values(MultiTurnConfig())
    values.update(enable=True, **mt)
    budget = values.pop("budget", 200)
    return AgentSpec(multi_turn=values, default_agent_loop="tool_agent", functions=[add, mul],
                     interactions=values.pop("interactions", {}), max_response_length=budget)


def _rows(tokenizer, n):
    from verl_lite.data.dataset import encode_prompt

    tools = [FunctionTool(add).schema, FunctionTool(mul).schema]
    rows = []
    for i in range(n):
        messages = [{"role": "user", "content": f"{i}+{i}="}]
        rows.append({"prompt_ids": encode_prompt(tokenizer, messages, tools), "messages": messages,
                     "data_source": "t", "ground_truth": str(2 * i), "extra_info": {}, "agent_name": None})
    return rows


def _segments(mask):
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((mask[start], i - start))
            start = i
    return out


def test_tool_round_trip_layout_and_one_batched_call_per_turn(tool_tokenizer):
    tok = tool_tokenizer
    script = lambda turn, text: call("add", a=2, b=3) if turn == 0 else "5"  # noqa: E731
    rollout = ScriptedRollout(tok, script)
    runner = AgentRunner(rollout, tok, _spec())
    rows = _rows(tok, 3)
    outs = runner.run(rows, seeds=[11, 12, 13], sampling={"n": 2, "do_sample": True, "temperature": 1.0,
                                                          "max_new_tokens": 99})
    assert len(outs) == 6
    assert [c["batch"] for c in rollout.calls] == [6, 6]  # every live trajectory in one call per turn
    first = tok.encode(call("add", a=2, b=3), add_special_tokens=False) + [tok.eos_token_id]
    env = tok.encode("<|user|><tool_response>5</tool_response><|assistant|>", add_special_tokens=False)
    last = tok.encode("5", add_special_tokens=False) + [tok.eos_token_id]
    for o in outs:
        assert o["response_ids"] == first + env + last
        assert _segments(o["response_mask"]) == [(1, len(first)), (0, len(env)), (1, len(last))]
        assert all((lp == -0.5) == (m == 1) for lp, m in zip(o["log_probs"], o["response_mask"]))
        s = o["agent_stats"]
        assert (s["assistant_turns"], s["user_turns"], s["tool_calls"], s["tool_errors"], s["stop_reason"]) == \
            (2, 1, 1, 0, "no_tool_call")
        assert (s["model_tokens"], s["env_tokens"]) == (len(first) + len(last), len(env))
    # per-trajectory turn seeds: distinct over samples and turns, a function of (prompt seed, k, turn)
    seeds = rollout.calls[0]["seeds"] + rollout.calls[1]["seeds"]
    assert len(set(seeds)) == 12
    # the second turn is bounded by what is left of the response
    assert rollout.calls[1]["max_new_tokens"] == 200 - len(first) - len(env)


def test_turn_limits(tool_tokenizer):
    tok = tool_tokenizer
    always = lambda turn, text: call("add", a=turn, b=1)  # noqa: E731
    out = AgentRunner(ScriptedRollout(tok, always), tok, _spec(max_assistant_turns=3, budget=1000)).run(
        _rows(tok, 1), None, {"n": 1, "do_sample": False})[0]["agent_stats"]
    assert (out["assistant_turns"], out["user_turns"], out["stop_reason"]) == (3, 2, "max_assistant_turns")
    out = AgentRunner(ScriptedRollout(tok, always), tok, _spec(max_user_turns=1, budget=1000)).run(
        _rows(tok, 1), None, {"n": 1, "do_sample": False})[0]["agent_stats"]
    assert (out["assistant_turns"], out["user_turns"], out["stop_reason"]) == (2, 1, "max_user_turns")


def test_max_response_length_bounds_model_and_environment_tokens(tool_tokenizer):
    tok = tool_tokenizer
    always = lambda turn, text: call("add", a=1, b=1)  # noqa: E731
    first = len(tok.encode(call("add", a=1, b=1), add_special_tokens=False)) + 1
    env = len(tok.encode("<|user|><tool_response>2</tool_response><|assistant|>", add_special_tokens=False))
    for budget in (first + 3, first + env + 5):  # the env segment does not fit / the second model turn is cut
        o = AgentRunner(ScriptedRollout(tok, always), tok, _spec(budget=budget)).run(
            _rows(tok, 1), None, {"n": 1, "do_sample": False})[0]
        assert len(o["response_ids"]) <= budget and o["agent_stats"]["stop_reason"] == "max_response_length"
        assert o["response_mask"][-1] == 1  # an environment segment that does not fit is not added
    assert len(o["response_ids"]) == budget and _segments(o["response_mask"]) == [(1, first), (0, env), (1, 5)]


def test_parallel_calls_up_to_max_parallel_calls_and_invalid_calls_answered(tool_tokenizer):
    tok = tool_tokenizer
    calls3 = call("add", a=1, b=1) + call("mul", a=2, b=3) + call("add", a=5, b=5)
    script = lambda turn, text: calls3 if turn == 0 else "ok"  # noqa: E731
    o = AgentRunner(ScriptedRollout(tok, script), tok, _spec(max_parallel_calls=2, budget=1000)).run(
        _rows(tok, 1), None, {"n": 1, "do_sample": False})[0]
    env = [t for t, m in zip(o["response_ids"], o["response_mask"]) if m == 0]
    assert tok.decode(env) == "<|user|><tool_response>2</tool_response><|user|><tool_response>6</tool_response><|assistant|>"
    assert (o["agent_stats"]["tool_calls"], o["agent_stats"]["dropped_tool_calls"]) == (2, 1)
    bad = lambda turn, text: call("nope", a=1) if turn == 0 else "ok"  # noqa: E731
    o = AgentRunner(ScriptedRollout(tok, bad), tok, _spec()).run(_rows(tok, 1), None, {"n": 1, "do_sample": False})[0]
    env = tok.decode([t for t, m in zip(o["response_ids"], o["response_mask"]) if m == 0])
    assert "Unknown function 'nope'" in env and o["agent_stats"]["tool_errors"] == 1


class CountDown(Interaction):
    def start(self, row):
        return {"left": 2}

    def respond(self, state, messages):
        state["left"] -= 1
        assert messages[-1]["role"] == "assistant"
        return InteractionTurn("again", reward=0.25, done=state["left"] < 0)


def test_interaction_plays_the_user_with_per_turn_rewards(tool_tokenizer):
    tok = tool_tokenizer
    o = AgentRunner(ScriptedRollout(tok, lambda turn, text: "7"), tok, _spec(interactions={"c": CountDown()})).run(
        _rows(tok, 2), None, {"n": 1, "do_sample": False})
    for t in o:
        assert t["turn_scores"] == [0.25, 0.25, 0.25]
        assert (t["agent_stats"]["assistant_turns"], t["agent_stats"]["stop_reason"]) == (3, "interaction_done")
        assert [m for m, _ in _segments(t["response_mask"])] == [1, 0, 1, 0, 1]


@register_agent_loop("echo_twice_test")
class EchoTwice(AgentLoop):
    async def run(self, traj, ctx):
        await ctx.model_turn(traj)
        traj.add_env(ctx.env_ids([{"role": "user", "content": "more"}]))
        await ctx.model_turn(traj)
        traj.stop_reason = "custom"
        return traj


def test_a_custom_loop_is_chosen_by_the_rows_agent_name(tool_tokenizer):
    tok = tool_tokenizer
    rows = _rows(tok, 2)
    rows[1]["agent_name"] = "echo_twice_test"
    rollout = ScriptedRollout(tok, lambda turn, text: "1")
    out = AgentRunner(rollout, tok, _spec()).run(rows, None, {"n": 1, "do_sample": False})
    assert [o["agent_stats"]["stop_reason"] for o in out] == ["no_tool_call", "custom"]
    assert [c["batch"] for c in rollout.calls] == [2, 1]
    rows[0]["agent_name"] = "missing_loop"
    with pytest.raises(ToolConfigError, match="missing_loop"):
        AgentRunner(rollout, tok, _spec()).run(rows, None, {"n": 1, "do_sample": False})


def nap(seconds: float) -> str:
    """Sleep, then answer (a tool with a latency of its own).

    Args:
        seconds: how long to sleep
    """
    time.sleep(seconds)
    return "done"


@pytest.mark.parametrize("batch_wait_s", [None, 0.2])
def test_a_slow_tool_holds_no_other_trajectory(tool_tokenizer, batch_wait_s):
    """Prompt 0's tool call takes 4 s, the others' return at once. Lockstep (batch_wait_s=None): every second turn
    waits for it (two backend calls of 6). Without the barrier: the fast trajectories' second turns go after
    batch_wait_s, while prompt 0's tool still runs, and prompt 0's turn goes alone when its tool returns; the
    trajectories are the same either way."""
    tok = tool_tokenizer
    slow = 4.0

    def script(turn, text):
        if turn == 0:
            return call("nap", seconds=slow if "0+0=" in text else 0.0)
        return "5"

    spec = _spec(batch_wait_s=batch_wait_s, max_parallel_calls=1)
    spec.functions = [nap]
    rollout = ScriptedRollout(tok, script)
    began = time.monotonic()
    outs = AgentRunner(rollout, tok, spec).run(_rows(tok, 3), seeds=[1, 2, 3],
                                               sampling={"n": 2, "do_sample": True, "temperature": 1.0})
    assert all(o["agent_stats"]["stop_reason"] == "no_tool_call" for o in outs)
    assert len({tuple(o["response_ids"]) for o in outs[2:]}) == 1
    batches = [c["batch"] for c in rollout.calls]
    if batch_wait_s is None:
        assert batches == [6, 6]
    else:
        # the fast four's second turns went (in one call, or more on a loaded machine) before the 4 s tool returned
        assert batches[0] == 6 and batches[-1] == 2 and sum(batches[1:-1]) == 4, batches
    assert time.monotonic() - began >= slow
