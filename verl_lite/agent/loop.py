"""The agent loop: multi-turn rollouts with tools and interactions, token in, token out.

A trajectory is the prompt ids plus model segments (mask 1, the rollout's log-probs) and environment segments
(mask 0, log-prob 0), all bounded by ``data.max_response_length``; :class:`_TurnBatcher` batches the waiting
turns, :func:`turn_seed` seeds each one, ``@register_agent_loop`` names the loops
(docs/agents.md, "The token / mask contract" and "The built-in loops and your own").
"""

from __future__ import annotations

import asyncio
import functools
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

from verl_lite.agent.tool_calls import FORMATS, parse_tool_calls, stop_token_ids
from verl_lite.agent.interaction import Interaction, load_interaction_config
from verl_lite.agent.tools import ToolConfigError, ToolExecutor, build_tools, imported_class, maybe_await, yaml_entries

AGENT_LOOPS: dict[str, type] = {}


def register_agent_loop(name: str) -> Callable[[type], type]:
    """Class decorator: make an agent loop class available as ``agent_name`` / ``default_agent_loop``."""
    def decorator(cls: type) -> type:
        AGENT_LOOPS[name] = cls
        return cls

    return decorator


def load_agent_loop_config(path: str) -> dict[str, type]:
    """verl's agent-loop config YAML (a list of ``{name, _target_}``) -> name -> class (imported)."""
    entries = yaml_entries("actor_rollout_ref.rollout.agent.agent_loop_config_path", path, None,
                           "name, _target_: module.Class")
    out, problems = {}, []
    for i, e in enumerate(entries):
        if not isinstance(e, dict) or not isinstance(e.get("name"), str) or not isinstance(e.get("_target_"), str):
            problems.append(f"{path}: entry {i} needs name and _target_ (module.Class)")
        elif cls := imported_class(e["_target_"], "run(traj, ctx)", f"{path}: entry {i} ({e['name']})", problems):
            out[e["name"]] = cls
    if problems:
        raise ToolConfigError("\n".join(problems))
    return out


def agent_loops(config_path: str | None) -> dict[str, type]:
    """The registered agent loops and those of ``agent.agent_loop_config_path`` (None: no file)."""
    return {**AGENT_LOOPS, **(load_agent_loop_config(config_path) if config_path else {})}


