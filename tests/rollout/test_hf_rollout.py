"""HFRollout: shapes and order, EOS stop, seed determinism, layout independence of batched sampling,
shared prefill and stopped-row dropping vs the plain loop,
Gumbel-max draws vs the softmax they sample, log-probs vs an independent recompute, weight sync."""

from types import SimpleNamespace

import pytest
import torch

from verl_lite.data.char_tokenizer import build_char_tokenizer
from verl_lite.rollout import HFRollout, make_rollout, vllm_available
from verl_lite.rollout.hf_rollout import _filter_top_k_top_p, counter_uniform, inverse_cdf_sample
from verl_lite.utils import make_tiny_hf_model

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(make_tiny_hf_model(tmp_path_factory.mktemp("m"), "qwen2", vocab_size=128, hidden_size=32, num_layers=2,
                                  intermediate_size=64, init_std=0.3, seed=3))


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _prompts(tok):
    return [tok.encode(t, add_special_tokens=False) for t in ("12+3=", "7+88=", "x")]


def _recompute(model, prompt, response, temperature):
    """log p_T(response_t | prefix) with one unpadded forward, in float64."""
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    pos = torch.arange(len(prompt) - 1, len(prompt) + len(response) - 1)
    return logp[pos, torch.tensor(response)]


def test_shapes_and_prompt_major_order(model_dir, tok):
    r = HFRollout(model_dir, tok)
    prompts = _prompts(tok)
    outs = r.generate(prompts, n=3, do_sample=True, temperature=1.0, max_new_tokens=7, seed=0)
    assert len(outs) == 9
    for o in outs:
        assert 1 <= len(o["response_ids"]) <= 7
        assert o["log_probs"].shape == (len(o["response_ids"]),) and o["log_probs"].dtype == torch.float32
        assert (o["log_probs"] <= 0).all()
    # prompt-major: rows 3k..3k+2 belong to prompt k -> generating prompt k alone with n=3 ... greedy gives equal rows
    greedy = r.generate(prompts, n=3, do_sample=False, max_new_tokens=7)
    for k in range(3):
        alone = r.generate([prompts[k]], n=1, do_sample=False, max_new_tokens=7)[0]["response_ids"]
        assert [g["response_ids"] for g in greedy[3 * k:3 * k + 3]] == [alone] * 3


def test_left_padding_does_not_change_results(model_dir, tok):
    """A prompt batched with longer prompts gives the same greedy tokens and log-probs as alone."""
    r = HFRollout(model_dir, tok)
    prompts = _prompts(tok)
    batched = r.generate(prompts, n=1, do_sample=False, max_new_tokens=6)
    for p, b in zip(prompts, batched):
        alone = r.generate([p], n=1, do_sample=False, max_new_tokens=6)[0]
        assert alone["response_ids"] == b["response_ids"]
        torch.testing.assert_close(alone["log_probs"], b["log_probs"], atol=1e-5, rtol=0)


def test_eos_stop(model_dir, tok):
    """With EOS := a token greedy decoding emits, the response is the no-EOS response cut after its first EOS."""
    r = HFRollout(model_dir, tok)
    prompts = _prompts(tok)
    r.eos_token_id = -1  # matches no token: never stops early
    full = r.generate(prompts, n=1, do_sample=False, max_new_tokens=12)
    for f in full:
        assert len(f["response_ids"]) == 12
    stop_tok = full[0]["response_ids"][4]  # a token the first prompt emits at step 5
    r.eos_token_id = stop_tok
    cut = r.generate(prompts, n=1, do_sample=False, max_new_tokens=12)
    for f, c in zip(full, cut):
        ids = f["response_ids"]
        expect = ids[: ids.index(stop_tok) + 1] if stop_tok in ids else ids
        assert c["response_ids"] == expect
        assert c["response_ids"].count(stop_tok) <= 1
    assert len(cut[0]["response_ids"]) <= 5 and cut[0]["response_ids"][-1] == stop_tok


def test_seed_determinism(model_dir, tok):
    r = HFRollout(model_dir, tok)
    prompts = _prompts(tok)
    kw = dict(n=8, do_sample=True, temperature=1.3, max_new_tokens=8)
    a = r.generate(prompts, seed=11, **kw)
    b = r.generate(prompts, seed=11, **kw)
    c = r.generate(prompts, seed=12, **kw)
    assert [x["response_ids"] for x in a] == [x["response_ids"] for x in b]
    assert [x["response_ids"] for x in a] != [x["response_ids"] for x in c]
    # global RNG is untouched
    torch.manual_seed(5)
    before = torch.rand(3)
    torch.manual_seed(5)
    r.generate(prompts, seed=1, **kw)
    torch.testing.assert_close(torch.rand(3), before)


