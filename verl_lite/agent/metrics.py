"""Step metrics of multi-turn rollouts (docs/agents.md, Metrics), from the per-trajectory stats the agent loop
reports: per-trajectory means of model turns (and their max), environment turns (tool-response rounds, user
turns), tool calls and response tokens by kind; the model tokens' share of all response tokens; step counts of
tool errors (calls that could not run included), timeouts and calls dropped beyond max_parallel_calls; mean
seconds per call of each tool; the share of trajectories that ended for each reason; the interactions'
per-turn rewards summed per trajectory."""

from __future__ import annotations

from collections import Counter


def tool_call_rate(stats: list[dict]) -> float:
    """The share of trajectories with at least one tool call."""
    return sum(1 for s in stats if s["tool_calls"] > 0) / len(stats) if stats else float("nan")


def agent_metrics(stats: list[dict], turn_scores: list[list[float]] | None = None) -> dict[str, float]:
    n = len(stats)
    if not n:
        return {}
    mean = lambda key: sum(s[key] for s in stats) / n  # noqa: E731
    model, env = sum(s["model_tokens"] for s in stats), sum(s["env_tokens"] for s in stats)
    out = {
        "agent/turns_mean": mean("assistant_turns"), "agent/turns_max": float(max(s["assistant_turns"] for s in stats)),
        "agent/env_turns_mean": mean("user_turns"), "agent/tool_calls_mean": mean("tool_calls"),
        "agent/tool_call_rate": tool_call_rate(stats),
        **{f"agent/{key}": float(sum(s[key] for s in stats))
           for key in ("tool_errors", "tool_timeouts", "dropped_tool_calls")},
        "agent/model_tokens_mean": model / n, "agent/env_tokens_mean": env / n,
        "agent/model_token_fraction": model / (model + env) if model + env else float("nan"),
    }
    latency: dict[str, list[float]] = {}
    for s in stats:
        for name, values in s["tool_latency_s"].items():
            latency.setdefault(name, []).extend(values)
    out.update({f"agent/tool_latency_s/{name}": sum(v) / len(v) for name, v in latency.items() if v})
    out.update({f"agent/stop/{r}": c / n for r, c in Counter(s["stop_reason"] for s in stats).items() if r})
    if turn_scores is not None:
        out["agent/turn_score_mean"] = sum(sum(t) for t in turn_scores) / n
    return out
