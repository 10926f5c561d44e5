"""Batch-invariant engines (``EngineConfig.batch_invariant_length``; engine/batch_invariant.py).

The property: a token's outputs do not depend on what else is in the batch. Checked bit for bit (``torch.equal``),
at 2 intra-op threads (the kernels' thread splits included), on models with widths that are no multiple of any
SIMD width (vocabulary 100 padded to 128, MLP width 172, hidden 48), in float32 and bfloat16, dense, with LoRA
adapters, and MoE:
- ``infer``'s log-probs and entropy of every sequence are the same packed with all others in one micro-batch, alone,
  and in reversed order over two micro-batches of other sizes;
- ``next_token_logits`` of every prefix of a sequence, then ``token_log_probs`` at the token that follows: bit for
  bit ``infer``'s log-prob of that token in the whole sequence's forward (what a generator sampling from these
  logits reports is what the trainer computes), in one forward or cut into micro-batches of a token budget;
- a ``train_step`` in the mode moves the weights as the standard engine's does (the blocks change the rounding
  only: over two steps, losses within 1e-6 and gradient norms within 1e-5 relative of the same steps without it);
- a sequence longer than the attention's fixed length is one clear error; TP/PP/CP > 1 are refused at config time.
The standard engine (no mode) is reported for contrast (on this machine it differs across packings).
"""

from __future__ import annotations

import pytest
import torch

from verl_lite.engine.config import EngineConfig, MegatronConfig

from .conftest import spawn_ranks

LENGTHS, RESPONSES = [9, 23, 5, 17, 30, 12], [4, 9, 2, 6, 11, 5]
FIXED = 40  # the attention's key length


def _sequences(vocab: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=gen) for n in LENGTHS]


def _engine(model_dir, invariant: bool, dtype="float32", lora_rank: int = 0, forward_only: bool = True):
    from verl_lite.engine import MegatronEngine
    from verl_lite.engine.config import LoraConfig, OptimConfig

    par = MegatronConfig.layout(timeout_s=120.0, dtype=dtype)
    lora = LoraConfig(rank=lora_rank, alpha=16.0) if lora_rank else None
    return MegatronEngine(EngineConfig(model_dir, par, None if forward_only else OptimConfig(lr=1e-3, clip_grad=1e9),
                                       lora=lora, forward_only=forward_only,
                                       batch_invariant_length=FIXED if invariant else 0))


def _packings(engine, seqs) -> list[dict]:
    """infer's outputs under three packings, rows in the sequences' order."""
    from verl_lite.engine import SequenceBatch

    batch = SequenceBatch(seqs, torch.tensor(RESPONSES))
    n = len(seqs)
    plans = [[list(range(n))], [[i] for i in range(n)], [list(range(n - 1, 1, -1)), [1, 0]]]
    return [engine.infer(batch, plan) for plan in plans]


def _differences(runs: list[dict]) -> int:
    return sum(int((run[k] != runs[0][k]).sum()) for run in runs[1:] for k in runs[0])


def _case(rank, world, model_dir, dtype, lora_rank, moe) -> dict:
    torch.set_num_threads(2)
    from .conftest import use_layout

    use_layout(rank, world, MegatronConfig.layout(timeout_s=120.0, dtype=dtype))
    out = {}
    standard = _engine(model_dir, False, dtype, lora_rank)
    vocab = standard.hf_config.vocab_size
    seqs = _sequences(vocab)
    out["standard_differences"] = _differences(_packings(standard, seqs))
    del standard
    engine = _engine(model_dir, True, dtype, lora_rank)
    runs = _packings(engine, seqs)
    out["invariant_differences"] = _differences(runs)
    # every response token of two sequences, generated position by position
    generated, reported = [], []
    for i in (1, 4):
        n, r = LENGTHS[i], RESPONSES[i]
        prefixes = [seqs[i][:p].tolist() for p in range(n - r, n)]
        logits = engine.next_token_logits(prefixes, temperature=0.7)
        split = engine.next_token_logits(prefixes, temperature=0.7, max_tokens=2 * n)  # several micro-batches
        out.setdefault("split_differences", 0)
        out["split_differences"] += int((split != logits).sum())
        generated.append(engine.token_log_probs(logits, seqs[i][n - r:]))
        from verl_lite.engine import SequenceBatch

        whole = engine.infer(SequenceBatch([seqs[j] for j in range(len(seqs))], torch.tensor(RESPONSES)),
                             [list(range(len(seqs)))], temperature=0.7, outputs=("log_probs",))
        reported.append(whole["log_probs"][i, :r])
    out["generated"], out["reported"] = generated, reported
    if not moe:
        with pytest.raises(ValueError, match="longer than the batch-invariant"):
            engine.next_token_logits([list(range(3, 3 + FIXED + 1))], temperature=1.0)
    return out


