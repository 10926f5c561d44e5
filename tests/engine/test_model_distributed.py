"""The megatron model in many parallel layouts, checked in two process launches (2 and 4 ranks).

Each launch runs every check for every layout and returns numbers; the tests below assert them.
Per layout and HF model, every rank:
- builds the chunks, loads the HF checkpoint, exports it back and checks every tensor is
  bit-identical (torch.equal) to the checkpoint, with exactly the checkpoint's names;
- runs a THD pack of ragged sequences (a length-1 sequence included) through the pipeline and
  compares next-token log-probs (``vocab_parallel_log_probs``) with HF's fp32 log-probs, and the
  entropy (``vocab_parallel_entropy``) with a float64 HF reference; under CP each rank compares its
  zig-zag share, under PP the last stage compares;
- for a value-head (critic) model: values vs ``final_norm(h) @ score^T`` from float64 HF hidden
  states, and the export round trip of ``score.weight``.
Also: gradients of a weighted log-prob sum through the model, exported with
``export_hf(attr="main_grad")``, vs float64 HF gradients (TP1, TP2, CP2, CP4); vocab-parallel log-prob/entropy values and gradients at TP2 vs float64 autograd; CP2/CP4
attention outputs and q/K/V gradients vs a dense float64 reference; and bounded waits (a
collective whose peer never joins fails within the group timeout, for megatron's TP/PP/DP/CP groups).
"""

from __future__ import annotations

import pytest
import torch

from .conftest import attention_module, dense_causal_attention, pack, pipeline_forward, spawn_ranks, use_layout, zigzag_split

ARCHS = [("qwen2", False), ("qwen2", True), ("qwen3", False), ("qwen3", True), ("llama", False), ("llama", True)]
LLAMA3_ROPE = dict(rope_theta=500000.0, max_position_embeddings=16384, rope_scaling=dict(
    rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192))
LENGTHS = [7, 13, 1, 20, 6]
LOGP_TOL = 1e-5
ENT_TOL = 1e-5
VALUE_RTOL = 1e-5  # |v - v_ref| / max(1, |v_ref|): values are O(3) here, fp32 vs float64


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """Tiny HF models, their sequences, HF fp32 log-probs and float64 entropies and values."""
    import transformers

    from verl_lite.utils import make_tiny_hf_model

    root = tmp_path_factory.mktemp("tiny")
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 128, (n,), generator=gen) for n in LENGTHS]
    out = {}
    for arch, tied in ARCHS + [("llama3rope", False)]:
        extra = LLAMA3_ROPE if arch == "llama3rope" else {}
        hf_arch = "llama" if arch == "llama3rope" else arch
        path = make_tiny_hf_model(root / f"{arch}_{int(tied)}", hf_arch, tie_word_embeddings=tied, seed=3, **extra)
        hf = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        hf64 = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
        logp, ent = [], []
        with torch.no_grad():
            for s in seqs:
                lp = hf(s[None]).logits[0].log_softmax(-1)
                logp.append(lp[:-1].gather(-1, s[1:, None])[:, 0])
                l64 = hf64(s[None]).logits[0].log_softmax(-1)
                ent.append(-(l64.exp() * l64).sum(-1))
        out[(arch, tied)] = dict(path=str(path), logp=logp, ent=ent)
    # a critic: qwen2 weights plus a score head; reference values in float64
    path = out[("qwen2", False)]["path"]
    hf64 = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    score = torch.randn(1, 64, generator=gen) * 0.3
    values = []
    with torch.no_grad():
        for s in seqs:
            h = hf64(s[None], output_hidden_states=True).hidden_states[-1][0]
            values.append((h @ score.double().T)[:, 0])
    out["critic"] = dict(path=path, score=score, values=values)
    # gradient reference: L = sum_i sum_t w_i,t * log p(s_i[t+1] | s_i[:t+1]), float64 HF
    weights = [torch.randn(max(n - 1, 0), generator=gen, dtype=torch.float64) for n in LENGTHS]
    hf64.zero_grad()
    for s, w in zip(seqs, weights):
        lp = hf64(s[None]).logits[0].log_softmax(-1)[:-1].gather(-1, s[1:, None])[:, 0]
        (lp * w).sum().backward()
    grads = {n: p.grad.detach().clone() for n, p in hf64.named_parameters() if p.grad is not None}
    out["grads"] = dict(path=path, weights=weights, grads=grads)
    return seqs, out


