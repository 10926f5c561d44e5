"""Vocabulary padding (``vocab_parallel.padded_vocab_size``) and the TP / KV-head rules on real configs.

In-process: the padding rule's contract for many sizes, bad input, which layouts of the shipped
real configs ``transformer_config_from_hf`` accepts (TP larger than the KV heads where megatron
allows it: KV heads dividing TP) and the HF bridge's shard math at TP3 with a padded vocabulary.

One 2-process launch (TP2, the tiny model with vocab 127, so the engine pads one row):
- ``vocab_parallel_log_probs`` / ``vocab_parallel_entropy`` / ``vocab_parallel_log_probs_at`` (K ids per token, one
  repeated) on logits whose padded column holds +80: values and gradients vs float64 autograd over the true columns
  only, exactly 0 gradient at the padded column, and an out-of-vocabulary label is one clear error;
  ``vocab_parallel_topk``: the top k of the float64 log-softmax (values and ids, largest first), never the padded
  column, and with ``candidates`` only ids below it;
- ``MegatronEngine.infer`` with the padded LM-head row overwritten by large values: log-probs and
  entropies vs the float64 HF model within 1e-5 (the engine passes the true vocabulary);
- ``export_hf`` gives the checkpoint's 127 rows bit for bit (what the HF rollout and the vLLM weight
  sync load), and a training step leaves the padded row untouched (its gradient is 0).
"""

from __future__ import annotations

import math

import pytest
import torch

from .conftest import spawn_ranks
from .test_real_model_configs import CONFIG_DIR

VOCAB = 127


@pytest.mark.parametrize("divisible_by", [1, 128])
def test_padding_rule(divisible_by):
    from verl_lite.engine.vocab_parallel import padded_vocab_size

    for vocab in (1, 127, 128, 151665, 151669, 151936, 152064, 128255, 128256):
        for tp in (1, 2, 3, 4, 6, 7, 8, 16):
            got = padded_vocab_size(vocab, tp, divisible_by)
            assert got % tp == 0 and got % divisible_by == 0, (vocab, tp)  # equal TP slices, megatron's alignment
            assert vocab <= got < vocab + math.lcm(divisible_by, tp), (vocab, tp)  # the least such size
        # every power-of-two TP up to divisible_by builds the same size: checkpoints reshard between them
        sizes = {padded_vocab_size(vocab, tp, divisible_by) for tp in (1, 2, 4, 8, 16, 32, 64, 128) if tp <= divisible_by}
        assert len(sizes) == 1, (vocab, sizes)
    assert padded_vocab_size(50257, 1, 128) == 50304  # megatron's GPT-2 example
    assert padded_vocab_size(151936, 8) == 151936 and padded_vocab_size(151665, 2) == 151680


@pytest.mark.parametrize("args", [(0, 2), (128, 0), (128, 2, 0)])
def test_padding_rule_rejects_bad_input(args):
    from verl_lite.engine.vocab_parallel import padded_vocab_size

    with pytest.raises(ValueError, match="must be >= 1"):
        padded_vocab_size(*args)


@pytest.mark.parametrize(
    "name,tp,vocab,match",
    [
        ("Qwen2.5-1.5B", 4, None, None),  # 2 KV heads < TP4: each KV head on 2 ranks
        ("Qwen2.5-3B", 8, None, None),  # 2 KV heads < TP8
        ("Qwen2.5-0.5B", 2, 151665, None),  # the tokenizer's size: padded, no longer rejected
        ("Qwen3-8B", 16, None, None),  # 8 KV heads divide TP16
        ("Qwen2.5-0.5B", 4, None, "must divide the model's attention heads \\(14\\)"),
        ("Llama-3.2-3B", 6, None, "key/value heads \\(8\\) must divide one another"),
    ],
)
def test_tp_and_kv_head_rules_on_real_configs(name, tp, vocab, match):
    import transformers

    from verl_lite.engine.config import MegatronConfig
    from verl_lite.engine.model import transformer_config_from_hf

    cfg = transformers.AutoConfig.from_pretrained(CONFIG_DIR / name)
    if vocab is not None:
        cfg.vocab_size = vocab
    if match is None:
        tf = transformer_config_from_hf(cfg, MegatronConfig.layout(tp=tp))
        assert tf.num_query_groups == cfg.num_key_value_heads and tf.tensor_model_parallel_size == tp
    else:
        with pytest.raises(ValueError, match=match):
            transformer_config_from_hf(cfg, MegatronConfig.layout(tp=tp))


