"""The HF rollout's decode-step attention (``compat.hf_attention`` on ``engine.attention.grouped_matmul_attention``):
the math against a float64 loop, the dispatch
to transformers' SDPA for everything else, and whole generations equal to the model's own ``sdpa``."""

import pytest
import torch
import torch.nn.functional as F

from verl_lite.compat import hf_attention, installed_is_tested
from verl_lite.data.char_tokenizer import build_char_tokenizer
from verl_lite.engine.attention import MATMUL_ATTENTION_DTYPES, grouped_matmul_attention
from verl_lite.rollout import HFRollout
from verl_lite.utils import make_tiny_hf_model

TESTED = installed_is_tested("transformers")


def _loop_reference(query, key, value, allowed, scale):
    """One query per row, per head h over KV group h // (heads/groups), keys where ``allowed``: explicit loops."""
    b, heads, _, width = query.shape
    per_group = heads // key.shape[1]
    out = torch.zeros_like(query)
    for row in range(b):
        keep = allowed[row].reshape(-1) if allowed is not None else torch.ones(key.shape[2], dtype=torch.bool)
        for h in range(heads):
            k, v = key[row, h // per_group][keep], value[row, h // per_group][keep]
            out[row, h, 0] = torch.softmax(k @ query[row, h, 0] * scale, dim=0) @ v
    return out


@pytest.mark.parametrize("heads,groups,masked", [(4, 2, True), (6, 1, True), (3, 3, False)])
def test_decode_attention_matches_loop_and_sdpa(heads, groups, masked):
    gen = torch.Generator().manual_seed(heads * 10 + groups)
    b, length, width = 5, 9, 8
    query = torch.randn(b, heads, 1, width, generator=gen, dtype=torch.float64)
    key, value = (torch.randn(b, groups, length, width, generator=gen, dtype=torch.float64) for _ in "kv")
    allowed = None
    if masked:  # left padding of different widths, and holes; every row keeps its newest key
        allowed = torch.rand(b, 1, 1, length, generator=gen) > 0.4
        allowed[..., -1] = True
        allowed[0, ..., :5] = False
    out = grouped_matmul_attention(query, key, value, 0.3,
                                   None if allowed is None else hf_attention.mask_bias(allowed, query.dtype))
    torch.testing.assert_close(out, _loop_reference(query, key, value, allowed, 0.3), rtol=0, atol=1e-12)
    sdpa = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=0.3, enable_gqa=groups != heads)
    torch.testing.assert_close(out, sdpa, rtol=0, atol=1e-12)


def test_only_single_query_float_cpu_steps_leave_sdpa(monkeypatch):
    from transformers.integrations import sdpa_attention

    calls = []
    monkeypatch.setattr(sdpa_attention, "sdpa_attention_forward", lambda *a, **kw: (calls.append("sdpa"), None)[1])
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    q1, q3 = torch.randn(2, 4, 1, 8), torch.randn(2, 4, 3, 8)
    k = v = torch.randn(2, 2, 3, 8)
    attention = hf_attention.decode_attention(grouped_matmul_attention, MATMUL_ATTENTION_DTYPES)
    out, weights = attention(module, q1, k, v, None, scaling=0.5)
    assert calls == [] and out.shape == (2, 1, 4, 8) and weights is None
    for query, keys, kwargs in [(q3, k, {}), (q1.bfloat16(), k.bfloat16(), {}), (q1, k, {"dropout": 0.1}),
                                (q1, k, {"softcap": 30.0}), (q1, k, {"s_aux": torch.zeros(4)})]:
        attention(module, query, keys, keys, None, **kwargs)
    assert calls == ["sdpa"] * 5


@pytest.mark.skipif(not TESTED, reason="compat.hf_attention stands aside for this transformers (the model runs sdpa)")
def test_generation_equals_the_models_own_sdpa(tmp_path):
    """Left-padded prompts of different lengths, rows stopping at different steps: the same tokens and log-probs as
    the same model with transformers' ``sdpa`` in every step."""
    model_dir = str(make_tiny_hf_model(tmp_path, "qwen2", vocab_size=128, hidden_size=32, num_layers=2,
                                       intermediate_size=64, init_std=0.3, seed=5))
    tok = build_char_tokenizer()
    prompts = [tok.encode(t, add_special_tokens=False) for t in ("12+3=", "7+88=", "x", "1000+2000=")]
    rollout = HFRollout(model_dir, tok)
    assert rollout.model.config._attn_implementation == hf_attention.NAME
    assert not hf_attention.use_decode_attention(rollout.model, grouped_matmul_attention, MATMUL_ATTENTION_DTYPES), \
        "only a model on sdpa is switched"
    kw = dict(do_sample=True, temperature=1.0, max_new_tokens=12, seeds=[3, 4, 5, 6])
    ours = rollout.generate(prompts, n=3, **kw)
    assert len({len(o["response_ids"]) for o in ours}) > 1, "rows must stop at different steps"
    rollout.model.set_attn_implementation("sdpa")
    theirs = rollout.generate(prompts, n=3, **kw)
    assert [o["response_ids"] for o in ours] == [o["response_ids"] for o in theirs]
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a["log_probs"], b["log_probs"], atol=1e-5, rtol=0)