def _check_layout(rank, world, parallel, seqs, models, which, vh_check: bool):
    import transformers
    from megatron.core import parallel_state as ps
    from safetensors.torch import load_file

    from verl_lite.engine.hf_bridge import export_hf, load_hf_weights
    from verl_lite.engine.model import build_model_chunks, transformer_config_from_hf
    from verl_lite.engine.vocab_parallel import vocab_parallel_entropy, vocab_parallel_log_probs

    use_layout(rank, world, parallel)
    cp, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    tp = ps.get_tensor_model_parallel_world_size()
    last = ps.is_pipeline_last_stage()
    labels_full = [torch.cat([s[1:], s.new_zeros(1)]) for s in seqs]
    ids, psp, where = pack(seqs, cp, cp_rank, multiple=tp if parallel.sequence_parallel else 1)
    labels, _, _ = pack(labels_full, cp, cp_rank, multiple=tp if parallel.sequence_parallel else 1)
    res = {}
    for key, m in models.items():
        if key in ("critic", "grads") or (which != "all" and key not in which):
            continue
        cfg = transformers.AutoConfig.from_pretrained(m["path"])
        chunks = build_model_chunks(cfg, transformer_config_from_hf(cfg, parallel))
        load_hf_weights(chunks, m["path"], cfg)
        ref_sd = load_file(f"{m['path']}/model.safetensors")
        exported = {}
        for name, t in export_hf(chunks, cfg):
            exported[name] = bool(name in ref_sd and torch.equal(t, ref_sd[name]))
        r = dict(names_equal=set(exported) == set(ref_sd), all_equal=all(exported.values()))
        with torch.no_grad():
            logits = pipeline_forward(chunks, ids[None], psp, cfg.hidden_size)
        if last:
            lp = vocab_parallel_log_probs(logits[0], labels)
            ent = vocab_parallel_entropy(logits[0])
            lp_err = ent_err = 0.0
            for i, w in enumerate(where):
                n = len(w)
                mine = w[:-1] >= 0  # positions with a next token that this CP rank holds
                if mine.any():
                    lp_err = max(lp_err, (lp[w[:-1][mine]] - m["logp"][i][mine]).abs().max().item())
                mine = w >= 0
                if n and mine.any():
                    ent_err = max(ent_err, (ent[w[mine]].double() - m["ent"][i][mine]).abs().max().item())
            r.update(lp_err=lp_err, ent_err=ent_err)
        res[f"{key[0]}_tied{int(key[1])}"] = r
    if vh_check:
        c = models["critic"]
        cfg = transformers.AutoConfig.from_pretrained(c["path"])
        sd = load_file(f"{c['path']}/model.safetensors")
        sd["score.weight"] = c["score"]
        chunks = build_model_chunks(cfg, transformer_config_from_hf(cfg, parallel), value_head=True)
        load_hf_weights(chunks, sd, cfg)
        exported = {n: t for n, t in export_hf(chunks, cfg)}
        expect = {k for k in sd if k != "lm_head.weight"}
        r = dict(names_equal=set(exported) == expect, all_equal=all(torch.equal(exported[k], sd[k]) for k in expect & set(exported)))
        with torch.no_grad():
            values = pipeline_forward(chunks, ids[None], psp, cfg.hidden_size)
        if last:
            err = 0.0
            for i, w in enumerate(where):
                mine = w >= 0
                if mine.any():
                    ref = c["values"][i][mine]
                    err = max(err, ((values[0, w[mine], 0].double() - ref).abs() / ref.abs().clamp(min=1)).max().item())
            r.update(value_err=err)
        res["critic"] = r
    return res