def _train_case(rank, world, model_dir) -> dict:
    torch.set_num_threads(2)
    from verl_lite.engine import SequenceBatch

    from .conftest import use_layout

    use_layout(rank, world, MegatronConfig.layout(timeout_s=120.0))
    results = {}
    for invariant in (False, True):
        torch.manual_seed(0)
        engine = _engine(model_dir, invariant, forward_only=False)
        seqs = _sequences(engine.hf_config.vocab_size, seed=1)
        weights = torch.linspace(-1.0, 1.0, len(seqs) * max(RESPONSES)).reshape(len(seqs), -1)
        batch = SequenceBatch(seqs, torch.tensor(RESPONSES), {"weights": weights})

        def loss(outputs, data):
            return -(outputs["log_probs"] * data["weights"][:, : outputs["log_probs"].shape[1]]).sum() / 50, {}

        steps = [engine.train_step(batch, [[0, 1, 2], [3, 4, 5]], loss) for _ in range(2)]
        results[invariant] = [(s["loss"], s["grad_norm"]) for s in steps]
    return results


CASES = {"fp32": ("float32", 0, False), "bf16": ("bfloat16", 0, False), "lora": ("float32", 4, False),
         "moe": ("float32", 0, True)}


def _all_cases(rank, world, models) -> dict:
    """Every case in one launched process (one start-up for all)."""
    return {name: _case(rank, world, models["moe" if moe else "dense"], dtype, lora_rank, moe)
            for name, (dtype, lora_rank, moe) in CASES.items()} | {"train": _train_case(rank, world, models["dense"])}


@pytest.fixture(scope="module")
def results(models):
    (out,) = spawn_ranks(_all_cases, 1, models, timeout_s=300)
    return out


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from verl_lite.utils.tiny_model import make_tiny_hf_model, make_tiny_moe_model

    root = tmp_path_factory.mktemp("bi")
    dense = make_tiny_hf_model(root / "dense", vocab_size=100, hidden_size=48, num_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, intermediate_size=172)
    moe = make_tiny_moe_model(root / "moe")
    return {"dense": str(dense), "moe": str(moe)}


@pytest.mark.parametrize("case", list(CASES))
def test_a_token_s_outputs_do_not_depend_on_its_batch(results, case):
    out = results[case]
    print(f"standard engine: {out['standard_differences']} output values differ across packings")
    assert out["invariant_differences"] == 0
    assert out["split_differences"] == 0
    for generated, reported in zip(out["generated"], out["reported"]):
        assert torch.equal(generated, reported), (generated - reported).abs().max()


def test_training_in_the_mode_takes_the_standard_step(results):
    for (loss_std, norm_std), (loss_bi, norm_bi) in zip(results["train"][False], results["train"][True]):
        assert loss_bi == pytest.approx(loss_std, abs=1e-6)  # terms of ~0.1 whose weights sum to about 0
        assert norm_bi == pytest.approx(norm_std, rel=1e-5)


def test_layouts_that_sum_across_ranks_are_refused(models):
    for layout in (dict(tp=2), dict(pp=2), dict(cp=2)):
        with pytest.raises(ValueError, match="TP = PP = CP = 1"):
            EngineConfig(models["dense"], MegatronConfig.layout(**layout), forward_only=True, optim=None,
                         batch_invariant_length=FIXED)


def test_the_mode_keeps_every_call_s_meaning():
    """Calls the blocks cannot serve unchanged pass through: a tensor exponent, an in-place activation, ``out=``, a
    full-size bias; the ones it serves give what they give outside the mode (reductions to rounding)."""
    import torch.nn.functional as F

    from verl_lite.engine.batch_invariant import BatchInvariantMode

    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(200, 8, generator=gen), torch.rand(200, 8, generator=gen)
    w, bias = torch.randn(4, 8, generator=gen), torch.randn(200, 4, generator=gen)
    with BatchInvariantMode():
        power = torch.pow(x.abs(), y)
        inplace = x.clone()
        F.silu(inplace, inplace=True)
        out = torch.empty(0)
        torch.matmul(x, w.t(), out=out)
        added = torch.addmm(bias, x, w.t())
        sums = (x.sum(-1), x.sum(dim=1, keepdim=True), torch.logsumexp(x, -1), torch.softmax(x, dim=-1),
                torch.linalg.vector_norm(x, dim=-1))
    assert torch.equal(power, torch.pow(x.abs(), y)) and torch.equal(inplace, F.silu(x))
    torch.testing.assert_close(out, x @ w.t())
    torch.testing.assert_close(added, bias + x @ w.t())
    for got, want in zip(sums, (x.sum(-1), x.sum(dim=1, keepdim=True), torch.logsumexp(x, -1),
                                torch.softmax(x, dim=-1), torch.linalg.vector_norm(x, dim=-1))):
        assert got.shape == want.shape
        torch.testing.assert_close(got, want)
