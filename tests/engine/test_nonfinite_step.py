"""A non-finite optimizer step stops on every rank: ``NonFiniteStepError`` from ``train_step``.

One 2-process launch, two layouts:

- PP2: step 1 is finite; at step 2 the last stage's loss is finite (0) but its gradient is inf
  (d sqrt(x)/dx at x = 0). The first stage never sees a loss, yet both stages raise, naming
  optimizer step 2: megatron's gradient norm is reduced over the pipeline.
- DP2: only rank 1's loss is NaN. After DDP's all-reduce both ranks hold the NaN gradient and
  both raise; neither waits in a collective the other skipped (Contract 2).
"""

from __future__ import annotations

import math
import pickle

import torch

from tests.engine.conftest import spawn_ranks, use_layout


def _good_loss(outputs, data):
    m = data["response_mask"]
    return -(outputs["log_probs"] * m).sum() / 10.0, {}


def _inf_grad_loss(outputs, data):
    """Value 0 (finite), gradient inf: sqrt at 0 of a term that is 0 by construction."""
    lp = outputs["log_probs"] * data["response_mask"]
    return torch.sqrt(lp - lp.detach()).sum(), {}


def _nan_loss(outputs, data):
    return _good_loss(outputs, data)[0] * float("nan"), {}


def _attempt(fn) -> dict:
    from verl_lite.engine.engine import NonFiniteStepError

    try:
        return {"result": fn()}
    except NonFiniteStepError as e:
        again = pickle.loads(pickle.dumps(e))  # what Ray ships to the driver
        return {"error": str(again), "step": again.optimizer_step, "grad_norm": again.grad_norm, "loss": again.loss}


def _ranks(rank, world_size, model_dir):
    from verl_lite.engine import MegatronEngine, SequenceBatch
    from verl_lite.engine.config import EngineConfig, MegatronConfig, OptimConfig

    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(1, 64, (n,), generator=g) for n in (7, 9)]
    batch = SequenceBatch(ids, torch.tensor([3, 4]), {"response_mask": torch.ones(2, 4)})
    out = {}
    pp2 = MegatronConfig.layout(pp=2, timeout_s=60)
    use_layout(rank, world_size, pp2)
    engine = MegatronEngine(EngineConfig(model_dir, pp2, OptimConfig(lr=1e-3)))
    out["pp_good"] = _attempt(lambda: engine.train_step(batch, [[0], [1]], _good_loss))
    out["pp_inf_grad"] = _attempt(lambda: engine.train_step(batch, [[0], [1]], _inf_grad_loss))
    out["pp_owner"] = engine.is_output_owner
    dp2 = MegatronConfig.layout(timeout_s=60)
    use_layout(rank, world_size, dp2)
    engine = MegatronEngine(EngineConfig(model_dir, dp2, OptimConfig(lr=1e-3)))
    out["dp_nan_on_rank1"] = _attempt(lambda: engine.train_step(batch, [[0, 1]], _nan_loss if rank == 1 else _good_loss))
    return out


def test_non_finite_step_raises_on_every_rank(tmp_path):
    from verl_lite.utils.tiny_model import make_tiny_hf_model

    model = make_tiny_hf_model(tmp_path / "m", vocab_size=64, hidden_size=32, num_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, intermediate_size=64, seed=0)
    ranks = spawn_ranks(_ranks, 2, str(model))
    for r in ranks:
        assert math.isfinite(r["pp_good"]["result"]["grad_norm"]), r["pp_good"]
        bad = r["pp_inf_grad"]
        assert "error" in bad, f"a step with an inf gradient was accepted: {bad}"
        assert bad["step"] == 2 and not math.isfinite(bad["grad_norm"]), bad
        assert "optimizer step 2: the gradient norm is" in bad["error"] and "not finite" in bad["error"]
        nan = r["dp_nan_on_rank1"]
        assert "error" in nan and nan["step"] == 1 and math.isnan(nan["grad_norm"]), nan
    owner = next(r for r in ranks if r["pp_owner"])
    stage0 = next(r for r in ranks if not r["pp_owner"])
    assert owner["pp_inf_grad"]["loss"] == 0.0, "the loss itself was finite: only the gradient overflowed"
    assert stage0["pp_inf_grad"]["loss"] is None  # the first stage holds no loss and still raised
    assert math.isnan(ranks[1]["dp_nan_on_rank1"]["loss"]) and math.isfinite(ranks[0]["dp_nan_on_rank1"]["loss"])
