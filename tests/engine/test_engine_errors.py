"""Bad input to the engine gets a clear error, raised on every rank (no rank left waiting).

One 2-process launch (PP2 + VPP2, per-token mode) checks: micro-batch count not a multiple of PP
under VPP, an empty micro-batch, rows used twice, a wrong global token count (detected after
megatron's reduction, identically on both ranks, before the optimizer step), that a correct
step still works afterwards, and the LR schedule (warm-up then linear decay). Config validation
is checked in-process.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from verl_lite.engine.config import EngineConfig, MegatronConfig, OptimConfig
from verl_lite.utils.net import free_port as _free_port


def _loss(outputs, data):
    m = data["response_mask"]
    return -(outputs["log_probs"] * m).sum() / 10.0, {"n": m.sum()}


def _rank(rank, port, model_dir, out_dir):
    torch.set_num_threads(1)
    from verl_lite.engine import MegatronEngine, SequenceBatch
    from verl_lite.engine.config import EngineConfig, MegatronConfig, OptimConfig
    from verl_lite.engine.distributed import destroy_distributed, init_distributed

    par = MegatronConfig.layout(pp=2, vpp=2, timeout_s=60)
    init_distributed(rank, 2, "127.0.0.1", port, par)
    engine = MegatronEngine(EngineConfig(model_dir, dataclasses.replace(par, calculate_per_token_loss=True), OptimConfig(lr=1e-3)))
    g = torch.Generator().manual_seed(0)
    lengths = (7, 9, 5, 6)
    ids = [torch.randint(1, 64, (n,), generator=g) for n in lengths]
    batch = SequenceBatch(ids, torch.tensor([3, 4, 2, 1]), {"response_mask": torch.ones(4, 4)})
    outcome = {}

    def attempt(name, fn):
        try:
            fn()
            outcome[name] = None
        except Exception as e:  # noqa: BLE001
            outcome[name] = f"{type(e).__name__}: {e}"

    attempt("three_mbs", lambda: engine.train_step(batch, [[0, 1], [2], [3]], _loss))
    attempt("empty_mb", lambda: engine.train_step(batch, [[0, 1, 2, 3], []], _loss))
    attempt("row_twice", lambda: engine.train_step(batch, [[0, 1], [1, 2, 3]], _loss))
    attempt("bad_count", lambda: engine.train_step(batch, [[0, 1], [2, 3]], _loss, global_token_count=sum(lengths) + 5))
    res = {}
    attempt("good", lambda: res.update(engine.train_step(batch, [[0, 1], [2, 3]], _loss)))
    outcome["good_result"] = res
    outcome["owner"] = engine.is_output_owner
    # LR schedule: warm-up 2 schedule steps to 1e-3, then linear decay to 1e-4 at step 4; the caller advances it
    sched = MegatronEngine(EngineConfig(model_dir, par, OptimConfig(
        lr=1e-3, min_lr=1e-4, lr_warmup_steps=2, lr_decay_style="linear"), total_steps=4))
    outcome["lrs"] = []
    for _ in range(4):
        outcome["lrs"].append([sched.train_step(batch, [[0, 1], [2, 3]], _loss)["lr"] for _ in range(2)])
        sched.advance_lr_schedule()  # after two optimizer steps (an RL step of two mini-batches)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(outcome))
    destroy_distributed()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from verl_lite.utils.tiny_model import make_tiny_hf_model

    return str(make_tiny_hf_model(tmp_path_factory.mktemp("err") / "m", "qwen2", vocab_size=64, hidden_size=32,
                                  num_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                  intermediate_size=64, seed=0))


def test_bad_micro_batches_and_counts_raise_on_every_rank(model_dir, tmp_path):
    from tests.fork_ranks import start_ranks

    start_ranks(_rank, (_free_port(), model_dir, str(tmp_path)), nprocs=2)
    outs = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for o in outs:
        assert "multiple of pp=2" in o["three_mbs"] and "vpp_multiple=2" in o["three_mbs"]
        assert "micro-batch 1 is empty" in o["empty_mb"]
        assert "exactly once" in o["row_twice"]
        assert "megatron reduced 27 tokens" in o["bad_count"] and "not taken" in o["bad_count"]
        assert o["good"] is None
        assert o["good_result"]["grad_norm"] > 0 and o["good_result"]["lr"] == pytest.approx(1e-3)
        assert o["lrs"] == [pytest.approx([lr, lr]) for lr in (0.0, 5e-4, 1e-3, 5.5e-4)]  # verl: 0 first
    owner = [o for o in outs if o["owner"]]
    assert len(owner) == 1 and "loss" in owner[0]["good_result"] and owner[0]["good_result"]["n"] == 16
    assert all("loss" not in o["good_result"] for o in outs if not o["owner"])


def test_config_validation(tmp_path):
    assert OptimConfig(lr=0).problems() == ["optim.lr=0 must be > 0"]
    assert "lr_decay_style" in OptimConfig(lr_decay_style="step").problems()[0]
    assert OptimConfig(lr_decay_style="cosine", lr_warmup_steps=5).problems(total_steps=5) == [
        "optim.lr_warmup_steps=5 must be < total_steps=5 for lr_decay_style='cosine'"]
    assert "min_lr" in OptimConfig(lr=1e-5, min_lr=1e-3).problems()[0]
    assert "clip_grad" in OptimConfig(clip_grad=0).problems()[0]
    with pytest.raises(ValueError, match="no config.json"):
        EngineConfig(model_path=str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="optim.lr=0 must be > 0"):
        EngineConfig(model_path=str(tmp_path), optim=OptimConfig(lr=0))
    with pytest.raises(ValueError, match="lr_warmup_steps=5 must be < total_steps=5"):
        EngineConfig(model_path=str(tmp_path), optim=OptimConfig(lr_decay_style="cosine", lr_warmup_steps=5), total_steps=5)
    with pytest.raises(ValueError, match="megatron.dtype"):
        EngineConfig(model_path=str(tmp_path), megatron=MegatronConfig(dtype="int8"))
    assert EngineConfig(model_path=str(tmp_path)).megatron.tp == 1
