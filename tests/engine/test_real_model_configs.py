"""Every shipped real model config (``verl_lite/assets/model_configs``) through the engine, on CPU.

For each config (Qwen2.5 0.5B/1.5B/3B/7B, Qwen3 0.6B/1.7B/4B/8B, Llama-3.1-8B, Llama-3.2-1B/3B) and
layout, every rank:
- builds the HF model from the config with random weights (same seed on every rank), loads its
  state dict into the engine's chunks, exports it back and checks every tensor is bit-identical
  (``torch.equal``) with exactly the HF names (tied models: no ``lm_head.weight``);
- runs a THD pack of ragged sequences (a length-1 one included; token ids span the whole vocabulary,
  ``V - 1`` among them) through the pipeline and compares next-token log-probs
  (``vocab_parallel_log_probs``) and entropies (``vocab_parallel_entropy``) with the float64 HF model
  (the same weights), within 1e-5.

Layouts: TP2 and PP2 with the config's vocabulary (a multiple of 128: no padding), and TP2 with the
tokenizer's true size, which TP2 does not divide, so the engine pads the vocabulary (to the next
multiple of 128): Qwen2.5 151665 (``len(tokenizer)``) and Qwen3 151669 -> 151680; the Llama-3
tokenizer has exactly the config's 128256, so Llama gets the odd variant 128255 -> 128256. In that
layout the padded rows of the embedding and LM head are overwritten with N(0, 16) values (large logits
against real logits of ~1), the export must still be bit-exact, and log-probs computed without the mask must be
far off (the check is sensitive). A 4-rank launch covers TP4 on the Qwen2.5 configs with 2 KV heads
(TP larger than the KV heads: megatron replicates each KV head over TP/2 ranks), TP4 with a
vocabulary TP4 does not divide, and TP2 x PP2 with padding and tied embeddings on two stages.
One multi-process launch per rank count runs every config and layout.

The cut (memory and time: 2-4 ranks on a shared 2-core, 24 GB machine each hold an HF model, its
float64 copy of the decoder layers and their shards): ``num_hidden_layers = 2`` (one per PP2 stage),
``hidden_size = 128``, ``intermediate_size = 256`` (the vocabulary matrices, 128k-152k rows x hidden, are
most of the launch's time). Never cut: the
vocabulary, num heads, KV heads, head_dim (pinned to the real value, so q/k/v keep the real head
layout and GQA ratio), tied/untied embeddings, RoPE (theta, Llama-3 scaling), RMS eps, q/k/v bias,
q/k norm.
"""

from __future__ import annotations

import gc
import math
from pathlib import Path

import pytest
import torch

from .conftest import pack, pipeline_forward, spawn_ranks, use_layout

CONFIG_DIR = Path(__file__).resolve().parents[2] / "verl_lite" / "assets" / "model_configs"
REAL_MODELS = sorted(p.name for p in CONFIG_DIR.iterdir() if (p / "config.json").is_file())
TRUE_TOKENIZER_VOCAB = {"qwen2": 151665, "qwen3": 151669, "llama": 128255}  # llama: an odd variant
MAX_HIDDEN, CUT_HIDDEN, CUT_INTERMEDIATE = 128, 128, 256
LENGTHS = [9, 1, 16, 6]
TOL = 1e-5


def cut_config(name: str, vocab_size: int | None = None):
    """The HF config of ``name`` cut as the module docstring says (optionally another vocab size)."""
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(CONFIG_DIR / name)
    real_head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    cfg.num_hidden_layers = 2
    if hasattr(cfg, "max_window_layers"):
        cfg.max_window_layers = 2
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = cfg.layer_types[:2]
    if cfg.hidden_size > MAX_HIDDEN:
        cfg.hidden_size, cfg.intermediate_size = CUT_HIDDEN, CUT_INTERMEDIATE
    cfg.head_dim = real_head_dim
    if vocab_size is not None:
        cfg.vocab_size = vocab_size
    cfg.dtype = torch.float32
    return cfg


