"""LoRA on the engine, against peft (an independent implementation) and against itself.

One launch of two processes at TP=2 (the adapters' factors are split over TP there) runs:
- an adapter saved by peft, loaded through ``lora.adapter_path``: the engine's log-probs equal
  peft's model (float64) within 1e-5;
- one optimizer step, then the HF export: ``model.safetensors`` (merged) loaded by transformers and
  ``lora_adapter/`` loaded by ``peft.PeftModel.from_pretrained`` onto the HF base both give the engine's
  log-probs within 1e-5 (fp32);
- the adapters switched off give the base model: log-probs equal a separately built forward-only
  base engine, and the KL of the trained actor against either differs by at most 1e-6;
- the optimizer holds Adam state for the adapters only (2 moments x adapter elements), the base has
  no gradient buffer;
- a checkpoint after step 1 resumes bit-exactly: step 2 from the checkpoint equals step 2 in place;
- bf16: the base stays bit-identical to its bf16 load, the adapters move.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import pytest
import torch

from tests.engine.conftest import spawn_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parity"))
import harness as H  # noqa: E402

pytest.importorskip("peft")


def _lora(adapter_dir):
    from verl_lite.engine.config import LoraConfig

    return LoraConfig(rank=H.LORA_RANK, alpha=H.LORA_ALPHA, dropout=0.0, target_modules=H.LORA_TARGETS,
                      exclude_modules=(), adapter_path=str(adapter_dir))


def _engine(prob, adapter_dir, par, **kw):
    from verl_lite.engine.engine import MegatronEngine
    lora = kw.pop("lora", _lora(adapter_dir))
    return MegatronEngine(H.engine_config(prob, par, False, lora=lora, **kw))


def _step(engine, prob, data_all, lengths):
    from verl_lite.algorithms.aggregation import NormalizationPlan
    from verl_lite.algorithms.objective import actor_loss

    plan = H._plan(lengths, 1, "three", 1)
    _, batch, mbs = H.rank_share(prob, data_all, plan, 0)
    nplan = NormalizationPlan.from_mask(prob["mask"], "token-mean")
    return engine.train_step(batch, mbs, partial(actor_loss, plan=nplan, cfg=H.loss_cfg("vanilla", "token-mean")),
                             temperature=H.TEMPERATURE, global_token_count=sum(lengths))


def _log_probs(engine, prob, data_all, lengths):
    _, batch, mbs = H.rank_share(prob, data_all, H._plan(lengths, 1, "three", 1), 0)
    out = engine.infer(batch, mbs, temperature=H.TEMPERATURE, outputs=("log_probs",))
    return None if out is None else out["log_probs"]


def _optimizer_state_elements(engine) -> int:
    n = 0
    for opt in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]):
        for state in opt.optimizer.state.values():
            n += sum(v.numel() for k, v in state.items() if torch.is_tensor(v) and v.ndim > 0)
    return n


def _body(rank, world, problem_path, refs_path, out_dir):
    import torch.distributed as dist

    from verl_lite.engine.checkpoint import save_hf_pretrained
    from verl_lite.engine.lora import is_adapter_name
    from verl_lite.engine.model import unwrap_model
    from verl_lite.engine.config import MegatronConfig
    from tests.engine.conftest import use_layout

    par = MegatronConfig.layout(tp=2)
    use_layout(rank, world, par)
    prob, refs, lengths, data_all = H.load_problem(problem_path, refs_path)
    adapter = refs["lora_dir"]
    res = {}
    engine = _engine(prob, adapter, par)
    res["lp_start"] = _log_probs(engine, prob, data_all, lengths)
    base = _engine(prob, adapter, par, forward_only=True, lora=None)
    res["lp_base"] = _log_probs(base, prob, data_all, lengths)
    del base

    # optimizer and buffers: adapters only
    adapter_numel = sum(p.numel() for c in engine.chunks for n, p in unwrap_model(c).named_parameters() if is_adapter_name(n))
    res["adapter_numel"] = adapter_numel
    res["grad_buffer_numel"] = sum(b.numel_unpadded for m in engine.model for b in m.buffers)
    res["base_requires_grad"] = [n for c in engine.chunks for n, p in unwrap_model(c).named_parameters()
                                 if p.requires_grad and not is_adapter_name(n)]

    _step(engine, prob, data_all, lengths)
    res["opt_state_numel"] = _optimizer_state_elements(engine)  # Adam's state exists after the first step
    res["lp_trained"] = _log_probs(engine, prob, data_all, lengths)
    with engine.adapters_disabled():
        res["lp_disabled"] = _log_probs(engine, prob, data_all, lengths)
    save_hf_pretrained(engine, engine.hf_config, Path(out_dir) / "hf")

    # checkpoint after step 1; step 2 in place vs step 2 after loading it into a fresh engine
    engine.save_checkpoint(Path(out_dir) / "ckpt")
    _step(engine, prob, data_all, lengths)
    in_place = engine.export_adapter()
    fresh = _engine(prob, adapter, par)
    fresh.load_checkpoint(Path(out_dir) / "ckpt")
    _step(fresh, prob, data_all, lengths)
    resumed = fresh.export_adapter()
    res["resume_bit_exact"] = all(torch.equal(in_place[k], resumed[k]) for k in in_place) and in_place.keys() == resumed.keys()
    del fresh, engine

    # bf16: the frozen base keeps its bf16 load, the adapters train
    eng16 = _engine(prob, adapter, par, megatron={"dtype": "bfloat16"})
    before = {n: p.detach().clone() for c in eng16.chunks for n, p in unwrap_model(c).named_parameters()}
    _step(eng16, prob, data_all, lengths)
    after = {n: p.detach() for c in eng16.chunks for n, p in unwrap_model(c).named_parameters()}
    res["bf16_base_changed"] = [n for n in before if not is_adapter_name(n) and not torch.equal(before[n], after[n])]
    res["bf16_adapters_moved"] = all(not torch.equal(before[n], after[n]) for n in before if is_adapter_name(n))
    dist.barrier()
    return res


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    problem_path = H.make_problem(root)
    refs_path = H.make_references(root, problem_path)
    out = root / "out"
    results = spawn_ranks(_body, 2, str(problem_path), str(refs_path), str(out), timeout_s=300)
    return torch.load(problem_path), torch.load(refs_path), out, results[0]


def _peft_log_probs(model, prob) -> torch.Tensor:
    with torch.no_grad():
        return H.reference_outputs(model, prob)[0]


def _masked_max(a, b, prob) -> float:
    valid = torch.zeros_like(prob["mask"], dtype=torch.bool)
    for i, r in enumerate(prob["resp_lens"].tolist()):
        valid[i, :r] = True
    return float((a.double() - b.double()).abs()[valid].max())


def test_peft_adapter_loads_through_adapter_path(lora_run):
    prob, refs, _, res = lora_run
    ref = _peft_log_probs(H.peft_model(prob["model_dir"], refs["lora_dir"]), prob)
    assert _masked_max(res["lp_start"], ref, prob) < 1e-5


def test_exported_merged_model_and_peft_adapter_give_the_engines_log_probs(lora_run):
    import peft
    import transformers

    prob, _, out, res = lora_run
    merged = transformers.AutoModelForCausalLM.from_pretrained(out / "hf", dtype=torch.float64)
    assert _masked_max(_peft_log_probs(merged, prob), res["lp_trained"], prob) < 1e-5
    assert {p.name for p in (out / "hf" / "lora_adapter").iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    base = transformers.AutoModelForCausalLM.from_pretrained(prob["model_dir"], dtype=torch.float64)
    with_adapter = peft.PeftModel.from_pretrained(base, str(out / "hf" / "lora_adapter"))
    assert _masked_max(_peft_log_probs(with_adapter, prob), res["lp_trained"], prob) < 1e-5
    assert _masked_max(res["lp_trained"], res["lp_start"], prob) > 1e-4  # the step changed the policy


def test_adapters_off_is_the_base_model_and_its_kl(lora_run):
    from verl_lite.algorithms.kl import kl_penalty

    prob, _, _, res = lora_run
    assert _masked_max(res["lp_disabled"], res["lp_base"], prob) < 1e-6
    mask = prob["mask"]
    for kind in ("kl", "low_var_kl"):
        a = kl_penalty(res["lp_trained"], res["lp_disabled"], kind) * mask
        b = kl_penalty(res["lp_trained"], res["lp_base"], kind) * mask
        assert float((a - b).abs().max()) <= 1e-6 and float(a.abs().max()) > 1e-4, kind


def test_optimizer_and_buffers_hold_the_adapters_only(lora_run):
    *_, res = lora_run
    assert res["base_requires_grad"] == []
    assert res["grad_buffer_numel"] == res["adapter_numel"] > 0
    assert res["opt_state_numel"] == 2 * res["adapter_numel"]  # Adam's two moments, nothing for the base


def test_checkpoint_resumes_bit_exactly(lora_run):
    assert lora_run[3]["resume_bit_exact"]


def test_bf16_trains_the_adapters_only(lora_run):
    res = lora_run[3]
    assert res["bf16_base_changed"] == [] and res["bf16_adapters_moved"]