def _grad_export_check(rank, world, parallel, seqs, g):
    """Backward of L = sum w * log p through the model (no DDP: grads in .grad, summed over CP by
    hand as DDP would), then ``export_hf(attr="main_grad")`` vs float64 HF gradients."""
    import torch.distributed as dist
    import transformers
    from megatron.core import parallel_state as ps

    from verl_lite.engine.hf_bridge import export_hf, load_hf_weights
    from verl_lite.engine.model import build_model_chunks, transformer_config_from_hf
    from verl_lite.engine.vocab_parallel import vocab_parallel_log_probs

    cp, cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    cfg = transformers.AutoConfig.from_pretrained(g["path"])
    chunks = build_model_chunks(cfg, transformer_config_from_hf(cfg, parallel))
    load_hf_weights(chunks, g["path"], cfg)
    ids, psp, where = pack(seqs, cp, cp_rank)
    labels, _, _ = pack([torch.cat([s[1:], s.new_zeros(1)]) for s in seqs], cp, cp_rank)
    w_local = torch.zeros(ids.shape[0])
    for w_pos, w in zip(where, g["weights"]):
        for t in range(len(w)):
            if w_pos[t] >= 0:
                w_local[w_pos[t]] = float(w[t])
    logits = chunks[0](ids[None], None, None, packed_seq_params=psp)
    (vocab_parallel_log_probs(logits[0], labels) * w_local).sum().backward()
    if cp > 1:
        for p in chunks[0].parameters():
            dist.all_reduce(p.grad, group=ps.get_context_parallel_group())
    diff2 = ref2 = 0.0
    worst = 0.0
    for name, t in export_hf(chunks, cfg, attr="main_grad"):
        ref = g["grads"][name]
        d = (t.double() - ref).norm().item()
        diff2, ref2 = diff2 + d**2, ref2 + ref.norm().item() ** 2
        worst = max(worst, d / max(ref.norm().item(), 1e-12))
    return dict(global_rel=(diff2 / ref2) ** 0.5, worst_tensor_rel=worst)


def _bridge_error_check(rank, parallel, models):
    """load_hf_weights names the missing tensor / the shape mismatch."""
    import transformers
    from safetensors.torch import load_file

    from verl_lite.engine.hf_bridge import load_hf_weights
    from verl_lite.engine.model import build_model_chunks, transformer_config_from_hf

    path = models[("qwen2", False)]["path"]
    cfg = transformers.AutoConfig.from_pretrained(path)
    chunks = build_model_chunks(cfg, transformer_config_from_hf(cfg, parallel))
    out = {}
    sd = load_file(f"{path}/model.safetensors")
    for case, bad in [
        ("missing", {k: v for k, v in sd.items() if k != "model.layers.1.mlp.up_proj.weight"}),
        ("shape", {**sd, "model.layers.0.self_attn.o_proj.weight": sd["model.layers.0.self_attn.o_proj.weight"][:, :-2]}),
    ]:
        try:
            load_hf_weights(chunks, bad, cfg)
            out[case] = "no error"
        except (KeyError, ValueError) as e:
            out[case] = str(e)
    return out


def _vocab_parallel_check(rank):
    """vocab_parallel_entropy (float64) and vocab_parallel_log_probs (float32: megatron's cross
    entropy computes in float32) values and gradients vs float64 autograd on the full vocabulary."""
    from megatron.core import parallel_state as ps

    from verl_lite.engine.vocab_parallel import vocab_parallel_entropy, vocab_parallel_log_probs

    tp, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    gen = torch.Generator().manual_seed(7)
    full = torch.randn(3, 5, 12, generator=gen, dtype=torch.float64) * 3
    labels = torch.randint(0, 12, (3, 5), generator=gen)
    w_lp, w_ent = torch.randn(3, 5, generator=gen, dtype=torch.float64), torch.randn(3, 5, generator=gen, dtype=torch.float64)

    def reference(kind):
        x = full.clone().requires_grad_()
        lsm = x.log_softmax(-1)
        y = lsm.gather(-1, labels[..., None])[..., 0] if kind == "lp" else -(lsm.exp() * lsm).sum(-1)
        (y * (w_lp if kind == "lp" else w_ent)).sum().backward()
        return y.detach(), x.grad.chunk(tp, dim=-1)[r]

    out = {}
    ref_ent, ref_ent_grad = reference("ent")
    local = full.chunk(tp, dim=-1)[r].clone().requires_grad_()
    ent = vocab_parallel_entropy(local)
    (ent * w_ent).sum().backward()
    out.update(ent_err=(ent - ref_ent).abs().max().item(), ent_grad_err=(local.grad - ref_ent_grad).abs().max().item())

    ref_lp, ref_lp_grad = reference("lp")
    local = full.chunk(tp, dim=-1)[r].float().requires_grad_()
    before = local.detach().clone()
    lp = vocab_parallel_log_probs(local, labels)
    (lp * w_lp.float()).sum().backward()
    out.update(
        lp_err=(lp.double() - ref_lp).abs().max().item(),
        lp_grad_err=(local.grad.double() - ref_lp_grad).abs().max().item(),
        input_untouched=torch.equal(local.detach(), before),
    )
    return out


