"""HFRollout(record_routing=True) (routing replay, R3): each result's ``routed_experts`` is the routing of an
independent uncached float32 forward of prompt + response, position by position and layer by layer (the last token
and dense layers unknown), through left padding, shared prefill, stopped-row dropping and interruption."""

import re

import pytest
import torch
import transformers

from verl_lite.data.char_tokenizer import build_char_tokenizer
from verl_lite.engine.moe import UNKNOWN_EXPERT
from verl_lite.rollout import HFRollout
from verl_lite.rollout.hf_rollout import COMPACT_AT
from verl_lite.utils import make_tiny_hf_model
from verl_lite.utils.tiny_model import make_tiny_moe_model

torch.set_num_threads(1)

NEAR_TIE = 1e-5  # router probabilities closer than this may swap places under the KV cache's float rounding
DENSE_LAYER = 1  # the qwen2_moe model's decoder layer without experts (``mlp_only_layers``)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _qwen2_moe_with_dense_layer(tmp):
    """A 3-layer qwen2_moe whose layer DENSE_LAYER is a plain MLP, saved whole (both loads read the same weights)."""
    sparse = make_tiny_moe_model(tmp / "sparse", "qwen2_moe", vocab_size=128, num_layers=3, seed=2)
    cfg = transformers.AutoConfig.from_pretrained(sparse)
    cfg.mlp_only_layers = [DENSE_LAYER]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(sparse, config=cfg, dtype=torch.float32)
    model.save_pretrained(tmp / "mixed")
    return tmp / "mixed"


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen2_moe"])
def moe(request, tmp_path_factory):
    """(model dir, decoder layers without experts)."""
    tmp = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen2_moe":
        return str(_qwen2_moe_with_dense_layer(tmp)), {DENSE_LAYER}
    return str(make_tiny_moe_model(tmp, "qwen3_moe", vocab_size=128, num_layers=2, top_k=2, seed=1)), set()


def _reference(model, seq: list[int]):
    """Per decoder layer (None for a dense one): the top-k experts [len(seq), k] of ONE uncached forward of ``seq``
    (largest first), and the near-tie mask [len(seq)]: two of the top k + 1 probabilities within NEAR_TIE."""
    out = model(input_ids=torch.tensor([seq]), use_cache=False, output_router_logits=True)
    routers = iter(out.router_logits)
    experts, ties = [], []
    for layer in range(model.config.num_hidden_layers):
        if not type(model.model.layers[layer].mlp).__name__.endswith("SparseMoeBlock"):
            experts.append(None)
            ties.append(None)
            continue
        probs = torch.softmax(next(routers).float(), dim=-1)  # [len(seq), E]
        k = model.config.num_experts_per_tok
        top = torch.topk(probs, k + 1, dim=-1)
        experts.append(top.indices[:, :k])
        ties.append((top.values[:, :-1] - top.values[:, 1:]).min(dim=-1).values < NEAR_TIE)
    return experts, ties


