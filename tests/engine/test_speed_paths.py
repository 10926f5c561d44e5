"""The CPU speed paths behind one door (``engine/speed_paths.py``).

- The selection, with the device stubbed (no CUDA kernel runs): with CUDA the layer spec builds megatron's norm
  (``WrappedTorchNorm``; ``TENorm`` with Transformer Engine; the engine's under sequence parallelism without it),
  megatron's MLP stays ``MLP``, megatron's RoPE function answers every call but a shared-prompt pack's, and
  short causal attention runs on SDPA; on the CPU the engine's norm, ``SwiGLUMLP``, RoPE and matmul attention.
- Both paths exact: one engine (a tiny Qwen2, one process) built with the speed paths off (megatron's and torch's
  standard paths, run on the CPU) and one with them on give the same log-probs and entropy (plain and
  shared-prompt packs) and the same gradient of a train step over shared-prompt packs, to float32 rounding.
"""

from __future__ import annotations

import types

import torch

from verl_lite.engine import attention, speed_paths
from verl_lite.engine.elementwise import RMSNorm, rotary

from .conftest import spawn_ranks

# (prompt, response length): prompts 0 and 1 are shared by several sequences
PLAN = [(0, 4), (1, 3), (0, 6), (2, 5), (1, 1), (0, 2), (1, 3), (2, 2)]
PROMPT_LENGTHS = (5, 3, 7)


def _spec_norms_and_mlp(monkeypatch, sequence_parallel: bool):
    import megatron.core.transformer.transformer_block as transformer_block

    from verl_lite.engine.model import _block_spec

    monkeypatch.setattr(transformer_block, "get_num_layers_to_build", lambda config, vp_stage=None: 2)
    config = types.SimpleNamespace(qk_layernorm=True, num_moe_experts=None, sequence_parallel=sequence_parallel)
    block = _block_spec(config, None)
    layer = block.layer_specs[0].submodules
    attn = layer.self_attention.submodules
    norms = {block.layer_norm, layer.input_layernorm, layer.pre_mlp_layernorm, attn.q_layernorm, attn.k_layernorm}
    return norms, layer.mlp.module


def _routing_and_mlp_calls(monkeypatch):
    """(the kernel megatron's RoPE is routed through, the MLP classes ``adapt_built_model`` re-classes to)."""
    import megatron.core.transformer.attention as attention_module

    from verl_lite.compat import megatron_internals

    # restored after the test
    monkeypatch.setattr(attention_module, "apply_rotary_pos_emb", attention_module.apply_rotary_pos_emb)
    reclassed = []
    monkeypatch.setattr(megatron_internals, "use_swiglu_mlp", lambda model, cls: reclassed.append(cls))
    speed_paths.route_rotary()
    speed_paths.route_rotary()  # idempotent
    speed_paths.adapt_built_model(torch.nn.Module())
    routed = attention_module.apply_rotary_pos_emb
    assert routed.verl_lite_original.__module__ == "megatron.core.models.common.embeddings.rope_utils"  # one wrapper
    return routed.verl_lite_rotary, reclassed


def _short_attention_kernel(monkeypatch) -> str:
    calls = []
    monkeypatch.setattr(attention, "causal_matmul_attention", lambda *a: calls.append("matmul") or a[0])
    q = torch.randn(1, 4, 8, 16)
    attention._causal_attention(q, q[:, :2], q[:, :2], 0.25)
    return "matmul" if calls else "sdpa"


def test_with_cuda_the_engine_selects_megatrons_own_paths(monkeypatch):
    # megatron is imported before the device is stubbed: its modules read the device when imported
    import megatron.core.transformer.attention as attention_module
    from megatron.core.extensions.transformer_engine import TENorm
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer.mlp import MLP
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    _spec_norms_and_mlp(monkeypatch, sequence_parallel=False)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert not speed_paths.cpu_speed_paths()
    monkeypatch.setattr(speed_paths, "_have_transformer_engine", lambda: False)
    assert _spec_norms_and_mlp(monkeypatch, sequence_parallel=False) == ({WrappedTorchNorm}, MLP)
    assert _spec_norms_and_mlp(monkeypatch, sequence_parallel=True) == ({RMSNorm}, MLP)  # megatron's refuses SP
    monkeypatch.setattr(speed_paths, "_have_transformer_engine", lambda: True)
    assert _spec_norms_and_mlp(monkeypatch, sequence_parallel=True) == ({TENorm}, MLP)
    kernel, reclassed = _routing_and_mlp_calls(monkeypatch)
    assert kernel is None and reclassed == []
    assert _short_attention_kernel(monkeypatch) == "sdpa"
    # the routing answers a plain call with megatron's own function, bit for bit
    config = types.SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=False, multi_latent_attention=False,
                                   mrope_section=None)
    x, freqs = torch.randn(6, 2, 4, 8), torch.randn(6, 1, 1, 8)
    group = types.SimpleNamespace(size=lambda: 1, rank=lambda: 0)
    routed = attention_module.apply_rotary_pos_emb(x, freqs, config, cp_group=group)
    assert torch.equal(routed, rope_utils.apply_rotary_pos_emb(x, freqs, config, cp_group=group))


