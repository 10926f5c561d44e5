"""A warning, once, when a run has had no learning signal for k consecutive RL steps: every reward of a step
equal (every group-relative advantage is zero, a critic-free update does nothing) or every response one token.
"""

from __future__ import annotations

ZERO_SIGNAL_STEPS = 5


def zero_signal_reason(metrics: dict) -> str | None:
    """Why this step's metrics carry no learning signal, or None (validation-only records -> None)."""
    lo, hi = metrics.get("reward/min"), metrics.get("reward/max")
    if lo is not None and hi is not None and lo == hi:
        return f"every reward was {lo:g}"
    length = metrics.get("response_length/mean")
    if length is not None and length <= 1.0:
        return "every response was one token"
    return None


class ZeroSignalWatch:
    """Counts consecutive zero-signal steps; ``update`` returns the warning the first time k in a row had none."""

    def __init__(self, k: int = ZERO_SIGNAL_STEPS):
        self.k = k
        self.run: list[tuple[int, str]] = []
        self.warned = False

    def update(self, metrics: dict) -> str | None:
        if "reward/min" not in metrics and "response_length/mean" not in metrics:
            return None  # a validation-only record (step 0)
        reason = zero_signal_reason(metrics)
        if reason is None:
            self.run = []
            return None
        self.run.append((metrics.get("step", 0), reason))
        if self.warned or len(self.run) < self.k:
            return None
        self.warned = True
        first, last = self.run[0][0], self.run[-1][0]
        reasons = sorted({r for _, r in self.run})
        return (f"no learning signal for {len(self.run)} consecutive steps ({first}-{last}): {'; '.join(reasons)}. "
                f"Check the reward function against the data (reward.custom_reward_function), "
                f"data.max_response_length and the rollout sampling (temperature).")