def test_bridge_pads_on_load_and_strips_on_export_at_tp3():
    from verl_lite.engine.hf_bridge import _Entry, _shard, _unshard

    cfg = {"model_type": "qwen2", "vocab_size": 10}
    full = torch.randn(10, 4)
    entry = _Entry("output_layer.weight", ("lm_head.weight",), "vocab")
    shards = [_shard(entry, [full], cfg, 3, r) for r in range(3)]
    assert [tuple(s.shape) for s in shards] == [(128, 4)] * 3  # Vp = lcm(128, 3) = 384
    assert torch.equal(torch.cat(shards)[:10], full) and (torch.cat(shards)[10:] == 0).all()
    (back,) = _unshard(entry, shards, cfg)
    assert torch.equal(back, full)
    with pytest.raises(ValueError, match="has 9 rows, the config's vocab_size is 10"):
        _shard(entry, [full[:9]], cfg, 3, 0)


# ------------------------------------------------------------------------------------------
# One 2-rank launch
# ------------------------------------------------------------------------------------------

LENGTHS, RESPONSES = [7, 12, 3, 9], [4, 6, 2, 5]


def _vocab_parallel_check(rank):
    """vocab_parallel_* on a padded vocabulary (12 columns, V = 11) vs float64 autograd on 11 columns."""
    from megatron.core import parallel_state as ps

    from verl_lite.engine.vocab_parallel import (vocab_parallel_entropy, vocab_parallel_log_probs,
                                                 vocab_parallel_log_probs_at, vocab_parallel_topk)

    tp, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    gen = torch.Generator().manual_seed(7)
    V = 11
    full = torch.randn(3, 5, 12, generator=gen, dtype=torch.float64) * 3
    full[..., V:] = 80.0  # padded column: would own the softmax if it took part
    labels = torch.randint(0, V, (3, 5), generator=gen)
    labels[0, 0] = V - 1
    ids_at = torch.randint(0, V, (3, 5, 4), generator=gen)
    ids_at[..., 3] = ids_at[..., 0]  # a repeated id: its gradient adds up
    ids_at[1, 2, 1] = V - 1  # an id in the last rank's slice
    weights = {"ent": torch.randn(3, 5, generator=gen, dtype=torch.float64)}
    weights["lp"] = weights["ent"]
    weights["at"] = torch.randn(3, 5, 4, generator=gen, dtype=torch.float64)

    def reference(kind):
        x = full[..., :V].clone().requires_grad_()
        lsm = x.log_softmax(-1)
        y = {"lp": lambda: lsm.gather(-1, labels[..., None])[..., 0], "at": lambda: lsm.gather(-1, ids_at),
             "ent": lambda: -(lsm.exp() * lsm).sum(-1)}[kind]()
        (y * weights[kind]).sum().backward()
        grad = torch.cat([x.grad, torch.zeros_like(full[..., V:])], dim=-1)
        return y.detach(), grad.chunk(tp, dim=-1)[r]

    def forward(kind, local):
        if kind == "ent":
            return vocab_parallel_entropy(local, vocab_size=V)
        if kind == "lp":
            return vocab_parallel_log_probs(local, labels, V)
        return vocab_parallel_log_probs_at(local, ids_at, V)

    out = {}
    for name, kind, dtype in (("ent", "ent", torch.float64), ("lp", "lp", torch.float32), ("at", "at", torch.float32),
                              ("at64", "at", torch.float64)):
        ref, ref_grad = reference(kind)
        local = full.chunk(tp, dim=-1)[r].to(dtype).requires_grad_()
        y = forward(kind, local)
        (y * weights[kind].to(dtype)).sum().backward()
        out[f"{name}_err"] = (y.double() - ref).abs().max().item()
        out[f"{name}_grad_err"] = (local.grad.double() - ref_grad).abs().max().item()
        out[f"{name}_padded_grad_zero"] = bool((local.grad[..., V - r * 6:] == 0).all()) if r == tp - 1 else True
    true_lsm = full[..., :V].log_softmax(-1)
    for name, k, candidates in (("topk", 4, None), ("topk_below", 3, 5)):
        ref_values, ref_ids = true_lsm[..., :candidates].topk(k, dim=-1)
        values, ids = vocab_parallel_topk(full.chunk(tp, dim=-1)[r], k, vocab_size=V, candidates=candidates)
        out[f"{name}_err"] = (values - ref_values).abs().max().item()
        out[f"{name}_ids_equal"] = bool(torch.equal(ids, ref_ids))
    for name, call in (("bad_label", lambda: vocab_parallel_log_probs(full.chunk(tp, dim=-1)[r].float(),
                                                                       torch.full((3, 5), V), V)),
                       ("bad_id", lambda: vocab_parallel_log_probs_at(full.chunk(tp, dim=-1)[r].float(),
                                                                      torch.full((3, 5, 2), V), V)),
                       ("bad_k", lambda: vocab_parallel_topk(full.chunk(tp, dim=-1)[r], V + 1, vocab_size=V))):
        try:
            call()
            out[name] = "no error"
        except ValueError as e:
            out[name] = str(e)
    return out