def test_on_the_cpu_the_engine_selects_its_speed_paths(monkeypatch):
    from megatron.core.transformer.mlp import MLP

    from verl_lite.engine.mlp import SwiGLUMLP

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert speed_paths.cpu_speed_paths()
    assert _spec_norms_and_mlp(monkeypatch, sequence_parallel=True) == ({RMSNorm}, MLP)  # re-classed once built
    kernel, reclassed = _routing_and_mlp_calls(monkeypatch)
    assert kernel is rotary and reclassed == [SwiGLUMLP]
    assert _short_attention_kernel(monkeypatch) == "matmul"


# ------------------------------------------------------------------------------------------
# Both paths exact
# ------------------------------------------------------------------------------------------


def _batch():
    from verl_lite.engine.engine import SequenceBatch

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 64, (n,), generator=g) for n in PROMPT_LENGTHS]
    seqs = [torch.cat([prompts[p], torch.randint(1, 64, (r,), generator=g)]) for p, r in PLAN]
    resp = [r for _, r in PLAN]
    mask = torch.zeros(len(seqs), max(resp))
    for i, r in enumerate(resp):
        mask[i, :r] = 1
    return SequenceBatch(seqs, resp, {"mask": mask}, response_width=max(resp))


def _loss(outputs, data):
    mask = data["mask"]
    return (-(outputs["log_probs"] * mask).sum() + 0.1 * (outputs["entropy"] * mask).sum()) / 20.0, {}


def _built_paths(chunk) -> dict:
    import megatron.core.transformer.attention as attention_module
    from megatron.core.transformer.mlp import MLP

    norms = {type(m).__module__ for name, m in chunk.named_modules()
             if name.endswith("layernorm") and hasattr(m, "weight")}
    mlps = {type(m).__name__ for m in chunk.modules() if isinstance(m, MLP)}
    kernel = getattr(attention_module.apply_rotary_pos_emb, "verl_lite_rotary", None)
    return dict(norms=norms, mlps=mlps, rotary=getattr(kernel, "__name__", None))


def _engine_outputs(rank, world, model_dir):
    from verl_lite.engine.config import EngineConfig, MegatronConfig, OptimConfig
    from verl_lite.engine.engine import MegatronEngine
    from verl_lite.engine.model import unwrap_model

    from .conftest import use_layout

    par = MegatronConfig.layout()
    use_layout(rank, world, par)
    batch, everything = _batch(), [list(range(len(PLAN)))]
    out = {}
    for cpu_paths in (False, True):  # this process has no CUDA: "off" runs megatron's and torch's paths on the CPU
        speed_paths.cpu_speed_paths = lambda on=cpu_paths: on
        engine = MegatronEngine(EngineConfig(model_path=model_dir, megatron=par, optim=OptimConfig(lr=1e-2)))
        result = dict(paths=_built_paths(unwrap_model(engine.chunks[0])))
        for share in (False, True):
            engine.share_prompts = share
            result[f"infer_share_{share}"] = engine.infer(batch, everything)
        engine.train_step(batch, [[0, 1, 2, 3], [4, 5, 6, 7]], _loss)  # both micro-batches share a prompt
        result["grads"] = {n: t.detach().clone() for n, t in engine.export_hf("main_grad")}
        out[cpu_paths] = result
        del engine
    return out


def test_speed_paths_on_and_off_give_the_same_log_probs_and_gradients(tmp_path):
    from verl_lite.utils.tiny_model import make_tiny_hf_model

    model_dir = make_tiny_hf_model(tmp_path / "model", "qwen2", vocab_size=64, hidden_size=32, num_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                                   tie_word_embeddings=False, seed=5, init_std=0.15)
    [out] = spawn_ranks(_engine_outputs, 1, str(model_dir))
    off, on = out[False], out[True]
    assert off["paths"] == dict(norms={"torch.nn.modules.normalization"}, mlps={"MLP"}, rotary=None)
    assert on["paths"] == dict(norms={"verl_lite.engine.elementwise"}, mlps={"SwiGLUMLP"}, rotary="rotary")
    for share in (False, True):
        for name in ("log_probs", "entropy"):
            torch.testing.assert_close(on[f"infer_share_{share}"][name], off[f"infer_share_{share}"][name],
                                       rtol=0, atol=1e-5)
    assert on["grads"].keys() == off["grads"].keys()
    num = sum(float((on["grads"][n] - off["grads"][n]).norm() ** 2) for n in off["grads"]) ** 0.5
    den = sum(float(off["grads"][n].norm() ** 2) for n in off["grads"]) ** 0.5
    assert den > 0 and num / den < 1e-5, num / den