def _varied_prompts(tok):
    texts = ("12+3=", "7+88=", "x", "40+40=", "5+5=", "99+1=", "3+", "61+27=")
    return [tok.encode(t, add_special_tokens=False) for t in texts]


def test_samples_do_not_depend_on_layout_or_batch_composition(model_dir, tok):
    """With one seed per prompt, sample k of prompt p is the same whether the prompts go to one
    worker in one call, to 4 workers (4 calls over contiguous splits), in a shuffled batch, or
    alone; and the first n samples of n' > n are the n samples."""
    r = HFRollout(model_dir, tok)
    prompts = _varied_prompts(tok)
    seeds = [1000 + 17 * p for p in range(len(prompts))]
    kw = dict(do_sample=True, temperature=1.0, top_k=-1, top_p=1.0, max_new_tokens=8)
    n = 4

    def by_prompt(outs, idx, per=n):
        return {p: outs[j * per:(j + 1) * per] for j, p in enumerate(idx)}

    one = by_prompt(r.generate(prompts, n=n, seeds=seeds, **kw), range(len(prompts)))
    four = {}
    for lo, hi in ((0, 2), (2, 4), (4, 6), (6, 8)):
        four.update(by_prompt(r.generate(prompts[lo:hi], n=n, seeds=seeds[lo:hi], **kw), range(lo, hi)))
    order = [5, 0, 7, 2, 6, 1, 4, 3]
    shuffled = by_prompt(r.generate([prompts[p] for p in order], n=n, seeds=[seeds[p] for p in order], **kw), order)
    alone = {p: r.generate([prompts[p]], n=n, seeds=[seeds[p]], **kw) for p in (2, 5)}
    wider = by_prompt(r.generate(prompts[:3], n=2 * n, seeds=seeds[:3], **kw), range(3), per=2 * n)
    distinct = set()
    for p in range(len(prompts)):
        ref = one[p]
        distinct.update(tuple(o["response_ids"]) for o in ref)
        for other in (four[p], shuffled[p], alone.get(p, ref), wider[p][:n] if p < 3 else ref):
            assert [o["response_ids"] for o in other] == [o["response_ids"] for o in ref], p
            for a, b in zip(other, ref):
                torch.testing.assert_close(a["log_probs"], b["log_probs"], atol=1e-5, rtol=0)
    assert len(distinct) > len(prompts), "samples of a prompt must differ from each other (sample ids key the noise)"
    # a prompt's samples change with its seed
    moved = r.generate(prompts[:1], n=n, seeds=[seeds[0] + 1], **kw)
    assert [o["response_ids"] for o in moved] != [o["response_ids"] for o in one[0]]


def test_shared_prefill_in_place_cache_and_dropping_stopped_rows_change_no_sample(model_dir, tok, monkeypatch):
    """One prefill per prompt (its n samples copy the KV cache), a KV cache written in place
    (``compat.kv_cache``) and stopped rows leaving the batch give the same tokens and log-probs as the
    plain loop: transformers' own cache, prompts repeated n times, stopped rows kept and masked."""
    from transformers import DynamicCache

    from verl_lite.compat import kv_cache
    from verl_lite.rollout import hf_rollout

    r = HFRollout(model_dir, tok)
    prompts = _varied_prompts(tok)
    seeds = [7 + 3 * p for p in range(len(prompts))]
    kw = dict(do_sample=True, temperature=1.0, top_k=-1, top_p=1.0, max_new_tokens=10)
    selected = []
    layer = kv_cache.reserved_layer_class()
    select = layer.batch_select_indices
    monkeypatch.setattr(layer, "batch_select_indices", lambda self, idx: (selected.append(len(idx)), select(self, idx)))
    in_place = kv_cache.supported(r.model.config)  # False: another transformers, the cache stands aside
    monkeypatch.setattr(hf_rollout, "COMPACT_AT", 0.99)  # rows leave at every stop (here: fewer than 1/8 stop)
    fast = r.generate(prompts, n=4, seeds=seeds, **kw)
    lengths = {len(o["response_ids"]) for o in fast}
    assert min(lengths) < max(lengths) == 10, "some rows must stop before others for the test to cover dropping them"
    if in_place:
        assert selected and min(selected) < len(prompts) * 4, "stopped rows must have left the batch"
    monkeypatch.setattr(hf_rollout, "reserved_cache", lambda *a: None)
    monkeypatch.setattr(DynamicCache, "batch_select_indices", None)
    plain = r.generate(prompts, n=4, seeds=seeds, **kw)
    assert [o["response_ids"] for o in fast] == [o["response_ids"] for o in plain]
    for a, b in zip(fast, plain):
        torch.testing.assert_close(a["log_probs"], b["log_probs"], atol=1e-5, rtol=0)