def _sequences(vocab: int, odd_vocab: int) -> list[torch.Tensor]:
    """Ragged sequences; the first three use ids < ``odd_vocab`` (so they serve the padded variant too)
    and hold ``odd_vocab - 1``, the last holds ``vocab - 1``: the last vocabulary rows are labels."""
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, odd_vocab, (n,), generator=gen) for n in LENGTHS]
    seqs[0][-2:] = torch.tensor([odd_vocab - 1, odd_vocab - 2])
    seqs[2][3] = odd_vocab - 1
    seqs[3][2:4] = torch.tensor([vocab - 1, vocab - 2])
    return seqs


ODD_SEQS = 3  # the sequences of the padded variant: ``seqs[:ODD_SEQS]``


def _hf_model(cfg, seed: int):
    """The HF model of ``cfg`` with seeded weights, the same in every process: matrices and biases
    U(-a, a) with std ``initializer_range``, norm weights 1 + U(-0.1, 0.1) (uniform_ is 2x faster than
    HF's normal_ init on a 152k-row embedding)."""
    import transformers
    from transformers.initialization import no_init_weights

    with no_init_weights():
        hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    hf.tie_weights()  # no_init_weights skips the tying that post_init does
    if cfg.tie_word_embeddings and hf.lm_head.weight is not hf.model.embed_tokens.weight:
        raise AssertionError(f"{cfg.model_type}: HF did not tie lm_head to embed_tokens")
    gen = torch.Generator().manual_seed(seed)
    a = cfg.initializer_range * 3**0.5
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.uniform_(0.9, 1.1, generator=gen)
            else:
                p.uniform_(-a, a, generator=gen)
    return hf


def _reference(hf, seqs, odd_vocab, rank, world):
    """float64 HF next-token log-probs and entropies, ``{vocab: (log-probs, entropies)}`` per sequence,
    for the config's vocabulary (all ``seqs``) and for ``odd_vocab`` (``seqs[:ODD_SEQS]``). Each rank
    computes its share of the sequences; the results are all-gathered.

    float64 is what HF's ``ForCausalLM.forward`` computes, ``lm_head(model(ids).last_hidden_state)``,
    on a float64 copy of the model, without a float64 copy of the vocabulary tensors (2 x 152k rows
    on every rank, most of the launch's time): ``model`` (decoder layers, norm, RoPE) is copied to
    float64 and fed the ids' embedding rows (``inputs_embeds``: a row lookup, exact in float64); the
    LM head (bias-free) is the float64 product with ``lm_head.weight``, one block of rows at a time.

    The padded variant's reference is the same forward with the logits cut to the first ``odd_vocab``
    columns: the HF model with ``vocab_size = odd_vocab`` holds the first ``odd_vocab`` rows of the
    embedding and LM head (``_odd_state_dict``), and a sequence of ids < ``odd_vocab`` reads no other
    embedding row, so its logits are exactly these columns."""
    import copy

    import torch.distributed as dist

    V = hf.config.vocab_size
    embed, head = hf.model.embed_tokens.weight, hf.lm_head.weight
    assert hf.lm_head.bias is None
    body64 = copy.deepcopy(hf.model, memo={id(embed): None}).double()  # every tensor but the embedding
    share = [i for i in range(len(seqs)) if i % world == rank]
    mine = {}
    with torch.no_grad():
        h = torch.cat([body64(inputs_embeds=embed[seqs[i]].double()[None]).last_hidden_state[0] for i in share])
        logits_all = torch.cat([h @ rows.double().T for rows in head.split(16384)], dim=1)
        for i, logits in zip(share, logits_all.split([len(seqs[i]) for i in share])):
            s = seqs[i]
            for vocab in (V, odd_vocab) if i < ODD_SEQS else (V,):
                lsm = logits[:, :vocab].log_softmax(-1)
                mine[(vocab, i)] = (lsm[:-1].gather(-1, s[1:, None])[:, 0], -(lsm.exp() * lsm).sum(-1))
    del body64, logits_all
    gathered = [None] * world
    dist.all_gather_object(gathered, mine)
    out = {k: v for d in gathered for k, v in d.items()}
    return {
        vocab: ([out[(vocab, i)][0] for i in range(n)], [out[(vocab, i)][1] for i in range(n)])
        for vocab, n in ((V, len(seqs)), (odd_vocab, ODD_SEQS))
    }


