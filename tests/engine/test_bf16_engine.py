"""bf16 mixed precision in the engine: what it builds, what it exports, and that checkpoints resume.

One 2-process launch (DP2, distributed optimizer: the fp32 main params are sharded over DP, the
hardest case for loading and exporting them) runs every multi-process check; the parity of the
gradient itself is tests/parity/test_bf16_parity.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .conftest import spawn_ranks


def _model(root: Path) -> Path:
    from verl_lite.utils.tiny_model import make_tiny_hf_model

    return make_tiny_hf_model(root / "model", "qwen2", vocab_size=64, hidden_size=32, num_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                              tie_word_embeddings=False, seed=5, init_std=0.15)


def _batch(rank: int):
    from verl_lite.engine.engine import SequenceBatch

    g = torch.Generator().manual_seed(100 + rank)
    lengths, resp = [7, 9, 5, 8], [3, 4, 2, 5]
    ids = [torch.randint(1, 64, (n,), generator=g) for n in lengths]
    mask = torch.zeros(4, 5)
    for i, r in enumerate(resp):
        mask[i, :r] = 1
    return SequenceBatch(ids, resp, {"mask": mask}, response_width=5)


def _loss(outputs, data):
    return -(outputs["log_probs"] * data["mask"]).sum() / 28.0, {}


def _engine(model_dir, dtype, forward_only=False):
    from verl_lite.engine.config import EngineConfig, MegatronConfig, OptimConfig
    from verl_lite.engine.engine import MegatronEngine

    return MegatronEngine(EngineConfig(model_path=str(model_dir), forward_only=forward_only, optim=OptimConfig(lr=1e-2),
                                       megatron=MegatronConfig(dtype=dtype, use_distributed_optimizer=True)))


def _export(engine) -> dict:
    return {n: t.detach().cpu().clone() for n, t in engine.export_hf()}


def _checks(rank, world, model_dir, ckpt_dir, hf_dir):
    from safetensors.torch import load_file

    from verl_lite.engine.checkpoint import CheckpointLayoutError, save_hf_pretrained

    out = {}
    source = load_file(str(Path(model_dir) / "model.safetensors"))
    batch, mbs = _batch(rank), [[0, 1], [2, 3]]

    fp32 = _engine(model_dir, "float32")
    out["fp32_wrapped"] = type(fp32.model[0].module).__name__  # DDP around the GPTModel itself
    out["fp32_param_dtypes"] = sorted({str(p.dtype) for c in fp32.chunks for p in c.parameters()})
    fp32_lp = fp32.infer(batch, mbs)

    bf16 = _engine(model_dir, "bfloat16")
    out["bf16_wrapped"] = type(bf16.model[0].module).__name__
    out["bf16_param_dtypes"] = sorted({str(p.dtype) for c in bf16.chunks for p in c.parameters()})
    loaded = _export(bf16)
    out["load_exact"] = all(torch.equal(loaded[n], source[n]) for n in source) and set(loaded) == set(source)
    out["export_dtypes"] = sorted({str(t.dtype) for t in loaded.values()})
    bf16_lp = bf16.infer(batch, mbs)
    if bf16_lp is not None:
        m = batch.data["mask"] != 0
        out["lp_dtype"] = str(bf16_lp["log_probs"].dtype)
        out["lp_vs_fp32"] = float((bf16_lp["log_probs"] - fp32_lp["log_probs"]).abs()[m].max())

    # step 1, save, step 2 ...
    bf16.train_step(batch, mbs, _loss)
    bf16.save_checkpoint(ckpt_dir)
    after_1 = _export(bf16)
    step2 = bf16.train_step(batch, mbs, _loss)
    after_2 = _export(bf16)
    out["main_params_not_bf16"] = float(sum(int((t != t.bfloat16().float()).sum()) for t in after_2.values())
                                        / sum(t.numel() for t in after_2.values()))
    save_hf_pretrained(bf16, bf16.hf_config, hf_dir)
    if rank == 0:
        saved = load_file(str(Path(hf_dir) / "model.safetensors"))
        out["hf_dir_equals_export"] = all(torch.equal(saved[n], after_2[n]) for n in after_2)
        out["hf_dir_dtypes"] = sorted({str(t.dtype) for t in saved.values()})

    # ... resume from the checkpoint in a fresh engine: the same step 2, bit for bit
    resumed = _engine(model_dir, "bfloat16")
    resumed.load_checkpoint(ckpt_dir)
    out["resume_params_exact"] = all(torch.equal(t, after_1[n]) for n, t in _export(resumed).items())
    step2_resumed = resumed.train_step(batch, mbs, _loss)
    out["resume_step_exact"] = all(torch.equal(t, after_2[n]) for n, t in _export(resumed).items())
    out["resume_loss"] = (step2.get("loss"), step2_resumed.get("loss"), step2["grad_norm"], step2_resumed["grad_norm"])

    try:  # a dtype change on resume is refused with a message naming it
        _engine(model_dir, "float32").load_checkpoint(ckpt_dir)
        out["dtype_change"] = "loaded"
    except CheckpointLayoutError as err:
        out["dtype_change"] = str(err)

    ref = _engine(model_dir, "bfloat16", forward_only=True)  # the reference: no optimizer, no fp32 copy
    out["ref_export_dtypes"] = sorted({str(t.dtype) for _, t in ref.export_hf()})
    ref_lp = ref.infer(batch, mbs)
    if ref_lp is not None:
        out["ref_equals_bf16_infer"] = torch.equal(ref_lp["log_probs"], bf16_lp["log_probs"])
    return out


@pytest.fixture(scope="module")
def bf16_results(tmp_path_factory):
    if torch.cuda.is_available() and torch.cuda.device_count() < 2:
        pytest.skip("the 2-process checks need 2 GPUs under NCCL (one process per GPU)")
    root = tmp_path_factory.mktemp("bf16_engine")
    model_dir = _model(root)
    return spawn_ranks(_checks, 2, str(model_dir), str(root / "ckpt"), str(root / "hf"))


def test_default_fp32_engine_is_unchanged(bf16_results):
    r = bf16_results[0]
    assert r["fp32_wrapped"] == "GPTModel" and r["fp32_param_dtypes"] == ["torch.float32"]


def test_bf16_engine_builds_megatron_mixed_precision(bf16_results):
    r = bf16_results[0]
    assert r["bf16_wrapped"] == "Float16Module" and r["bf16_param_dtypes"] == ["torch.bfloat16"]
    # HF -> fp32 main params -> HF is bit-exact: the loaded weights are not rounded to bf16
    assert r["load_exact"] and r["export_dtypes"] == ["torch.float32"]
    # log-probs come back in fp32, within bf16 noise of the fp32 engine's (nonzero: it did run in bf16)
    assert r["lp_dtype"] == "torch.float32" and 0 < r["lp_vs_fp32"] < 0.1, r["lp_vs_fp32"]
    # after training the exported weights are the fp32 main params (mostly not bf16-representable)
    assert r["main_params_not_bf16"] > 0.5, r["main_params_not_bf16"]
    assert r["hf_dir_equals_export"] and r["hf_dir_dtypes"] == ["torch.float32"]


def test_bf16_checkpoint_resumes_bit_exact(bf16_results):
    for r in bf16_results:
        assert r["resume_params_exact"], "fp32 main params after load differ from those saved"
        assert r["resume_step_exact"], "the step after a resume differs from the uninterrupted one"
        loss, loss_resumed, norm, norm_resumed = r["resume_loss"]
        assert loss == loss_resumed and norm == norm_resumed


def test_bf16_checkpoint_refuses_a_dtype_change(bf16_results):
    msg = bf16_results[0]["dtype_change"]
    assert "megatron.dtype=bfloat16" in msg and "float32" in msg, msg


def test_bf16_reference_engine_runs_bf16_without_main_params(bf16_results):
    r = bf16_results[0]
    assert r["ref_export_dtypes"] == ["torch.bfloat16"]
    assert r["ref_equals_bf16_infer"], "forward-only bf16 engine computes different log-probs from the trainable one"


def test_engine_config_dtypes():
    from verl_lite.engine.config import EngineConfig, MegatronConfig

    here = str(Path(__file__).resolve().parents[2] / "verl_lite" / "assets")
    model_dir = next(p.parent for p in Path(here).rglob("config.json") if (p.parent / "model.safetensors").exists())
    assert EngineConfig(model_path=str(model_dir), megatron=MegatronConfig(dtype="bf16")).megatron.torch_dtype == torch.bfloat16
    assert EngineConfig(model_path=str(model_dir)).megatron.dtype == "float32"  # the section's default reaches the engine
    with pytest.raises(ValueError, match="loss scaling"):
        EngineConfig(model_path=str(model_dir), megatron=MegatronConfig(dtype="float16"))
    cfg = EngineConfig(model_path=str(model_dir), megatron=MegatronConfig(override_transformer_config={"attention_backend": "unfused"}))
    assert cfg.attention_backend == "sdpa" and "attention_backend" not in cfg.model_overrides
    with pytest.raises(ValueError, match="Transformer Engine"):
        EngineConfig(model_path=str(model_dir), megatron=MegatronConfig(override_transformer_config={"attention_backend": "fused"}))
