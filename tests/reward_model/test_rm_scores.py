"""The reward-model role's scores == HF AutoModelForSequenceClassification's float64 forward.

One Ray session; the RM role (``workers/reward_model.py`` behind ``reward.model_reward.ModelReward``) is
started at 1 worker, TP2 and PP2 in turn, and each scores one rollout batch twice: with the policy's
own template (the token ids pass through) and with an RM tokenizer whose chat template differs (the
responses are decoded and rendered again, verl's behaviour). The reference renders the RM's text by
hand (not through the code under test) and runs HF's model in float64, one unpadded sequence at a time.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from verl_lite.controller import start_ray, stop_ray
from verl_lite.controller.resource_pool import ResourcePool
from verl_lite.controller.role_group import MicroBatching, RoleGroup, start_roles
from verl_lite.data.char_tokenizer import build_char_tokenizer, save_char_tokenizer
from verl_lite.protocol import Batch
from verl_lite.reward.model_reward import ModelReward, renders_alike, rm_inputs
from verl_lite.workers.engine_worker import EngineWorkerConfig
from verl_lite.workers.reward_model import RewardModelWorker

GRADER_TEMPLATE = (  # the RM's own template: other text around the same turns
    "<|system|>grade the answer"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}<|user|>Q: {{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}<|assistant|>A: {{ message['content'] }}<eos>"
    "{% endif %}{% endfor %}"
)
QUESTIONS = ["12+34=", "7+8=", "99+1=", "5+55=", "40+2=", "3+4="]
ANSWERS = ["46", "15", "100", "60", "41", "7"]
TRUNCATED = {3}  # this response ended without <eos> (max_response_length reached)
LAYOUTS = {"1 worker": (1, 1, 1), "TP2": (2, 2, 1), "PP2": (2, 1, 2)}  # name: (world, tp, pp)
TOL = 1e-5


def _make_rm(root):
    import transformers

    cfg = transformers.Qwen2Config(vocab_size=104, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, max_position_embeddings=128,
                                   tie_word_embeddings=False, rms_norm_eps=1e-6, use_sliding_window=False,
                                   pad_token_id=0, bos_token_id=1, eos_token_id=2, num_labels=1)
    torch.manual_seed(0)
    model = transformers.AutoModelForSequenceClassification.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():  # far from the init's near-zero scores: a wrong position shows
            p.add_(torch.randn_like(p) * 0.05)
    rm = root / "rm"
    model.save_pretrained(rm, safe_serialization=True)
    save_char_tokenizer(rm)
    grader = root / "rm_grader_template"  # the same weights, another chat template
    shutil.copytree(rm, grader)
    tok = build_char_tokenizer()
    tok.chat_template = GRADER_TEMPLATE
    tok.save_pretrained(grader)
    return rm, grader


def _rollout_batch(tok) -> Batch:
    prompts = [tok(f"<|user|>{q}<|assistant|>", add_special_tokens=False)["input_ids"] for q in QUESTIONS]
    responses = [tok.encode(a, add_special_tokens=False) + ([] if i in TRUNCATED else [tok.eos_token_id])
                 for i, a in enumerate(ANSWERS)]
    width = max(map(len, responses)) + 2  # right padding past every response
    ids, mask = torch.zeros(len(responses), width, dtype=torch.long), torch.zeros(len(responses), width)
    for i, r in enumerate(responses):
        ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), 1.0
    return Batch.from_dict({"responses": ids, "response_mask": mask},
                           {"prompt_ids": prompts, "messages": [[{"role": "user", "content": q}] for q in QUESTIONS]})


def _reference_inputs(tok, grader: bool) -> list[list[int]]:
    """The RM's input ids written out: the policy's tokens, or the grader template's text in the RM's
    tokenizer (``tok``: the policy's, or the RM's as loaded from its directory)."""
    out = []
    for i, (q, a) in enumerate(zip(QUESTIONS, ANSWERS)):
        if grader:
            text = f"<|system|>grade the answer<|user|>Q: {q}<|assistant|>A: {a}<eos>"
        else:
            text = f"<|user|>{q}<|assistant|>{a}" + ("" if i in TRUNCATED else "<eos>")
        out.append(tok(text, add_special_tokens=False)["input_ids"])
    return out


def _hf_scores(rm_dir, inputs) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForSequenceClassification.from_pretrained(rm_dir, dtype=torch.float64).eval()
    with torch.no_grad():
        return torch.tensor([float(model(torch.tensor([x])).logits[0, 0]) for x in inputs], dtype=torch.float64)


def _worker_config(rm_dir, tp: int, pp: int) -> EngineWorkerConfig:
    from verl_lite.engine.config import EngineConfig, MegatronConfig

    return EngineWorkerConfig(EngineConfig(str(rm_dir), MegatronConfig.layout(tp=tp, pp=pp, timeout_s=120),
                                           value_head=True, forward_only=True))


@pytest.fixture(scope="module")
def scored(tmp_path_factory):
    """{layout: {"policy template" | "grader template": (engine scores, RM inputs)}} + the references."""
    from transformers import AutoTokenizer

    rm, grader = _make_rm(tmp_path_factory.mktemp("rm_scores"))
    policy_tok = build_char_tokenizer()
    tokenizers = {"policy template": AutoTokenizer.from_pretrained(rm),
                  "grader template": AutoTokenizer.from_pretrained(grader)}
    batch = _rollout_batch(policy_tok)
    started = start_ray(num_cpus=2)
    pool = ResourcePool(2)
    results = {}
    try:
        for name, (world, tp, pp) in LAYOUTS.items():
            group = RoleGroup("reward_model", RewardModelWorker, world, _worker_config(rm, tp, pp), pool, 300.0)
            start_roles(group)
            try:
                results[name] = {}
                for which, rm_tok in tokenizers.items():
                    scorer = ModelReward(group, policy_tok, rm_tok, MicroBatching(micro_batch_size=4))
                    results[name][which] = (scorer(batch), scorer.inputs(batch), scorer.rerender)
            finally:
                group.shutdown()
    finally:
        pool.remove()
        if started:
            stop_ray()
    refs = {"policy template": _reference_inputs(policy_tok, grader=False),
            "grader template": _reference_inputs(tokenizers["grader template"], grader=True)}
    return results, refs, {which: _hf_scores(rm, refs[which]) for which in refs}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("which", ["policy template", "grader template"])
def test_rm_scores_match_hf_float64(scored, layout, which):
    results, refs, hf = scored
    scores, inputs, rerendered = results[layout][which]
    assert rerendered == (which == "grader template")
    assert inputs == refs[which]  # the RM read what the reference read
    assert scores.shape == (len(QUESTIONS),)
    err = (scores.double() - hf[which]).abs().max().item()
    assert err < TOL, (layout, which, err, scores, hf[which])
    assert hf[which].std() > 1e-2  # scores that differ per response: a wrong row or position would show


def test_template_change_changes_the_input():
    """With the policy's own template, re-rendering would give back the policy's ids (the same rule
    verl applies); with the grader's, the text differs, so the re-rendered path is really exercised."""
    tok = build_char_tokenizer()
    batch = _rollout_batch(tok)
    lengths = batch["response_mask"].sum(1).long().tolist()
    responses = [batch["responses"][i, :k].tolist() for i, k in enumerate(lengths)]
    direct = rm_inputs(batch["prompt_ids"], responses, batch["messages"], tok, tok, rerender=False)
    again = rm_inputs(batch["prompt_ids"], responses, batch["messages"], tok, tok, rerender=True)
    finished = [i for i in range(len(QUESTIONS)) if i not in TRUNCATED]
    assert [direct[i] for i in finished] == [again[i] for i in finished]  # same template: same ids
    assert renders_alike(tok, build_char_tokenizer())
    grader = build_char_tokenizer()
    grader.chat_template = GRADER_TEMPLATE
    assert not renders_alike(tok, grader)
    with pytest.raises(ValueError, match="chat messages"):
        rm_inputs(batch["prompt_ids"], responses, None, tok, grader, rerender=True)
