"""Routing replay (R3) through the agent loop: a multi-turn trajectory's ``routed_experts`` keeps, per token, the
routing of the backend call that first fed it to the model (``Trajectory.routing``): the prompt from the first call's
prefill, a model token from the decode step after its draw (the call that sampled it), an environment token (a tool
response) from the next call's prefill, the last token of a segment from the next call (its own call never fed it),
the trailing tokens no call fed unknown. The backend here stamps each routing row with (call, position), in the form
``HFRollout(record_routing=True)`` returns it (prefix + response rows, the last response row unknown)."""

from __future__ import annotations

import torch

from verl_lite.agent.loop import AgentRunner
from verl_lite.engine.moe import UNKNOWN_EXPERT

from .conftest import ScriptedRollout
from .test_agent_loop import _rows, _spec, call

LAYERS, K = 2, 2


class StampingRollout(ScriptedRollout):
    """The scripted turns, with routing rows (call index, position) for every token the call fed."""

    def generate(self, prompt_ids, n=1, **kw):
        outs = super().generate(prompt_ids, n, **kw)
        index = len(self.calls) - 1
        for ids, out in zip(prompt_ids, outs):
            rows = len(ids) + len(out["response_ids"])
            routing = torch.empty(rows, LAYERS, K, dtype=torch.uint8)
            routing[..., 0] = index
            routing[..., 1] = (torch.arange(rows) % 200)[:, None].to(torch.uint8)
            routing[-1] = UNKNOWN_EXPERT  # the last sampled token is never fed in this call
            out["routed_experts"] = routing
        return outs


def test_a_multi_turn_trajectory_keeps_each_token_routing_from_the_call_that_fed_it(tool_tokenizer):
    tok = tool_tokenizer
    script = lambda turn, text: call("add", a=2, b=3) if turn == 0 else "5"  # noqa: E731
    rollout = StampingRollout(tok, script)
    rows = _rows(tok, 2)
    outs = AgentRunner(rollout, tok, _spec()).run(rows, seeds=[1, 2], sampling={"n": 1, "max_new_tokens": 99})
    assert len(rollout.calls) == 2  # turn 1, then the tool response and turn 2
    for row, o in zip(rows, outs):
        prompt, mask = len(row["prompt_ids"]), o["response_mask"]
        routing = o["routed_experts"]
        assert routing.shape == (prompt + len(o["response_ids"]), LAYERS, K) and routing.dtype == torch.uint8
        first_turn = mask.index(0)  # model tokens of turn 1, then the environment's, then turn 2
        second_turn = first_turn + mask[first_turn:].index(1)
        expected_call = ([0] * (prompt + first_turn - 1)  # the prompt and turn 1 (but its last token): call 0
                         + [1] * (second_turn - first_turn + 1 + len(mask) - second_turn - 1))  # the rest: call 1
        assert routing[:-1, 0, 0].tolist() == expected_call
        assert routing[:-1, 0, 1].tolist() == [p % 200 for p in range(len(expected_call))]  # each at its own row
        assert bool((routing[-1] == UNKNOWN_EXPERT).all())  # the last token: no call fed it
