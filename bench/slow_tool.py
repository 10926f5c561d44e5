"""The tool-agent recipe's ``calculator`` with a latency of a remote tool: each call sleeps a lognormal time
(median ``median_s``, sigma ``sigma``, capped at ``cap_s``; ``bench/async_agent.py``'s defaults: 1 s, 1, 10 s, as
sandboxes, code execution and web tools behave), then answers as the recipe's calculator does."""

from __future__ import annotations

import math
import os
import random
import time

from verl_lite.data.tool_task import Calculator


class SlowCalculator(Calculator):
    """verl's tool-class shape (``create`` / ``execute`` / ``release``); ``config`` takes median_s, sigma, cap_s."""

    def __init__(self, config: dict, tool_schema: dict):
        super().__init__(config, tool_schema)
        self.rng = random.Random(int.from_bytes(os.urandom(8), "little"))

    def latency_s(self) -> float:
        c = self.config
        return min(float(c.get("cap_s", 10.0)), float(c.get("median_s", 1.0)) * math.exp(self.rng.gauss(0.0, float(c.get("sigma", 1.0)))))

    def execute(self, instance_id: str, parameters: dict, **kwargs):
        time.sleep(self.latency_s())
        return super().execute(instance_id, parameters, **kwargs)