# ============================================================================================ trajectory
@dataclass
class Trajectory:
    """One rollout: ``prompt_ids`` + ``response_ids`` with ``response_mask`` (1 model, 0 environment) and
    ``log_probs`` (the rollout's on model tokens, 0.0 on environment tokens), all of one length."""

    prompt_ids: list[int]
    messages: list[dict]  # the conversation as text (prompt messages, decoded model turns, env turns)
    row: dict  # the dataset row (data_source, ground_truth, extra_info, ...)
    budget: int  # data.max_response_length: the whole response's bound
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    segment_versions: list = field(default_factory=list)  # the policy version of each model segment, in order
    assistant_turns: int = 0
    user_turns: int = 0  # environment turns: tool-response rounds and interaction (user) turns, as verl counts
    tool_calls: int = 0  # calls run or answered (invalid ones included)
    tool_errors: int = 0  # raised, or could not run (malformed JSON, unknown tool, bad arguments)
    tool_timeouts: int = 0
    dropped_tool_calls: int = 0  # calls of a turn beyond max_parallel_calls (not run, as verl)
    tool_latency_s: dict[str, list[float]] = field(default_factory=dict)
    turn_scores: list[float] = field(default_factory=list)  # interactions' per-turn rewards
    tool_rewards: list[float] = field(default_factory=list)
    stop_reason: str = ""
    extra: dict = field(default_factory=dict)  # free space for custom loops
    # MoE routing replay (R3): each token's experts [prompt + response so far, layers, k], per segment: a token keeps
    # the routing of the call that first fed it to the model (the prompt: the first prefill; a model token: the
    # decode step after its draw; an environment token: the next call's prefill)
    routing: object = None

    def room(self) -> int:
        """Response tokens still allowed (model and environment together)."""
        return self.budget - len(self.response_ids)

    def add_model(self, ids: list[int], log_probs: list[float], version: int | None = None, routing=None) -> None:
        """A model segment; ``routing``: the call's recorded routing of prompt + response so far + ``ids``."""
        if len(ids) != len(log_probs):
            raise ValueError(f"model segment: {len(ids)} tokens but {len(log_probs)} log-probs")
        if len(ids) > self.room():
            raise ValueError(f"model segment of {len(ids)} tokens exceeds the {self.room()} left of the response")
        if routing is not None:
            self._merge_routing(routing[: len(self.prompt_ids) + len(self.response_ids) + len(ids)])
        self.response_ids += list(ids)
        self.response_mask += [1] * len(ids)
        self.log_probs += [float(x) for x in log_probs]
        self.segment_versions.append(version)

    def _merge_routing(self, call_routing) -> None:
        """Take ``call_routing`` where this trajectory has none yet (see ``routing``)."""
        from verl_lite.engine.moe import UNKNOWN_EXPERT

        merged = call_routing.clone()
        if self.routing is not None:
            kept = self.routing[: merged.shape[0]]
            known = (kept != UNKNOWN_EXPERT).all(-1)
            merged[: kept.shape[0]][known] = kept[known]
        self.routing = merged

    def _padded_routing(self):
        import torch

        from verl_lite.engine.moe import UNKNOWN_EXPERT

        length = len(self.prompt_ids) + len(self.response_ids)
        pad = self.routing.new_full((length - self.routing.shape[0], *self.routing.shape[1:]), UNKNOWN_EXPERT)
        return torch.cat([self.routing, pad])

    def add_env(self, ids: list[int]) -> bool:
        """Append environment tokens (mask 0). False (nothing added) when they do not fit the response."""
        if len(ids) > self.room():
            return False
        self.response_ids += list(ids)
        self.response_mask += [0] * len(ids)
        self.log_probs += [0.0] * len(ids)
        return True

    def output(self) -> dict:
        """What the worker sends back: tokens, mask, log-probs, per-turn rewards and the stats metrics use (and the
        routing, ``UNKNOWN_EXPERT`` on the tokens no call fed: the trailing ones)."""
        from verl_lite.protocol import ROUTED_EXPERTS_KEY  # lazy: tool processes import this package, not torch

        model = sum(self.response_mask)
        routing = {} if self.routing is None else {ROUTED_EXPERTS_KEY: self._padded_routing()}
        return {**routing,
            "response_ids": self.response_ids, "response_mask": self.response_mask, "log_probs": self.log_probs,
            "turn_scores": list(self.turn_scores), "tool_rewards": list(self.tool_rewards),
            "segment_versions": list(self.segment_versions),
            "agent_stats": {
                "assistant_turns": self.assistant_turns, "user_turns": self.user_turns,
                "tool_calls": self.tool_calls, "tool_errors": self.tool_errors, "tool_timeouts": self.tool_timeouts,
                "dropped_tool_calls": self.dropped_tool_calls, "tool_latency_s": self.tool_latency_s,
                "model_tokens": model, "env_tokens": len(self.response_mask) - model, "stop_reason": self.stop_reason,
            },
        }


# ============================================================================================ glue
SENTINEL_USER, SENTINEL_ASSISTANT = "verl_lite_probe_user", "verl_lite_probe_assistant"