def _engine_check(rank, model_dir, ref):
    """The engine at TP2 on the 127-token model: infer vs HF, export, a step leaves the padding alone."""
    from megatron.core import parallel_state as ps
    from safetensors.torch import load_file

    from verl_lite.engine import MegatronEngine, SequenceBatch
    from verl_lite.engine.config import EngineConfig, MegatronConfig, OptimConfig
    from verl_lite.engine.model import unwrap_model

    from .conftest import use_layout

    par = MegatronConfig.layout(tp=2, timeout_s=120.0)
    use_layout(rank, 2, par)
    engine = MegatronEngine(EngineConfig(model_dir, par, OptimConfig(lr=1e-2, weight_decay=0.0)))
    head = unwrap_model(engine.chunks[0]).output_layer.weight
    out = {"local_rows": head.shape[0]}
    last = ps.get_tensor_model_parallel_rank() == 1
    with torch.no_grad():
        if last:
            out["padded_zero_after_load"] = bool((head[-1] == 0).all())
            head[-1] = 3.0 * torch.randn(head.shape[1], generator=torch.Generator().manual_seed(1))
        poisoned = head.detach().clone()
    ckpt = load_file(f"{model_dir}/model.safetensors")
    exported = dict(engine.export_hf())
    out["export_shapes"] = {k: tuple(v.shape) for k, v in exported.items() if "embed" in k or "lm_head" in k}
    out["export_equal"] = set(exported) == set(ckpt) and all(torch.equal(exported[k], ckpt[k]) for k in ckpt)
    gen = torch.Generator().manual_seed(3)
    ids = [torch.randint(0, VOCAB, (n,), generator=gen) for n in LENGTHS]
    ids[1][-1] = VOCAB - 1
    batch = SequenceBatch(ids, torch.tensor(RESPONSES), {"mask": torch.ones(len(ids), max(RESPONSES))})
    res = engine.infer(batch, [[0, 1], [2, 3]], outputs=("log_probs", "entropy"))
    if res is not None:
        lp_err = ent_err = 0.0
        for i, n in enumerate(RESPONSES):
            lp_err = max(lp_err, (res["log_probs"][i, :n].double() - ref["log_probs"][i]).abs().max().item())
            ent_err = max(ent_err, (res["entropy"][i, :n].double() - ref["entropy"][i]).abs().max().item())
        out.update(lp_err=lp_err, ent_err=ent_err)

    def loss(outputs, data):
        return -(outputs["log_probs"] * data["mask"]).sum() / 10.0, {}

    engine.train_step(batch, [[0, 1], [2, 3]], loss)
    with torch.no_grad():
        if last:
            out["padded_row_untouched"] = torch.equal(head[-1], poisoned[-1])
        out["real_rows_changed"] = not torch.equal(head[:-1], poisoned[:-1])
    return out


def _run(rank, world, model_dir, ref):
    return dict(vocab=_vocab_parallel_check(rank), engine=_engine_check(rank, model_dir, ref))


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    import transformers

    from verl_lite.utils import make_tiny_hf_model

    path = make_tiny_hf_model(tmp_path_factory.mktemp("v127") / "m", "qwen2", vocab_size=VOCAB, num_layers=2, seed=5)
    hf64 = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    gen = torch.Generator().manual_seed(3)
    ids = [torch.randint(0, VOCAB, (n,), generator=gen) for n in LENGTHS]
    ids[1][-1] = VOCAB - 1
    ref = {"log_probs": [], "entropy": []}
    with torch.no_grad():
        for s, n in zip(ids, RESPONSES):
            lsm = hf64(s[None]).logits[0].log_softmax(-1)[len(s) - n - 1 : len(s) - 1]
            ref["log_probs"].append(lsm.gather(-1, s[len(s) - n :, None])[:, 0])
            ref["entropy"].append(-(lsm.exp() * lsm).sum(-1))
    return spawn_ranks(_run, 2, str(path), ref)


