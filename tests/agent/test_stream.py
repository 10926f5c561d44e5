"""The trajectory stream (``verl_lite.agent.stream``): partial rollouts across a weight load, against a float64
reference with known weights per version; groups submitted while others run; a trajectory's error reaches
``collect``."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from verl_lite.agent import AgentLoop, AgentSpec, register_agent_loop
from verl_lite.agent.config import MultiTurnConfig
from verl_lite.agent.preflight import multi_turn_values
from verl_lite.agent.loop import AgentRunner, VersionedRollout
from verl_lite.agent.stream import TrajectoryStream
from verl_lite.config.loader import default_model_path

RELEASE = threading.Event()  # the two-turn loop's environment step waits for it (set by the test)


@register_agent_loop("test_two_turns_after_release")
class TwoTurnsAfterRelease(AgentLoop):
    """A model turn, an environment segment once RELEASE is set, another model turn."""

    async def run(self, traj, ctx):
        await ctx.model_turn(traj)
        await asyncio.to_thread(RELEASE.wait, 60)
        traj.add_env(ctx.tokenizer.encode("=", add_special_tokens=False))
        await ctx.model_turn(traj)
        return traj


@register_agent_loop("test_raises")
class Raises(AgentLoop):
    async def run(self, traj, ctx):
        raise RuntimeError("the environment broke")


def _spec(loop: str, budget: int = 12) -> AgentSpec:
    return AgentSpec(multi_turn=dict(multi_turn_values(MultiTurnConfig()), enable=True), default_agent_loop=loop,
                     max_response_length=budget)


def _rows(tokenizer, count):
    from verl_lite.data.dataset import encode_prompt

    rows = []
    for i in range(count):
        messages = [{"role": "user", "content": f"{i + 3}+{i + 4}="}]
        rows.append({"prompt_ids": encode_prompt(tokenizer, messages, None), "messages": messages,
                     "data_source": "t", "ground_truth": "", "extra_info": {}, "agent_name": None})
    return rows


def _wait(predicate, bound_s=120.0):
    end = time.monotonic() + bound_s
    while not predicate():
        assert time.monotonic() < end, "the stream did not get there in time"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def model_and_tokenizer():
    from transformers import AutoTokenizer

    path = default_model_path()
    return path, AutoTokenizer.from_pretrained(path)


def _perturbed(model, seed: int, scale: float = 0.05) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(name, p.detach() + scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))
            for name, p in model.state_dict().items()]


def _reference_log_probs(path, weights, prompt, response) -> torch.Tensor:
    """log p(response_t | prompt, response_<t) under ``weights``, float64, one full forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    if weights is not None:
        model.load_state_dict({name: t.double() for name, t in weights}, strict=False)
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1]
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(response)[:, None])[:, 0]


def test_a_trajectory_straddling_a_load_has_each_turn_from_its_version(model_and_tokenizer):
    """Version 0 generates every first turn; version 1 (other weights) is loaded while the trajectories wait in
    their environment step, then generates every second turn. Each token's behaviour log-prob equals the float64
    log-prob under the weights of the version that generated it (and differs from the other version's)."""
    from verl_lite.rollout import make_rollout

    path, tokenizer = model_and_tokenizer
    RELEASE.clear()
    backend = VersionedRollout(make_rollout("hf", path, tokenizer), version=0)
    stream = TrajectoryStream(AgentRunner(backend, tokenizer, _spec("test_two_turns_after_release")),
                              {"n": 2, "do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": -1})
    try:
        rows = _rows(tokenizer, 2)
        stream.submit([{"group": g, "row": row, "seed": 100 + g} for g, row in enumerate(rows)])
        _wait(lambda: stream.batcher.calls >= 1 and not stream.batcher.waiting)
        version_1 = _perturbed(backend.rollout.model, seed=1)
        backend.load(version_1, 1)
        RELEASE.set()
        out: list[dict] = []
        _wait(lambda: out.extend(stream.collect()) or len(out) == 4)
    finally:
        stream.close()
    for traj in out:
        assert traj["segment_versions"] == [0, 1]
        mask, response = traj["response_mask"], traj["response_ids"]
        env = mask.index(0)
        second = env + mask[env:].index(1)
        prompt = rows[traj["group"]]["prompt_ids"]
        behaviour = torch.tensor(traj["log_probs"], dtype=torch.float64)
        for start, stop, weights, other in ((0, env, None, version_1), (second, len(response), version_1, None)):
            ref = _reference_log_probs(path, weights, prompt, response)[start:stop]
            wrong = _reference_log_probs(path, other, prompt, response)[start:stop]
            torch.testing.assert_close(behaviour[start:stop], ref, atol=2e-5, rtol=0)
            assert (behaviour[start:stop] - wrong).abs().max() > 1e-3