class ChatGlue:
    """Environment ids for new messages after a model turn: the probe render's difference plus the template's text
    after the assistant's EOS; with ``escape_special_tokens`` a special-token string in a message's content is
    encoded as plain text (docs/agents.md, "The token / mask contract" and "Tools": "Escaped")."""

    def __init__(self, tokenizer, tool_schemas: list[dict] | None = None, escape_special_tokens: bool = True):
        self.tokenizer, self.tools = tokenizer, tool_schemas or None
        self.control_strings = [t for t in tokenizer.get_added_vocab() if t] if escape_special_tokens else []

    def _render(self, messages: list[dict], generation_prompt: bool) -> str:
        kw = {"tools": self.tools} if self.tools else {}
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **kw)

    def text(self, new_messages: list[dict]) -> str:
        base = [{"role": "user", "content": SENTINEL_USER}, {"role": "assistant", "content": SENTINEL_ASSISTANT}]
        before = self._render(base, False)
        after = self._render(base + list(new_messages), True)
        if not after.startswith(before):
            raise ValueError("the chat template renders a conversation differently once messages are added; "
                             "multi-turn rollouts need a template that appends turns")
        end_of_assistant = before[before.rindex(SENTINEL_ASSISTANT) + len(SENTINEL_ASSISTANT):]
        eos = self.tokenizer.eos_token
        tail = end_of_assistant.split(eos, 1)[1] if eos and eos in end_of_assistant else end_of_assistant
        return tail + after[len(before):]

    def ids(self, new_messages: list[dict]) -> list[int]:
        contents = [m.get("content") for m in new_messages]
        if not any(isinstance(c, str) and any(t in c for t in self.control_strings) for c in contents):
            return self.tokenizer.encode(self.text(new_messages), add_special_tokens=False)
        marks = [f"{SENTINEL_USER}_content_{i}_end" for i in range(len(new_messages))]
        rest = self.text([{**m, "content": mark} if isinstance(c, str) else m
                          for m, c, mark in zip(new_messages, contents, marks)])
        if any(isinstance(c, str) and rest.count(mark) != 1 for c, mark in zip(contents, marks)):
            raise ValueError("the chat template does not render a message's content as it is; "
                             "multi_turn.escape_special_tokens=false encodes the whole text instead")
        ids: list[int] = []
        for content, mark in zip(contents, marks):
            if isinstance(content, str):
                head, rest = rest.split(mark, 1)
                ids += self.tokenizer.encode(head, add_special_tokens=False)
                ids += self.tokenizer.encode(content, add_special_tokens=False, split_special_tokens=True)
        return ids + self.tokenizer.encode(rest, add_special_tokens=False)

    def problem(self, role: str) -> str | None:
        """Why the template cannot carry ``role`` messages (None: it renders their content)."""
        probe = "verl_lite_probe_content_1234"
        try:
            text = self.text([{"role": role, "content": probe}])
        except Exception as e:
            return f"rendering a {role!r} turn after an assistant turn fails ({type(e).__name__}: {e})"
        if probe not in text:
            return f"the chat template does not render {role!r} messages (their text would vanish from the conversation)"
        return None


# ============================================================================================ loops
class AgentLoop:
    """Base class: ``async run(traj, ctx) -> Trajectory``. ``ctx`` (:class:`AgentContext`) gives ``model_turn``,
    ``call_tools``, ``env_ids`` (glue), ``tokenizer``, ``interaction`` and the multi_turn settings."""

    def __init__(self, **config):
        self.config = config

    async def run(self, traj: Trajectory, ctx: "AgentContext") -> Trajectory:
        raise NotImplementedError


@register_agent_loop("single_turn_agent")
class SingleTurnAgentLoop(AgentLoop):
    """One model turn (what the single-turn rollout does)."""

    async def run(self, traj: Trajectory, ctx: "AgentContext") -> Trajectory:
        await ctx.model_turn(traj)
        traj.stop_reason = "single_turn"
        return traj