def _cp_attention_check(rank):
    """Zig-zag CP attention: local outputs and q/K/V gradients vs the dense float64 reference."""
    from megatron.core import parallel_state as ps
    from megatron.core.packed_seq_params import PackedSeqParams

    cp, r = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
    gen = torch.Generator().manual_seed(11)
    lengths = [5, 12, 1, 9, 16]
    padded = [n + (-n) % (2 * cp) for n in lengths]
    bounds = [0]
    for n in padded:
        bounds.append(bounds[-1] + n)
    t, n_heads, n_kv, hn = bounds[-1], 4, 2, 8
    q = torch.randn(t, n_heads, hn, generator=gen, dtype=torch.float64)
    k = torch.randn(t, n_kv, hn, generator=gen, dtype=torch.float64)
    v = torch.randn(t, n_kv, hn, generator=gen, dtype=torch.float64)
    w = torch.randn(t, n_heads * hn, generator=gen, dtype=torch.float64)
    ref = [x.clone().requires_grad_() for x in (q, k, v)]
    ref_out = dense_causal_attention(*ref, bounds, hn**-0.5)
    (ref_out * w).sum().backward()
    rows = torch.cat([zigzag_split(torch.arange(a, b), cp, r) for a, b in zip(bounds[:-1], bounds[1:])])
    local = [x[rows].clone().requires_grad_() for x in (q, k, v)]
    cu = torch.tensor(bounds, dtype=torch.int32)
    psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(padded), max_seqlen_kv=max(padded))
    out = attention_module(hn, ps.get_context_parallel_group())(*local, None, attn_mask_type=None, attention_bias=None, packed_seq_params=psp)
    (out * w[rows]).sum().backward()
    return dict(
        out_err=(out - ref_out[rows]).abs().max().item(),
        q_grad_err=(local[0].grad - ref[0].grad[rows]).abs().max().item(),
        k_grad_err=(local[1].grad - ref[1].grad[rows]).abs().max().item(),
        v_grad_err=(local[2].grad - ref[2].grad[rows]).abs().max().item(),
    )


def _timeout_check(rank, world):
    """For each of megatron's TP/PP/DP/CP groups built with timeout_s=2: rank 0 all-reduces, the
    peer never joins; rank 0 must get an error (not a hang) after about the timeout."""
    import time

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from verl_lite.engine.config import MegatronConfig

    cases = [
        ("tp", dict(tp=2), ps.get_tensor_model_parallel_group),
        ("pp", dict(pp=2), ps.get_pipeline_model_parallel_group),
        ("dp", dict(), ps.get_data_parallel_group),
        ("cp", dict(cp=2), ps.get_context_parallel_group),
    ]
    def backend_timeout(group):
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()

    # every group megatron created holds the configured timeout; the default group the launch's
    use_layout(rank, world, MegatronConfig.layout(timeout_s=2.0, tp=2))
    configured = {"default": backend_timeout(dist.distributed_c10d._get_default_group())}
    for attr, value in vars(ps).items():
        if isinstance(value, dist.ProcessGroup):
            configured[attr] = backend_timeout(value)
    out = {"configured": configured}
    for name, kw, get_group in cases:
        use_layout(rank, world, MegatronConfig.layout(timeout_s=2.0, **kw))
        if rank == 0:
            t0 = time.time()
            try:
                dist.all_reduce(torch.ones(1), group=get_group())
                out[name] = dict(raised=False, elapsed=time.time() - t0)
            except Exception as e:  # noqa: BLE001 - any error is the point; the message is reported
                out[name] = dict(raised=True, elapsed=time.time() - t0, message=str(e)[:200])
        dist.barrier()  # default group (long timeout): the peer waits here for rank 0
    return out


