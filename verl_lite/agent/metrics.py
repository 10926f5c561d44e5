"""Step metrics of multi-turn rollouts, from the per-trajectory stats the agent loop reports.

    agent/turns_mean, agent/turns_max           model (assistant) turns per trajectory
    agent/env_turns_mean                        environment turns (tool-response rounds, user turns)
    agent/tool_calls_mean                       tool calls per trajectory; agent/tool_call_rate: share of
                                                trajectories with at least one
    agent/tool_errors, agent/tool_timeouts      counts over the step (errors include calls that could not
                                                run: malformed JSON, unknown tool)
    agent/dropped_tool_calls                    calls beyond max_parallel_calls (not run)
    agent/tool_latency_s/<tool>                 mean seconds per call of each tool
    agent/model_tokens_mean, agent/env_tokens_mean   response tokens by kind per trajectory
    agent/model_token_fraction                  model tokens / all response tokens of the step
    agent/stop/<reason>                         share of trajectories that ended for each reason
    agent/turn_score_mean                       the interactions' per-turn rewards summed per trajectory
"""

from __future__ import annotations


def tool_call_rate(stats: list[dict]) -> float:
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
        "agent/tool_errors": float(sum(s["tool_errors"] for s in stats)),
        "agent/tool_timeouts": float(sum(s["tool_timeouts"] for s in stats)),
        "agent/dropped_tool_calls": float(sum(s["dropped_tool_calls"] for s in stats)),
        "agent/model_tokens_mean": model / n, "agent/env_tokens_mean": env / n,
        "agent/model_token_fraction": model / (model + env) if model + env else float("nan"),
    }
    latency: dict[str, list[float]] = {}
    for s in stats:
        for name, values in s["tool_latency_s"].items():
            latency.setdefault(name, []).extend(values)
    out.update({f"agent/tool_latency_s/{name}": sum(v) / len(v) for name, v in latency.items() if v})
    reasons: dict[str, int] = {}
    for s in stats:
        reasons[s["stop_reason"]] = reasons.get(s["stop_reason"], 0) + 1
    out.update({f"agent/stop/{r}": c / n for r, c in reasons.items() if r})
    if turn_scores is not None:
        out["agent/turn_score_mean"] = sum(sum(t) for t in turn_scores) / n
    return out