def test_a_prompt_given_twice_is_prefilled_once_and_samples_as_if_alone(model_dir, tok, monkeypatch):
    """A stream sends a group's samples as separate prompts (n=1 each): each distinct prompt is prefilled once and
    its rows take copies of its cache, with the same tokens and log-probs as every row prefilled on its own."""
    from transformers import DynamicCache

    from verl_lite.rollout import hf_rollout

    r = HFRollout(model_dir, tok)
    distinct = _varied_prompts(tok)[:3]
    prompts = [distinct[i % 3] for i in range(9)]  # each three times, interleaved
    seeds = [11 + 5 * i for i in range(9)]
    kw = dict(do_sample=True, temperature=1.0, top_k=-1, top_p=1.0, max_new_tokens=10)
    forward, prefill_rows = r.model.forward, []

    def counting(*args, **kwargs):
        if kwargs["input_ids"].shape[1] > 1:  # a prefill (a decode step feeds one token per row)
            prefill_rows.append(kwargs["input_ids"].shape[0])
        return forward(*args, **kwargs)

    monkeypatch.setattr(r.model, "forward", counting)
    shared = r.generate(prompts, n=1, seeds=seeds, **kw)
    assert prefill_rows == [3]
    monkeypatch.setattr(hf_rollout, "reserved_cache", lambda *a: None)
    monkeypatch.setattr(DynamicCache, "batch_select_indices", None)  # a cache that cannot copy rows
    prefill_rows.clear()
    alone = r.generate(prompts, n=1, seeds=seeds, **kw)
    assert prefill_rows[-1] == 9  # every row prefilled on its own
    assert [o["response_ids"] for o in shared] == [o["response_ids"] for o in alone]
    for a, b in zip(shared, alone):
        torch.testing.assert_close(a["log_probs"], b["log_probs"], atol=1e-5, rtol=0)


def test_counter_uniform_is_a_function_of_its_key_only():
    seeds = torch.tensor([3, 3, 7, 2**40 + 3])
    samples = torch.tensor([0, 1, 0, 0])
    u = counter_uniform(seeds, samples, position=5)
    assert u.dtype == torch.float64 and u.shape == (4,) and (u > 0).all() and (u < 1).all()
    for i in range(4):  # the same value for a row computed alone
        torch.testing.assert_close(counter_uniform(seeds[i:i + 1], samples[i:i + 1], 5)[0], u[i], atol=0, rtol=0)
    # every key component matters (seed incl. its high bits, sample id, position)
    assert len(set(u.tolist())) == 4
    assert not torch.equal(counter_uniform(seeds, samples, 6), u)
    big = counter_uniform(torch.arange(40000), torch.zeros(40000, dtype=torch.long), 0)
    assert abs(float(big.mean()) - 0.5) < 0.005 and abs(float(big.var()) - 1 / 12) < 0.002
    # neighbouring keys (seeds, and positions of one row) are uncorrelated
    assert abs(float(torch.corrcoef(torch.stack([big[:-1], big[1:]]))[0, 1])) < 0.02
    by_position = torch.stack([counter_uniform(torch.tensor([11]), torch.tensor([2]), t) for t in range(4000)]).flatten()
    assert abs(float(torch.corrcoef(torch.stack([by_position[:-1], by_position[1:]]))[0, 1])) < 0.05


@pytest.mark.parametrize("top_k", [-1, 3])
def test_inverse_cdf_draws_follow_the_softmax(top_k):
    """Frequencies of 40000 draws (different sample ids) vs softmax(filtered logits): chi-square."""
    logits = torch.tensor([[1.5, 0.2, -0.7, 2.0, 0.0, -3.0, 1.0, -1.2]])
    rows = 40000
    filtered = _filter_top_k_top_p(logits, top_k, 1.0).expand(rows, -1)
    u = counter_uniform(torch.full((rows,), 123), torch.arange(rows), position=0)
    draws = inverse_cdf_sample(filtered, u)
    counts = torch.bincount(draws, minlength=8).double()
    probs = torch.softmax(filtered[0].double(), -1)
    kept = probs > 0
    assert counts[~kept].sum() == 0
    expected = probs[kept] * rows
    chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
    assert chi2 < 30.0, (chi2, counts.tolist(), expected.tolist())  # p < 1e-4 at <= 7 degrees of freedom