def _run(rank, world, layouts, seqs, models, extra):
    import time

    from verl_lite.engine.config import MegatronConfig

    out = {"layouts": {}}
    for name, kw, which, vh in layouts:
        t0 = time.time()
        parallel = MegatronConfig.layout(timeout_s=120.0, **kw)
        out["layouts"][name] = _check_layout(rank, world, parallel, seqs, models, which, vh)
        if name in extra.get("grads", ()):
            out.setdefault("grads", {})[name] = _grad_export_check(rank, world, parallel, seqs, models["grads"])
        if name in extra.get("bridge_errors", ()):
            out["bridge_errors"] = _bridge_error_check(rank, parallel, models)
        if name in extra.get("vocab", ()):
            out.setdefault("vocab", {})[name] = _vocab_parallel_check(rank)
        if name in extra.get("cp_attention", ()):
            out.setdefault("cp_attention", {})[name] = _cp_attention_check(rank)
        if rank == 0:
            print(f"layout {name}: {time.time() - t0:.1f}s", flush=True)
    if extra.get("timeouts"):
        out["timeouts"] = _timeout_check(rank, world)
    return out


ONE_PER_ARCH = [("qwen2", False), ("qwen3", True), ("llama", False)]
ALL_ARCHS = ARCHS + [("llama3rope", False)]
# (name, MegatronConfig.layout kwargs, models ("all" or a list), also check the value-head model)
LAYOUTS_2 = [
    ("tp1_dp2", dict(), ONE_PER_ARCH + [("llama3rope", False)], False),
    ("tp2", dict(tp=2), "all", True),
    ("tp2_sp", dict(tp=2, sequence_parallel=True), [("qwen3", True)], True),
    ("pp2", dict(pp=2), "all", True),
    ("pp2_vpp2", dict(pp=2, vpp=2), "all", False),
    ("cp2", dict(cp=2), ONE_PER_ARCH, True),
]
EXTRA_2 = dict(bridge_errors=("tp2",), vocab=("tp2",), cp_attention=("cp2",), grads=("tp1_dp2", "tp2", "cp2"), timeouts=True)

LAYOUTS_4 = [
    ("tp2_pp2", dict(tp=2, pp=2), "all", True),
    ("pp2_vpp2_tp2", dict(tp=2, pp=2, vpp=2), [("qwen2", True)], False),
    ("tp2_sp_pp2", dict(tp=2, pp=2, sequence_parallel=True), [("qwen3", True)], True),
    ("pp4", dict(pp=4), [("llama", True)], False),
    ("cp4", dict(cp=4), [("qwen3", False)], False),
    ("cp2_tp2_sp", dict(cp=2, tp=2, sequence_parallel=True), [("qwen2", False)], True),
]
EXTRA_4 = dict(vocab=("tp2_pp2",), cp_attention=("cp4", "cp2_tp2_sp"), grads=("cp4",))


def _print_worst(results, world):
    worst = {}
    for res in results:
        for per_model in res["layouts"].values():
            for r in per_model.values():
                for k in ("lp_err", "ent_err", "value_err"):
                    if k in r:
                        worst[k] = max(worst.get(k, 0.0), r[k])
        for group in ("vocab", "cp_attention", "grads"):
            for r in res.get(group, {}).values():
                for k, v in r.items():
                    if isinstance(v, float):
                        worst[f"{group}.{k}"] = max(worst.get(f"{group}.{k}", 0.0), v)
    print(f"\n{world} ranks, worst errors:", {k: f"{v:.1e}" for k, v in sorted(worst.items())})


@pytest.fixture(scope="module")
def two_ranks(models):
    seqs, m = models
    results = spawn_ranks(_run, 2, LAYOUTS_2, seqs, m, EXTRA_2)
    _print_worst(results, 2)
    return results


@pytest.fixture(scope="module")
def four_ranks(models):
    seqs, m = models
    results = spawn_ranks(_run, 4, LAYOUTS_4, seqs, m, EXTRA_4)
    _print_worst(results, 4)
    return results


def _launch(request, name):
    return request.getfixturevalue("two_ranks" if any(n == name for n, *_ in LAYOUTS_2) else "four_ranks")


ALL_LAYOUTS = [n for n, *_ in LAYOUTS_2 + LAYOUTS_4]


