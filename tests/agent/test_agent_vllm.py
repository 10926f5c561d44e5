"""The agent loop on the vLLM backend (vLLM's CPU build, ``.venv-vllm``; skipped where vLLM cannot run):
3-turn trajectories of the shipped tiny model with a simulated user, one batched vLLM call per turn, the
environment segments exactly the template's user turns, and vLLM's log-probs on every model token equal a
float64 recompute over the whole interleaved sequence (1e-4, the vLLM tests' bound)."""

from __future__ import annotations

import pytest
import torch

from verl_lite.rollout import vllm_available, vllm_unavailable_reason

pytestmark = pytest.mark.skipif(not vllm_available(), reason=f"vLLM cannot run here: {vllm_unavailable_reason()}")


def test_three_turns_on_vllm():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.agent.test_agent_e2e import FOLLOW_UPS, TwoMoreQuestions, _segments
    from verl_lite.agent import AgentRunner, AgentSpec, ChatGlue
    from verl_lite.agent.preflight import multi_turn_values
    from verl_lite.config.loader import default_model_path
    from verl_lite.agent.config import MultiTurnConfig
    from verl_lite.data.dataset import encode_prompt
    from verl_lite.rollout import make_rollout

    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    rollout = make_rollout("vllm", path, tok, dtype="float32", max_model_len=96)
    calls = []
    generate = rollout.generate
    rollout.generate = lambda prompts, **kw: calls.append(len(prompts)) or generate(prompts, **kw)
    spec = AgentSpec(multi_turn=dict(multi_turn_values(MultiTurnConfig()), enable=True), default_agent_loop="tool_agent",
                     interactions={"q": TwoMoreQuestions()}, max_response_length=48)
    rows = [{"prompt_ids": encode_prompt(tok, [{"role": "user", "content": q}]), "messages": [], "extra_info": {}}
            for q in ("12+34=", "7+8=")]
    try:
        outs = AgentRunner(rollout, tok, spec).run(rows, [5, 6], {"n": 2, "do_sample": True, "temperature": 1.0,
                                                                   "top_p": 1.0, "top_k": -1})
    finally:
        rollout.close()  # one vLLM engine per process at a time (VLLMRollout)
    assert calls == [4, 4, 4]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    env = [ChatGlue(tok).ids([{"role": "user", "content": q}]) for q in FOLLOW_UPS]
    for row, o in zip([r for r in rows for _ in range(2)], outs):
        segs = _segments(o["response_mask"])
        assert [v for v, _, _ in segs] == [1, 0, 1, 0, 1]
        assert [o["response_ids"][s:e] for v, s, e in segs if v == 0] == env
        ids = torch.tensor([row["prompt_ids"] + o["response_ids"]])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=ids).logits[0].double(), dim=-1)
        p = len(row["prompt_ids"])
        ref = logp[torch.arange(p - 1, ids.shape[1] - 1), ids[0, p:]]
        mask = torch.tensor(o["response_mask"]).bool()
        torch.testing.assert_close(torch.tensor(o["log_probs"]).double()[mask], ref[mask], atol=1e-4, rtol=0)