def test_inverse_cdf_never_draws_a_filtered_token_at_the_extremes():
    """The smallest and largest uniforms of the 2**-32 grid draw the first and the last token that can be drawn:
    filtered (-inf) tokens before, between and after them own empty intervals."""
    inf = float("-inf")
    logits = torch.tensor([[inf, inf, 0.3, inf, -1.0, 2.0, inf, inf]] * 2)
    extremes = torch.tensor([0.5 / 2**32, 1 - 0.5 / 2**32], dtype=torch.float64)
    assert inverse_cdf_sample(logits, extremes).tolist() == [2, 5]
    one_token = torch.tensor([[inf, 4.0, inf]] * 2)
    assert inverse_cdf_sample(one_token, extremes).tolist() == [1, 1]


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, -1, 1.0), (0.7, -1, 1.0), (1.5, 5, 0.9)])
def test_log_probs_match_independent_recompute(model_dir, tok, temperature, top_k, top_p):
    r = HFRollout(model_dir, tok)
    prompts = _prompts(tok)
    outs = r.generate(prompts, n=4, do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p,
                      max_new_tokens=8, seed=2)
    for i, o in enumerate(outs):
        ref = _recompute(r.model, prompts[i // 4], o["response_ids"], temperature)
        torch.testing.assert_close(o["log_probs"].double(), ref, atol=2e-5, rtol=0)


def test_top_k_top_p_filter_matches_loop():
    torch.manual_seed(0)
    logits = torch.randn(4, 10, dtype=torch.float64)
    out = _filter_top_k_top_p(logits, top_k=6, top_p=0.8)
    for row, orow in zip(logits, out):
        order = sorted(range(10), key=lambda j: -row[j].item())[:6]
        kept_k = torch.full((10,), float("-inf"), dtype=torch.float64)
        kept_k[order] = row[order]
        probs = torch.softmax(kept_k, -1)
        keep, mass = set(), 0.0
        for j in sorted(range(10), key=lambda j: -kept_k[j].item()):
            if mass >= 0.8:
                break
            keep.add(j)
            mass += probs[j].item()
        for j in range(10):
            assert (orow[j].item() == float("-inf")) == (j not in keep)


def test_samples_respect_top_k(model_dir, tok):
    r = HFRollout(model_dir, tok)
    p = _prompts(tok)[:1]
    with torch.no_grad():
        first = r.model(input_ids=torch.tensor(p)).logits[0, -1]
    allowed = set(torch.topk(first, 2).indices.tolist())
    outs = r.generate(p, n=32, do_sample=True, temperature=2.0, top_k=2, max_new_tokens=1, seed=0)
    assert {o["response_ids"][0] for o in outs} <= allowed


def test_load_weights_changes_outputs_and_checks_names(model_dir, tok):
    r = HFRollout(model_dir, tok)
    prompts = _prompts(tok)
    before = r.generate(prompts, n=1, do_sample=False, max_new_tokens=6)
    other = make_rollout("hf", str(make_tiny_hf_model(model_dir + "_other", "qwen2", vocab_size=128, hidden_size=32,
                                                      num_layers=2, intermediate_size=64, init_std=0.3, seed=99)), tok)
    expect = other.generate(prompts, n=1, do_sample=False, max_new_tokens=6)
    n = r.load_weights(((k, v.clone()) for k, v in other.model.state_dict().items()), strict=True)
    assert n == len(other.model.state_dict())
    after = r.generate(prompts, n=1, do_sample=False, max_new_tokens=6)
    assert [a["response_ids"] for a in after] == [e["response_ids"] for e in expect]
    assert [a["response_ids"] for a in after] != [b["response_ids"] for b in before]
    with pytest.raises(ValueError, match="model.layers.0.nonexistent"):
        r.load_weights([("model.layers.0.nonexistent", torch.zeros(1))])
    with pytest.raises(ValueError, match="shape"):
        r.load_weights([("lm_head.weight", torch.zeros(3, 3))])
    with pytest.raises(ValueError, match="not provided"):
        r.load_weights([("lm_head.weight", other.model.lm_head.weight)], strict=True)


def test_vllm_backend_is_lazy():
    import verl_lite.rollout.vllm_rollout  # noqa: F401  (must import without vllm)

    if not vllm_available():
        with pytest.raises((ImportError, RuntimeError)):
            make_rollout("vllm", "/nonexistent", SimpleNamespace(eos_token_id=2))