def test_vocab_parallel_ignores_padded_columns(launch):
    for rank, res in enumerate(launch):
        r = res["vocab"]
        assert r["ent_err"] < 1e-12 and r["ent_grad_err"] < 1e-12, (rank, r)  # float64 in, float64 math
        assert r["lp_err"] < 1e-5 and r["lp_grad_err"] < 1e-5, (rank, r)  # megatron's cross entropy is float32
        assert r["at_err"] < 1e-5 and r["at_grad_err"] < 1e-5, (rank, r)  # float32 in
        assert r["at64_err"] < 1e-12 and r["at64_grad_err"] < 1e-12, (rank, r)
        assert all(r[f"{name}_padded_grad_zero"] for name in ("ent", "lp", "at", "at64")), (rank, r)
        assert r["topk_err"] < 1e-12 and r["topk_ids_equal"], (rank, r)
        assert r["topk_below_err"] < 1e-12 and r["topk_below_ids_equal"], (rank, r)
        assert "label 11 is outside the vocabulary (vocab_size=11)" in r["bad_label"], r["bad_label"]
        assert "ids in [11, 11] are outside the vocabulary (vocab_size=11)" in r["bad_id"], r["bad_id"]
        assert "k=12: must be in [1, 11]" in r["bad_k"], r["bad_k"]


def test_engine_log_probs_ignore_the_padded_row(launch):
    compared = 0
    for rank, res in enumerate(launch):
        r = res["engine"]
        assert r["local_rows"] == 64, "vocab 127 at TP2 pads to 128 rows, 64 per rank"
        if rank == 1:
            assert r["padded_zero_after_load"]
        if "lp_err" in r:
            compared += 1
            assert r["lp_err"] < 1e-5 and r["ent_err"] < 1e-5, (rank, r)
    assert compared


def test_export_strips_the_padding_and_training_never_touches_it(launch):
    for rank, res in enumerate(launch):
        r = res["engine"]
        assert r["export_shapes"] == {"model.embed_tokens.weight": (VOCAB, 64), "lm_head.weight": (VOCAB, 64)}
        assert r["export_equal"], f"rank {rank}: the export is not the checkpoint"
        assert r["real_rows_changed"], f"rank {rank}: the training step changed nothing"
        if rank == 1:
            assert r["padded_row_untouched"], "the padded LM-head row changed in a training step"


def _fake_engine(vocab: int, tp: int):
    """What ``checkpoint._describe`` reads from an engine."""
    from types import SimpleNamespace

    hf = SimpleNamespace(model_type="qwen2", vocab_size=vocab, hidden_size=64, num_hidden_layers=2,
                         num_attention_heads=6, num_key_value_heads=6, intermediate_size=96, tie_word_embeddings=False)
    from verl_lite.engine.config import MegatronConfig

    cfg = SimpleNamespace(value_head=False, megatron=MegatronConfig())
    return SimpleNamespace(hf_config=hf, tp=tp, pp=1, vpp=1, cp=1, dp=1, cfg=cfg, optimizer=None, chunks=())


def test_checkpoint_refuses_a_change_of_the_padded_size_and_names_the_tps_that_fit():
    from verl_lite.engine.checkpoint import CheckpointLayoutError, _describe, check_compatible

    saved = _describe(_fake_engine(151665, 2))  # padded to 151680
    assert saved["padded_vocab_size"] == 151680
    for tp in (1, 4, 8):  # power-of-two TPs build the same rows: resharding is allowed
        check_compatible(_fake_engine(151665, tp), saved)
    check_compatible(_fake_engine(151665, 3), saved)  # lcm(128, 3) = 384 divides 151680 too
    with pytest.raises(CheckpointLayoutError, match=r"151680 rows .*tp=2.* builds 152320 \(tp=7\).*tp in \[1, 2, 3, 4"):
        check_compatible(_fake_engine(151665, 7), saved)