def _check_against_reference(model, prompts, n, outs, dense_layers):
    """Assert every result's routing equals the reference's; return (positions x layers compared, near ties)."""
    compared = near_ties = 0
    for i, o in enumerate(outs):
        seq = prompts[i // n] + o["response_ids"]
        rec = o["routed_experts"]
        k = model.config.num_experts_per_tok
        assert rec.dtype == torch.uint8 and rec.shape == (len(seq), model.config.num_hidden_layers, k)
        assert (rec[-1] == UNKNOWN_EXPERT).all(), "the last response token is never fed to the model"
        experts, ties = _reference(model, seq)
        for layer in range(model.config.num_hidden_layers):
            if layer in dense_layers:
                assert experts[layer] is None and (rec[:, layer] == UNKNOWN_EXPERT).all()
                continue
            got, want, tie = rec[:-1, layer].long(), experts[layer][:-1], ties[layer][:-1]
            agree = (got == want).all(dim=-1)
            assert (agree | tie).all(), f"sample {i} layer {layer}: positions {(~agree & ~tie).nonzero().tolist()}"
            compared += len(seq) - 1
            near_ties += int(tie.sum())
    return compared, near_ties


def _prompts(tok):
    return [tok.encode(t, add_special_tokens=False) for t in ("12+3=", "x", "40+40+7=", "5+5=", "99+1=8")]


@pytest.mark.parametrize("prefill", ["per_prompt", "per_sample"])
def test_recorded_routing_is_the_routing_of_an_uncached_forward(moe, tok, prefill, monkeypatch):
    """Sampled (n=2, per-prompt seeds), prompts of 5 lengths, stop tokens that end some rows early (so stopped
    rows leave the batch) while others run to max_new_tokens; the prefill shared by a prompt's samples, or (a cache
    without ``batch_repeat_interleave``) run for each sample."""
    if prefill == "per_sample":
        monkeypatch.setattr(transformers.cache_utils.Cache, "batch_repeat_interleave", None)
    model_dir, dense_layers = moe
    r = HFRollout(model_dir, tok, record_routing=True)
    prompts, n, max_new = _prompts(tok), 2, 20
    stop_ids = tok.encode("01", add_special_tokens=False)
    outs = r.generate(prompts, n=n, do_sample=True, temperature=1.0, max_new_tokens=max_new,
                      seeds=[7 + p for p in range(len(prompts))], stop_token_ids=stop_ids)
    lengths = [len(o["response_ids"]) for o in outs]
    assert min(lengths) < max_new // 2 and max(lengths) == max_new, lengths  # early stops and full-length rows
    assert sum(L < max_new for L in lengths) >= len(outs) - int(COMPACT_AT * len(outs))  # the batch compacts
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        compared, near_ties = _check_against_reference(reference, prompts, n, outs, dense_layers)
    print(f"{model_dir}: lengths {lengths}, {compared} positions x layers compared, {near_ties} near ties")
    assert compared > 300 and near_ties < 0.01 * compared


def test_interrupted_rows_keep_the_routing_computed_so_far(moe, tok):
    model_dir, dense_layers = moe
    r = HFRollout(model_dir, tok, record_routing=True)
    prompts, asked = _prompts(tok)[:3], []
    outs = r.generate(prompts, n=2, do_sample=True, max_new_tokens=16, seed=3,
                      interrupt=lambda: asked.append(1) or len(asked) >= 4)
    assert all(o["interrupted"] and len(o["response_ids"]) == 4 for o in outs)
    reference = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        compared, _ = _check_against_reference(reference, prompts, 2, outs, dense_layers)
    moe_layers = reference.config.num_hidden_layers - len(dense_layers)
    assert compared == sum(len(prompts[i // 2]) + 4 - 1 for i in range(len(outs))) * moe_layers


def test_without_record_routing_results_hold_no_routing(moe, tok):
    r = HFRollout(moe[0], tok)
    outs = r.generate(_prompts(tok)[:2], n=2, do_sample=True, max_new_tokens=4, seed=0)
    assert all("routed_experts" not in o for o in outs)
    assert not any(m._forward_hooks for m in r.model.modules())


def test_dense_model_with_record_routing_is_refused(tmp_path, tok):
    dense = make_tiny_hf_model(tmp_path, "qwen2", vocab_size=128, hidden_size=32, num_layers=2, intermediate_size=64)
    with pytest.raises(ValueError, match=rf"record_routing=True: the model of {re.escape(str(dense))} "
                                         r"\(Qwen2ForCausalLM\) has no MoE router.*or record_routing=False"):
        HFRollout(str(dense), tok, record_routing=True)


def test_more_experts_than_uint8_ids_is_refused(tmp_path, tok):
    wide = make_tiny_moe_model(tmp_path, "qwen3_moe", vocab_size=128, num_layers=1, num_experts=256, top_k=2)
    with pytest.raises(ValueError, match=rf"record_routing=True: the model of {re.escape(str(wide))} has 256 "
                                         r"experts; the uint8 routing record holds ids up to 254 \(255: unknown\)"):
        HFRollout(str(wide), tok, record_routing=True)
    assert HFRollout(str(wide), tok).generate([[5, 6]], max_new_tokens=2, seed=0)  # without recording: served