@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_export_is_bit_exact(request, layout):
    for rank, res in enumerate(_launch(request, layout)):
        for model, r in res["layouts"][layout].items():
            assert r["names_equal"], f"rank {rank} {model}: exported names differ from the checkpoint"
            assert r["all_equal"], f"rank {rank} {model}: exported tensors are not bit-identical"


@pytest.mark.parametrize("layout", ALL_LAYOUTS)
def test_log_probs_and_entropy_match_hf(request, layout):
    compared = 0
    for rank, res in enumerate(_launch(request, layout)):
        for model, r in res["layouts"][layout].items():
            if "lp_err" in r:
                compared += 1
                assert r["lp_err"] < LOGP_TOL, f"rank {rank} {model}: log-prob error {r['lp_err']:.2e}"
                assert r["ent_err"] < ENT_TOL, f"rank {rank} {model}: entropy error {r['ent_err']:.2e}"
    assert compared, "no rank compared log-probs"


@pytest.mark.parametrize("layout", [n for n, *_, vh in LAYOUTS_2 + LAYOUTS_4 if vh])
def test_value_head_matches_reference(request, layout):
    compared = 0
    for rank, res in enumerate(_launch(request, layout)):
        r = res["layouts"][layout]["critic"]
        assert r["names_equal"] and r["all_equal"], f"rank {rank}: value-model export round trip failed"
        if "value_err" in r:
            compared += 1
            assert r["value_err"] < VALUE_RTOL, f"rank {rank}: value error {r['value_err']:.2e}"
    assert compared


@pytest.mark.parametrize("layout", ["tp2", "tp2_pp2"])
def test_vocab_parallel_values_and_grads(request, layout):
    for rank, res in enumerate(_launch(request, layout)):
        r = res["vocab"][layout]
        assert r["input_untouched"], f"rank {rank}: logits were modified in place"
        for k in ("ent_err", "ent_grad_err"):  # float64 in, float64 math
            assert r[k] < 1e-12, f"rank {rank}: {k}={r[k]:.2e}"
        for k in ("lp_err", "lp_grad_err"):  # megatron's cross entropy is float32
            assert r[k] < 1e-5, f"rank {rank}: {k}={r[k]:.2e}"


@pytest.mark.parametrize("layout", ["cp2", "cp4", "cp2_tp2_sp"])
def test_cp_attention_outputs_and_kv_grads(request, layout):
    for rank, res in enumerate(_launch(request, layout)):
        r = res["cp_attention"][layout]
        for k, err in r.items():
            assert err < 1e-12, f"rank {rank}: {k}={err:.2e}"


@pytest.mark.parametrize("layout", ["tp1_dp2", "tp2", "cp2", "cp4"])
def test_gradient_export_matches_hf_gradients(request, layout):
    for rank, res in enumerate(_launch(request, layout)):
        r = res["grads"][layout]
        assert r["global_rel"] < 1e-5, f"rank {rank}: |g - g_hf| / |g_hf| = {r['global_rel']:.2e}"
        assert r["worst_tensor_rel"] < 1e-4, f"rank {rank}: worst tensor rel error {r['worst_tensor_rel']:.2e}"


def test_load_errors_name_the_problem(two_ranks):
    for res in two_ranks:
        errors = res["bridge_errors"]
        assert "model.layers.1.mlp.up_proj.weight" in errors["missing"]
        assert "shape mismatch" in errors["shape"] and "linear_proj" in errors["shape"]


def test_every_group_carries_the_configured_timeout(two_ranks):
    for rank, res in enumerate(two_ranks):
        configured = dict(res["timeouts"]["configured"])
        assert configured.pop("default") == 120.0, f"rank {rank}: default group timeout"
        assert len(configured) >= 6, f"rank {rank}: found only {sorted(configured)}"
        wrong = {k: v for k, v in configured.items() if v != 2.0}
        assert not wrong, f"rank {rank}: groups without the configured 2 s timeout: {wrong}"


def test_every_group_wait_is_bounded(two_ranks):
    for name, r in two_ranks[0]["timeouts"].items():
        if name == "configured":
            continue
        assert r["raised"], f"{name} group: a collective with a missing peer returned instead of failing"
        assert 1.0 <= r["elapsed"] < 30.0, f"{name} group: failed after {r['elapsed']:.1f}s, timeout was 2s"