def _odd_state_dict(sd: dict, odd_vocab: int) -> dict:
    """The checkpoint of the same model with its vocabulary cut to the first ``odd_vocab`` tokens
    (views of ``sd``'s rows: loading copies them, nothing writes to them)."""
    vocab_tensors = ("model.embed_tokens.weight", "lm_head.weight")
    return {k: (v[:odd_vocab] if k in vocab_tensors else v) for k, v in sd.items()}


def _padded_vocab_params(chunks):
    """Every vocab-parallel parameter this rank holds (embedding, LM head; a tied pair once)."""
    from verl_lite.engine.model import unwrap_model

    out = {}
    for c in chunks:
        m = unwrap_model(c)
        if m.pre_process:
            out[id(m.embedding.word_embeddings.weight)] = m.embedding.word_embeddings.weight
        if m.post_process and getattr(m, "output_layer", None) is not None and m.output_layer.weight is not None:
            out[id(m.output_layer.weight)] = m.output_layer.weight
    return list(out.values())


def _check(rank, world, parallel, cfg, sd, seqs, ref, poison_padding):
    """One config in one layout: export round trip, log-probs and entropies vs ``ref``."""
    from megatron.core import parallel_state as ps

    from verl_lite.engine.hf_bridge import export_hf, load_hf_weights
    from verl_lite.engine.model import build_model_chunks, transformer_config_from_hf
    from verl_lite.engine.vocab_parallel import padded_vocab_size, vocab_parallel_entropy, vocab_parallel_log_probs

    use_layout(rank, world, parallel)
    tp, tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    V = cfg.vocab_size
    Vp = padded_vocab_size(V, tp)
    # perform_initialization=False: every weight comes from the checkpoint (saves a 152k-row init)
    chunks = build_model_chunks(cfg, transformer_config_from_hf(cfg, parallel, perform_initialization=False))
    load_hf_weights(chunks, sd, cfg)
    r = dict(padded_rows=Vp - V)
    local = Vp // tp
    real_local = max(0, min(local, V - tp_rank * local))
    with torch.no_grad():
        vocab_params = _padded_vocab_params(chunks)
        r["vocab_rows_ok"] = all(p.shape[0] == local for p in vocab_params)
        r["padding_zero_after_load"] = all(bool((p[real_local:] == 0).all()) for p in vocab_params)
        if poison_padding:
            gen = torch.Generator().manual_seed(100 + tp_rank)
            for p in vocab_params:
                p[real_local:] = 4.0 * torch.randn(p[real_local:].shape, generator=gen)
    exported = {}
    for hf_name, t in export_hf(chunks, cfg):
        exported[hf_name] = bool(hf_name in sd and torch.equal(t, sd[hf_name]))
    r.update(names_equal=set(exported) == set(sd), all_equal=all(exported.values()))
    ids, psp, where = pack(seqs, 1, 0)
    labels, _, _ = pack([torch.cat([s[1:], s.new_zeros(1)]) for s in seqs], 1, 0)
    with torch.no_grad():
        logits = pipeline_forward(chunks, ids[None], psp, cfg.hidden_size)
    if ps.is_pipeline_last_stage():
        lp = vocab_parallel_log_probs(logits[0], labels, vocab_size=V)
        ent = vocab_parallel_entropy(logits[0], vocab_size=V)
        lp_err = ent_err = 0.0
        for i, w in enumerate(where):
            if len(w) > 1:
                lp_err = max(lp_err, (lp[w[:-1]].double() - ref[0][i]).abs().max().item())
            ent_err = max(ent_err, (ent[w].double() - ref[1][i]).abs().max().item())
        r.update(lp_err=lp_err, ent_err=ent_err)
        if poison_padding and Vp > V:  # the same logits without the mask: the padded rows must matter
            unmasked = vocab_parallel_log_probs(logits[0], labels)
            r["unmasked_lp_err"] = max(
                (unmasked[w[:-1]].double() - ref[0][i]).abs().max().item() for i, w in enumerate(where) if len(w) > 1
            )
    del chunks
    _collect_garbage()
    return r


def _collect_garbage():
    """Free the dropped models (module graphs may hold reference cycles), then freeze what is left
    (the imported libraries' millions of objects), so the next collection scans only the new ones
    (a full one takes ~0.4 s)."""
    gc.collect()
    gc.freeze()