def test_groups_submitted_later_run_beside_earlier_ones_and_errors_reach_collect(tool_tokenizer):
    from tests.agent.conftest import ScriptedRollout

    rollout = ScriptedRollout(tool_tokenizer, lambda turn, text: "5")
    stream = TrajectoryStream(AgentRunner(rollout, tool_tokenizer, _spec("single_turn_agent", budget=50)),
                              {"n": 3, "do_sample": True, "temperature": 1.0})
    try:
        rows = _rows(tool_tokenizer, 3)
        stream.submit([{"group": "a", "row": rows[0], "seed": 1}])
        out: list[dict] = []
        _wait(lambda: out.extend(stream.collect()) or len(out) == 3)
        stream.submit([{"group": "b", "row": rows[1], "seed": 2, "n": 2}])
        _wait(lambda: out.extend(stream.collect()) or len(out) == 5)
        assert sorted((o["group"], o["sample"]) for o in out) == [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1)]
        assert all(o["segment_versions"] == [None] for o in out)  # a plain backend: no version
        stream.runner.loops["single_turn_agent"] = Raises
        stream.submit([{"group": "c", "row": rows[2], "seed": 3}])
        with pytest.raises(RuntimeError, match="the environment broke"):
            _wait(lambda: stream.collect() and False)
        assert stream.live() == 0
    finally:
        stream.close()


def _load(backend, weights, version):
    """A rollout pool's weight sync (``RolloutWorker.load_weights``)."""
    backend.load(weights, version)


def _pause_load_resume(backend, weights, version):
    """A colocated worker's update (``ActorRolloutRefWorker.update_actor``): the stream held while the engine
    trains, the new weights copied in, the stream let go on as the new version."""
    backend.pause()
    backend.rollout.load_weights(weights)
    backend.resume(version)


@pytest.mark.parametrize("land", [_load, _pause_load_resume])
def test_a_load_cuts_a_running_turn_short_and_the_turn_goes_on_with_the_new_weights(model_and_tokenizer, land):
    """A partial rollout inside one model turn: a load lands while the HF backend is generating; the call stops
    after its next token, the load is applied, and every response still running goes on with version 1 (its
    tokens so far prefilled again). Each token's behaviour log-prob equals the float64 log-prob under the weights
    of the version that generated it: one turn, two segments, [0, 1]. The same whether the weights come through a
    pool's load or a colocated worker's pause / load / resume."""
    from verl_lite.rollout import make_rollout

    path, tokenizer = model_and_tokenizer
    rollout = make_rollout("hf", path, tokenizer)
    version_0, version_1 = _perturbed(rollout.model, seed=3, scale=0.3), _perturbed(rollout.model, seed=4, scale=0.3)
    rollout.load_weights(version_0)  # far from the trained model: responses run long, so the load finds them running
    backend = VersionedRollout(rollout, version=0)
    model, calls = rollout.model, []

    def forward(*args, **kwargs):
        out = type(model).forward(model, *args, **kwargs)
        calls.append(1)
        if len(calls) == 4:  # the third generated token's forward: a weight sync arrives from another thread
            threading.Thread(target=land, args=(backend, version_1, 1), daemon=True).start()
            _wait(backend.load_waiting.is_set)
        return out

    model.forward = forward
    stream = TrajectoryStream(AgentRunner(backend, tokenizer, _spec("single_turn_agent", budget=24)),
                              {"n": 4, "do_sample": True, "temperature": 1.0, "top_p": 1.0, "top_k": -1})
    try:
        rows = _rows(tokenizer, 1)
        stream.submit([{"group": 0, "row": rows[0], "seed": 7}])
        out: list[dict] = []
        _wait(lambda: out.extend(stream.collect()) or len(out) == 4)
    finally:
        stream.close()
        del model.forward
    cut = [traj for traj in out if traj["segment_versions"] == [0, 1]]
    assert cut, [traj["segment_versions"] for traj in out]  # at least one response was still running
    assert all(traj["segment_versions"] in ([0], [0, 1]) for traj in out)
    prompt = rows[0]["prompt_ids"]
    for traj in cut:
        response, behaviour = traj["response_ids"], torch.tensor(traj["log_probs"], dtype=torch.float64)
        assert traj["response_mask"] == [1] * len(response) and traj["agent_stats"]["assistant_turns"] == 1
        first = 4  # the prefill's and three decode forwards' tokens: sampled before the load was applied
        for start, stop, weights, other in ((0, first, version_0, version_1), (first, len(response), version_1, version_0)):
            ref = _reference_log_probs(path, weights, prompt, response)[start:stop]
            wrong = _reference_log_probs(path, other, prompt, response)[start:stop]
            # fp32 backend vs float64, at weights far from the trained ones
            torch.testing.assert_close(behaviour[start:stop], ref, atol=1e-4, rtol=0)
            assert (behaviour[start:stop] - wrong).abs().max() > 1e-2