@register_agent_loop("tool_agent")
class ToolAgentLoop(AgentLoop):
    """verl's ToolAgentLoop: a model turn; stop at the turn limits or the length bound; its tool calls
    (``multi_turn.format``) -> the tools, the first ``max_parallel_calls`` concurrently; no call -> the row's
    interaction, if any, plays the user; else the trajectory ends."""

    async def run(self, traj: Trajectory, ctx: "AgentContext") -> Trajectory:
        state = await maybe_await(ctx.interaction.start(traj.row)) if ctx.interaction is not None else None
        try:
            while not traj.stop_reason:
                traj.stop_reason = await self._round(traj, ctx, state)
            return traj
        finally:  # the interaction's instance ends with the trajectory, whatever ended it (verl's rule)
            if callable(finish := getattr(ctx.interaction, "finish", None)):
                await maybe_await(finish(state))

    async def _round(self, traj: Trajectory, ctx: "AgentContext", state) -> str:
        """One model turn and the environment's answer to it; why the trajectory ends ("": it goes on)."""
        mt = ctx.multi_turn
        text = await ctx.model_turn(traj)  # none when no room is left
        if traj.room() <= 0:
            return "max_response_length"
        for limit, count in (("max_assistant_turns", traj.assistant_turns), ("max_user_turns", traj.user_turns)):
            if mt.get(limit) and count >= mt[limit]:
                return limit
        content, calls = parse_tool_calls(text, ctx.tool_names, mt["format"])
        run = calls[: mt.get("max_parallel_calls") or 1]
        traj.dropped_tool_calls += len(calls) - len(run)
        traj.messages.append({"role": "assistant", "content": content})
        if run:
            traj.messages[-1]["tool_calls"] = [
                {"type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in run]
            new = [{"role": "tool", "content": t} for t in await ctx.call_tools(traj, run)]
        elif ctx.interaction is None:
            return "no_tool_call"
        else:
            turn = await maybe_await(ctx.interaction.respond(state, list(traj.messages)))
            if turn.reward is not None:
                traj.turn_scores.append(float(turn.reward))
            if turn.done:
                return "interaction_done"
            new = [{"role": "user", "content": turn.text}]
        if not traj.add_env(ctx.env_ids(new)):
            return "max_response_length"
        traj.messages += new
        traj.user_turns += 1
        return ""


# ============================================================================================ runner
def turn_seed(prompt_seed: int, sample: int, turn: int) -> int:
    """The seed of model turn ``turn`` of sample ``sample`` of a prompt seeded ``prompt_seed``."""
    return (int(prompt_seed) * 1_000_003 + sample * 10_007 + turn * 7_919 + 1) % (2**31 - 1)


class VersionedRollout:
    """A rollout and the policy version it holds, for generations that run beside weight loads (another thread).

    ``generate_versioned`` and ``load`` exclude each other, so every call is generated by one version, which it
    reports. A load interrupts the running call where the backend can (``Rollout.interruptible``) and is applied
    as soon as it returns; the turns it cut short go on with the new weights (``AgentContext.model_turn``)."""

    def __init__(self, rollout, version: int | None = None):
        self.rollout, self.version = rollout, version
        self.lock = threading.Lock()  # held by the generation call or the load running
        self.gate = threading.Lock()  # a waiting load holds it: no new call starts before the load is applied
        self.load_waiting = threading.Event()

    def generate_versioned(self, prompt_ids: list[list[int]], **sampling) -> tuple[list[dict], int | None]:
        if getattr(self.rollout, "interruptible", False):
            sampling["interrupt"] = self.load_waiting.is_set
        with self.gate:
            self.lock.acquire()
        try:
            return self.rollout.generate(prompt_ids, **sampling), self.version
        finally:
            self.lock.release()

    def pause(self) -> None:
        """Hold the rollout for another thread's use: cuts the running call short, waits for it to return; no
        call starts until :meth:`resume`."""
        self.load_waiting.set()
        self.gate.acquire()
        self.lock.acquire()

    def resume(self, version: int | None = None) -> None:
        """Let calls run again (on policy ``version`` from now, when given)."""
        if version is not None:
            self.version = int(version)
        self.lock.release()
        self.gate.release()
        self.load_waiting.clear()

    def load(self, named_tensors, version: int) -> int:
        self.pause()
        try:
            loaded = self.rollout.load_weights(named_tensors)
        except BaseException:
            self.resume()
            raise
        self.resume(version)
        return loaded


def _backend_thread_setup(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


class _TurnBatcher:
    """Sends the waiting model turns to the backend (on a thread of its own) as ONE call once every live trajectory
    waits or the oldest turn has waited ``batch_wait_s`` (None: lockstep) (docs/agents.md, "Batched, without a
    barrier"). That thread computes on half the process's intra-op threads (at least one): a second OpenMP team as
    large as the main thread's contends with it for the same cores (docs/performance.md)."""

    def __init__(self, rollout, sampling: dict, live: int, batch_wait_s: float | None):
        import torch

        self.rollout, self.sampling, self.live, self.batch_wait_s = rollout, sampling, live, batch_wait_s
        self.backend = ThreadPoolExecutor(1, "rollout-backend", initializer=_backend_thread_setup,
                                          initargs=(max(1, torch.get_num_threads() // 2),))
        self.waiting: list[tuple[list[int], int, int | None, asyncio.Future]] = []
        self.oldest_since: float | None = None  # when the oldest waiting turn arrived
        self.wake = asyncio.Event()
        self.calls = 0  # backend calls made

    async def generate(self, ids: list[int], max_new: int, seed: int | None) -> tuple:
        """The turn's tokens, their log-probs, the policy version that generated them, whether a weight load
        cut the turn short (``VersionedRollout``) and the call's routing (MoE with record_routing; else None)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        if not self.waiting:
            self.oldest_since = loop.time()
        self.waiting.append((ids, max_new, seed, future))
        self.wake.set()
        return await future

    def started(self, count: int) -> None:
        self.live += count
        self.wake.set()

    def finished(self) -> None:
        self.live -= 1
        self.wake.set()

    def close(self) -> None:
        """Let the backend thread end (once its running call, if any, returns)."""
        self.backend.shutdown(wait=False)

    def _wait_left(self, now: float) -> float | None:
        """0 when the waiting turns should go now, else how long to wait at most (None: until woken)."""
        if not self.waiting:
            return None
        if len(self.waiting) >= self.live:
            return 0.0
        if self.batch_wait_s is None:
            return None
        return max(0.0, self.oldest_since + self.batch_wait_s - now)

    async def serve(self, forever: bool = False) -> None:
        """Until no trajectory is live (``forever``: until cancelled, for a stream that is fed new ones)."""
        loop = asyncio.get_running_loop()
        while self.live > 0 or forever:
            left = self._wait_left(loop.time())
            if left != 0.0:
                self.wake.clear()
                try:
                    await asyncio.wait_for(self.wake.wait(), left)
                except asyncio.TimeoutError:
                    pass
                continue
            batch, self.waiting = self.waiting, []
            await self._flush(batch)

    async def _flush(self, batch) -> None:
        from verl_lite.protocol import ROUTED_EXPERTS_KEY

        seeds = [s for _, _, s, _ in batch]
        kw = dict(self.sampling, n=1, max_new_tokens=max(m for _, m, _, _ in batch))
        if all(s is not None for s in seeds):
            kw["seeds"] = seeds
        try:
            prompts = [ids for ids, _, _, _ in batch]
            outs, version = await asyncio.get_running_loop().run_in_executor(
                self.backend, functools.partial(self.rollout.generate_versioned, prompts, **kw))
            self.calls += 1
        except BaseException as e:
            for *_, future in batch:
                future.set_exception(e)
            return
        for (_, max_new, _, future), o in zip(batch, outs):
            lp = o["log_probs"]
            lp = lp.tolist() if hasattr(lp, "tolist") else list(lp)
            future.set_result((list(o["response_ids"])[:max_new], lp[:max_new], version, bool(o.get("interrupted")),
                               o.get(ROUTED_EXPERTS_KEY)))


@dataclass
class AgentSpec:
    """Everything a worker needs to build its agent runner (picklable; sent once with ``init_agent``)."""

    multi_turn: dict  # the actor_rollout_ref.rollout.multi_turn values
    default_agent_loop: str = "single_turn_agent"
    agent_loop_config_path: str | None = None
    functions: list = field(default_factory=list)  # Python-API tools (callables)
    interactions: dict = field(default_factory=dict)  # Python-API interactions: name -> instance
    max_response_length: int = 16
    tool_schemas: list = field(default_factory=list)  # OpenAI schemas of every tool (rendered into the prompts)


class AgentContext:
    """What an agent loop may use for one trajectory (see :class:`AgentLoop`)."""

    def __init__(self, runner: "AgentRunner", batcher: _TurnBatcher, seed: int | None, sample: int,
                 interaction: Interaction | None):
        self.runner, self.batcher, self.seed, self.sample, self.interaction = runner, batcher, seed, sample, interaction
        self.tokenizer, self.multi_turn = runner.tokenizer, runner.spec.multi_turn
        self.tool_names = runner.executor.names

    async def model_turn(self, traj: Trajectory) -> str:
        """Generate the next model turn into ``traj`` (at most its room); returns the turn's text."""
        if traj.room() <= 0:
            return ""
        seed = None if self.seed is None else turn_seed(self.seed, self.sample, traj.assistant_turns)
        turn: list[int] = []
        while True:  # a turn a weight load cut short goes on with the new weights, one segment per version
            ids, lps, version, interrupted, routing = await self.batcher.generate(traj.prompt_ids + traj.response_ids,
                                                                                  traj.room(), seed)
            traj.add_model(ids, lps, version, routing)
            turn += ids
            if not interrupted or traj.room() <= 0:
                break
            seed = None if seed is None else turn_seed(seed, 0, len(turn))
        traj.assistant_turns += 1
        keep = bool(FORMATS[self.multi_turn["format"]].special_tokens)  # the format's calls are written with them
        return self.tokenizer.decode(turn, skip_special_tokens=not keep)

    async def call_tools(self, traj: Trajectory, calls) -> list[str]:
        """Run the calls concurrently (each bounded); record the stats; the response texts in order."""
        outcomes = await self.runner.executor.run(calls)
        for o in outcomes:
            traj.tool_calls += 1
            traj.tool_errors += o.status in ("error", "invalid")
            traj.tool_timeouts += o.status == "timeout"
            if o.status != "invalid":
                traj.tool_latency_s.setdefault(o.name, []).append(o.latency_s)
            if o.reward is not None:
                traj.tool_rewards.append(o.reward)
        return [o.text for o in outcomes]

    def env_ids(self, new_messages: list[dict]) -> list[int]:
        return self.runner.glue.ids(new_messages)


class AgentRunner:
    """A worker's agent rollouts: ``run(rows, seeds, sampling)`` -> one output dict per trajectory,
    prompt-major (``sampling['n']`` per row), as ``Rollout.generate`` orders them."""

    def __init__(self, rollout, tokenizer, spec: AgentSpec):
        """``rollout``: a backend (``rollout.base.Rollout``), or a ``VersionedRollout`` when weights are loaded
        while trajectories run (a stream: ``verl_lite.agent.stream``)."""
        mt = spec.multi_turn
        self.rollout = rollout if isinstance(rollout, VersionedRollout) else VersionedRollout(rollout)
        self.tokenizer, self.spec = tokenizer, spec
        tools = build_tools(spec.functions, mt.get("tool_config_path"))
        self.executor = ToolExecutor(tools, mt["tool_timeout_s"], mt["max_tool_response_length"],
                                     mt["tool_response_truncate_side"], mt["tool_error"], mt.get("tool_processes"))
        self.glue = ChatGlue(tokenizer, [t.schema for t in tools], mt.get("escape_special_tokens", True))
        path = mt.get("interaction_config_path")
        self.interactions = {**spec.interactions, **(load_interaction_config(path) if path else {})}
        self.loops = agent_loops(spec.agent_loop_config_path)

    def _interaction_of(self, row: dict) -> Interaction | None:
        kwargs = (row.get("extra_info") or {}).get("interaction_kwargs") or {}
        name = kwargs.get("name")
        if name is None:
            return next(iter(self.interactions.values())) if len(self.interactions) == 1 else None
        if name not in self.interactions:
            raise ToolConfigError(f"row asks for interaction {name!r}; the configured ones are {sorted(self.interactions)}")
        return self.interactions[name]

    def _loop_of(self, row: dict) -> AgentLoop:
        name = row.get("agent_name") or self.spec.default_agent_loop
        if name not in self.loops:
            raise ToolConfigError(f"agent loop {name!r} (row agent_name / agent.default_agent_loop) is not "
                                  f"registered; registered: {sorted(self.loops)}")
        return self.loops[name]()

    def run(self, rows: list[dict], seeds: list[int] | None, sampling: dict) -> list[dict]:
        return asyncio.run(self._run_all(rows, seeds, *split_sampling(sampling)))

    def batcher(self, sampling: dict, live: int = 0) -> _TurnBatcher:
        if stops := stop_token_ids(self.tokenizer, self.spec.multi_turn["format"]):  # gpt-oss: a call ends at <|call|>
            sampling = {**sampling, "stop_token_ids": [*sampling.get("stop_token_ids", []), *stops]}
        return _TurnBatcher(self.rollout, sampling, live, self.spec.multi_turn.get("batch_wait_s"))

    async def run_one(self, row: dict, seed: int | None, sample: int, batcher: _TurnBatcher) -> Trajectory:
        """Sample ``sample`` of ``row`` through its agent loop (the batcher counts it live until it ends)."""
        try:
            given = row.get("messages") or []
            messages = [{"role": "user", "content": given}] if isinstance(given, str) else [dict(m) for m in given]
            traj = Trajectory(list(row["prompt_ids"]), messages, row, self.spec.max_response_length)
            ctx = AgentContext(self, batcher, seed, sample, self._interaction_of(row))
            return await self._loop_of(row).run(traj, ctx)
        finally:
            batcher.finished()

    async def _run_all(self, rows, seeds, n, sampling) -> list[dict]:
        batcher = self.batcher(sampling, live=len(rows) * n)
        await self.executor.warm()
        tasks = [asyncio.create_task(self.run_one(rows[p], None if seeds is None else seeds[p], k, batcher))
                 for p in range(len(rows)) for k in range(n)]
        try:
            await batcher.serve()
        finally:
            batcher.close()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        if (error := next((r for r in results if isinstance(r, BaseException)), None)) is not None:
            raise error
        return [t.output() for t in results]


def split_sampling(sampling: dict) -> tuple[int, dict]:
    """``(n, the per-turn sampling)`` of a generate call's settings: the response bound is
    ``data.max_response_length`` (the spec's), not the call's ``max_new_tokens``."""
    sampling = dict(sampling)
    n = int(sampling.pop("n", 1))
    sampling.pop("max_new_tokens", None)
    return n, sampling


AGENT_ROW_KEYS = ("prompt_ids", "messages", "data_source", "ground_truth", "extra_info")


def row_agent_name(row: dict) -> str | None:
    """A dataset row's ``agent_name``: a column of its own, or a key of ``extra_info`` where the dataset merged
    the row's other columns."""
    return row.get("agent_name") or (row.get("extra_info") or {}).get("agent_name")


def agent_rows(rows: list[dict]) -> list[dict]:
    """The part of each dataset row the workers' agent loops read."""
    return [{**{k: r.get(k) for k in AGENT_ROW_KEYS}, "agent_name": row_agent_name(r)} for r in rows]