def _run(rank, world, plan):
    """``plan``: [(model name, layouts with the config's vocabulary, layouts with the tokenizer's true
    size)]; a layout is (name, MegatronConfig.layout kwargs). Returns {(model, vocab, layout): results}."""
    import time

    from verl_lite.engine.config import MegatronConfig

    out = {}
    for name, real_layouts, odd_layouts in plan:
        t0 = time.time()
        cfg = cut_config(name)
        odd_vocab = TRUE_TOKENIZER_VOCAB[cfg.model_type]
        hf = _hf_model(cfg, seed=REAL_MODELS.index(name))
        sd = {k: v for k, v in hf.state_dict().items() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
        seqs = _sequences(cfg.vocab_size, odd_vocab)
        ref = _reference(hf, seqs, odd_vocab, rank, world)
        del hf
        cases = [(cfg, sd, seqs, ref[cfg.vocab_size], False, layout) for layout in real_layouts]
        if odd_layouts:
            odd = (cut_config(name, odd_vocab), _odd_state_dict(sd, odd_vocab), seqs[:ODD_SEQS], ref[odd_vocab], True)
            cases += [(*odd, layout) for layout in odd_layouts]
        for c, c_sd, c_seqs, c_ref, poison, (layout, kw) in cases:
            parallel = MegatronConfig.layout(timeout_s=300.0, **kw)
            out[(name, c.vocab_size, layout)] = _check(rank, world, parallel, c, c_sd, c_seqs, c_ref, poison)
        del sd, cases
        _collect_garbage()
        if rank == 0:
            print(f"{name}: {time.time() - t0:.1f}s", flush=True)
    return out


TP2, PP2, TP4, TP2_PP2 = ("tp2", dict(tp=2)), ("pp2", dict(pp=2)), ("tp4", dict(tp=4)), ("tp2_pp2", dict(tp=2, pp=2))
PLAN_2 = [(n, [TP2, PP2], [TP2]) for n in REAL_MODELS]
# TP larger than the KV heads: the Qwen2.5 configs with 2 KV heads and heads divisible by 4
TP_OVER_KV = ["Qwen2.5-1.5B", "Qwen2.5-3B"]
PLAN_4 = [("Qwen2.5-1.5B", [TP4], [TP4]), ("Qwen2.5-3B", [TP4], []), ("Qwen3-0.6B", [], [TP2_PP2])]


def _print_worst(results, world):
    worst = {}
    for res in results:
        for r in res.values():
            for k in ("lp_err", "ent_err"):
                if k in r:
                    worst[k] = max(worst.get(k, 0.0), r[k])
            if "unmasked_lp_err" in r:
                worst["unmasked_lp_err (min)"] = min(worst.get("unmasked_lp_err (min)", 1e9), r["unmasked_lp_err"])
    print(f"\n{world} ranks, worst:", {k: f"{v:.1e}" for k, v in sorted(worst.items())})


@pytest.fixture(scope="module")
def two_ranks():
    results = spawn_ranks(_run, 2, PLAN_2, timeout_s=300.0)
    _print_worst(results, 2)
    return results


@pytest.fixture(scope="module")
def four_ranks():
    results = spawn_ranks(_run, 4, PLAN_4, timeout_s=300.0)
    _print_worst(results, 4)
    return results


def _results(request, model: str) -> list[tuple[int, tuple, dict]]:
    """(rank, (model, vocab, layout), result) of every case of ``model`` in both launches."""
    out = []
    for fixture, plan in (("two_ranks", PLAN_2), ("four_ranks", PLAN_4)):
        if any(name == model for name, *_ in plan):
            for rank, res in enumerate(request.getfixturevalue(fixture)):
                out += [(rank, key, r) for key, r in res.items() if key[0] == model]
    return out


PUBLISHED = {  # name: (vocab, hidden, heads, kv heads, head_dim, tied, rope type) as published
    "Qwen2.5-0.5B": (151936, 896, 14, 2, 64, True, "default"),
    "Qwen2.5-1.5B": (151936, 1536, 12, 2, 128, True, "default"),
    "Qwen2.5-3B": (151936, 2048, 16, 2, 128, True, "default"),
    "Qwen2.5-7B": (152064, 3584, 28, 4, 128, False, "default"),
    "Qwen3-0.6B": (151936, 1024, 16, 8, 128, True, "default"),
    "Qwen3-1.7B": (151936, 2048, 16, 8, 128, True, "default"),
    "Qwen3-4B": (151936, 2560, 32, 8, 128, True, "default"),
    "Qwen3-8B": (151936, 4096, 32, 8, 128, False, "default"),
    "Llama-3.1-8B": (128256, 4096, 32, 8, 128, False, "llama3"),
    "Llama-3.2-1B": (128256, 2048, 32, 8, 64, True, "llama3"),
    "Llama-3.2-3B": (128256, 3072, 24, 8, 128, True, "llama3"),
}


def test_shipped_configs_hold_the_published_shapes():
    import transformers

    assert sorted(PUBLISHED) == REAL_MODELS
    for name, (vocab, hidden, heads, kv, hd, tied, rope) in PUBLISHED.items():
        cfg = transformers.AutoConfig.from_pretrained(CONFIG_DIR / name)
        got_hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        got = (cfg.vocab_size, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, got_hd,
               cfg.tie_word_embeddings, cfg.rope_parameters["rope_type"])
        assert got == (vocab, hidden, heads, kv, hd, tied, rope), name
        cut = cut_config(name)  # the test's cut keeps the head layout and the vocabulary
        assert (cut.vocab_size, cut.num_attention_heads, cut.num_key_value_heads, cut.head_dim,
                cut.tie_word_embeddings) == (vocab, heads, kv, hd, tied), name


@pytest.mark.parametrize("model", REAL_MODELS)
def test_export_round_trip_is_bit_exact(request, model):
    cases = _results(request, model)
    assert {k[2] for _, k, _ in cases} >= {"tp2", "pp2"}, "the plan lost a layout"
    for rank, key, r in cases:
        assert r["names_equal"], f"rank {rank} {key}: exported names differ from the HF state dict"
        assert r["all_equal"], f"rank {rank} {key}: exported tensors are not bit-identical"
        assert r["vocab_rows_ok"], f"rank {rank} {key}: embedding/LM head rows are not Vp/tp"


@pytest.mark.parametrize("model", REAL_MODELS)
def test_log_probs_and_entropy_match_hf_float64(request, model):
    compared = set()
    for rank, key, r in _results(request, model):
        if "lp_err" in r:
            compared.add(key)
            assert r["lp_err"] < TOL, f"rank {rank} {key}: log-prob error {r['lp_err']:.2e}"
            assert r["ent_err"] < TOL, f"rank {rank} {key}: entropy error {r['ent_err']:.2e}"
    assert {k[2] for k in compared} >= {"tp2", "pp2"}, f"no last stage compared: {compared}"


@pytest.mark.parametrize("model", REAL_MODELS)
def test_padded_vocabulary_is_invisible(request, model):
    """TP2 with the tokenizer's true (odd) vocabulary: padded rows, zero after load, overwritten with
    large values, kept out of the log-probs (checked above) and stripped on export."""
    padded = [(rank, key, r) for rank, key, r in _results(request, model) if r["padded_rows"]]
    assert any(key[2] == "tp2" for _, key, _ in padded), "no layout needed padding"
    for rank, key, r in padded:
        assert key[1] % 2 == 1 and r["padded_rows"] == padded_rows_expected(key), key
        assert r["padding_zero_after_load"], f"rank {rank} {key}: padded rows are not zero after load"
        if "unmasked_lp_err" in r:
            assert r["unmasked_lp_err"] > 1.0, f"rank {rank} {key}: the poisoned rows did not change unmasked log-probs"


def padded_rows_expected(key) -> int:
    """megatron's rule with its default 128, as lcm(128, tp) (the same for TP 1, 2, 4, ..., 128)."""
    tp = {"tp2": 2, "tp4": 4, "tp2_pp2": 2}[key[2]]
    return (-key[1]) % math.lcm(128, tp)


@pytest.mark.parametrize("model", TP_OVER_KV)
def test_tp_larger_than_the_kv_heads(request, model):
    assert cut_config(model).num_key_value_heads < 4
    cases = [(rank, key, r) for rank, key, r in _results(request, model) if key[2] == "tp4"]
    assert len(cases) >= 4 and all("lp_err" in r for _, _, r in cases)  # TP4: every rank is a last stage
    for rank, key, r in cases:
        assert r["all_equal"] and r["lp_err"] < TOL and r["ent_err"] < TOL, (rank, key, r)
