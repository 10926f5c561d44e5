"""The hand-written elementwise blocks (``engine/elementwise.py``) and megatron's RoPE routed through one.

Each is checked against autograd on the textbook formula in float64 (values and every gradient), and
where the engine replaces a megatron function, against that function: SwiGLU bit for bit (the same
kernels), RMSNorm and RoPE to float32 rounding, RoPE in float64 to 1e-12 on megatron's own packed-THD
path (positions restarting at every sequence boundary).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from verl_lite.engine.elementwise import rms_norm, rotary, swiglu


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _grads(fn, inputs, grad_out):
    leaves = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
    out = fn(*leaves)
    out.backward(grad_out.to(out.dtype))
    return out.detach(), [x.grad for x in leaves if x.requires_grad]


def _rms_norm_reference(x, weight, eps):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.bfloat16, 1.5e-2)])
def test_rms_norm_matches_float64_autograd(dtype, tol):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 2, 64, generator=g) * 3).to(dtype).requires_grad_()
    weight = (1 + 0.2 * torch.randn(64, generator=g)).to(dtype).requires_grad_()
    grad_out = torch.randn(37, 2, 64, generator=g)
    out, (dx, dw) = _grads(lambda a, w: rms_norm(a, w, 1e-6), [x, weight], grad_out)
    ref, (rdx, rdw) = _grads(lambda a, w: _rms_norm_reference(a, w, 1e-6), [x.double(), weight.double()], grad_out)
    assert out.dtype == dtype and dx.dtype == dtype and dw.dtype == dtype
    for mine, theirs in ((out, ref), (dx, rdx), (dw, rdw)):
        assert _rel(mine, theirs) < tol


def test_rms_norm_without_weight_gradient():
    x = torch.randn(5, 8, requires_grad=True)
    weight = torch.ones(8)
    rms_norm(x, weight, 1e-6).sum().backward()
    _, (rdx,) = _grads(lambda a: _rms_norm_reference(a, weight.double(), 1e-6), [x.double()], torch.ones(5, 8))
    assert _rel(x.grad, rdx) < 2e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_is_autograds_silu_times_up_bit_for_bit(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(23, 1, 2 * 48, generator=g).to(dtype)
    grad_out = torch.randn(23, 1, 48, generator=g)
    out, (dx,) = _grads(swiglu, [x.requires_grad_()], grad_out)

    def unfused(y):
        gate, up = torch.chunk(y, 2, dim=-1)
        return F.silu(gate) * up

    ref, (rdx,) = _grads(unfused, [x], grad_out)
    assert torch.equal(out, ref) and torch.equal(dx, rdx)
    ref64, (rdx64,) = _grads(unfused, [x.double()], grad_out)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert _rel(out, ref64) < tol and _rel(dx, rdx64) < tol


def _rotate_half_reference(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def test_rotary_matches_float64_autograd():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(31, 3, 4, 16, generator=g, requires_grad=True)
    angles = torch.rand(31, 1, 1, 16, generator=g) * 6
    grad_out = torch.randn(31, 3, 4, 16, generator=g)
    out, (dx,) = _grads(lambda a: rotary(a, angles.cos(), angles.sin()), [x], grad_out)
    ref, (rdx,) = _grads(lambda a: _rotate_half_reference(a, angles.double().cos(), angles.double().sin()),
                         [x.double()], grad_out)
    assert _rel(out, ref) < 1e-6 and _rel(dx, rdx) < 1e-6


def _megatron_rope_config():
    return SimpleNamespace(apply_rope_fusion=False, rotary_interleaved=False, multi_latent_attention=False)


class _Group:  # what megatron's RoPE reads of a CP group
    def __init__(self, size: int):
        self._size = size

    def size(self):
        return self._size

    def rank(self):
        return 0


def _freqs(max_len: int, dim: int, dtype=torch.float32):
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    angles = torch.outer(torch.arange(max_len, dtype=torch.float64), inv)
    return torch.cat([angles, angles], dim=-1)[:, None, None, :].to(dtype)


@pytest.mark.parametrize("layout", ["thd", "bshd"])
def test_megatron_rope_routed_through_rotary_equals_megatrons(layout):
    import megatron.core.transformer.attention as attention_module
    from megatron.core.models.common.embeddings import rope_utils

    from verl_lite.compat import megatron_internals

    megatron_internals.use_rotary_kernel(rotary)
    megatron_internals.use_rotary_kernel(rotary)  # idempotent: one wrapper, not two
    routed = attention_module.apply_rotary_pos_emb
    assert routed.verl_lite_rotary and routed is not rope_utils.apply_rotary_pos_emb

    g = torch.Generator().manual_seed(3)
    lengths = [5, 1, 9, 12, 3]
    if layout == "thd":
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        x = torch.randn(int(cu[-1]), 4, 16, generator=g)
        kwargs = dict(cu_seqlens=cu, cp_group=_Group(1))
    else:
        x = torch.randn(12, 2, 4, 16, generator=g)
        kwargs = dict(cp_group=_Group(1))
    grad_out = torch.randn(x.shape, generator=g)
    cfg = _megatron_rope_config()
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-6)):
        freqs = _freqs(16 if layout == "thd" else x.shape[0], 16, dtype)  # bshd: one row per position
        mine, (dx,) = _grads(lambda a: routed(a, freqs, cfg, **kwargs), [x.to(dtype).requires_grad_()], grad_out)
        theirs, (rdx,) = _grads(lambda a: rope_utils.apply_rotary_pos_emb(a, freqs.double(), cfg, **kwargs),
                                [x.double().requires_grad_()], grad_out)
        assert mine.dtype == dtype
        assert _rel(mine, theirs) < tol and _rel(dx, rdx) < tol


def test_megatron_rope_other_cases_stay_megatrons():
    """CP > 1 (zig-zag positions) and per-row frequencies (megatron's case 1) take megatron's function."""
    import megatron.core.transformer.attention as attention_module
    from megatron.core.models.common.embeddings import rope_utils

    from verl_lite.compat import megatron_internals

    megatron_internals.use_rotary_kernel(rotary)
    cfg = _megatron_rope_config()
    g = torch.Generator().manual_seed(4)
    cu = torch.tensor([0, 8, 16], dtype=torch.int32)
    x = torch.randn(8, 2, 16, generator=g)  # a CP rank's half of two 8-token sequences
    for freqs, group in ((_freqs(32, 16), _Group(2)), (_freqs(8, 16), _Group(1))):
        rows = x if group.size() == 2 else x[:8]
        cu_here = cu if group.size() == 2 else torch.tensor([0, 3, 8], dtype=torch.int32)
        routed = attention_module.apply_rotary_pos_emb(rows, freqs, cfg, cu_seqlens=cu_here, cp_group=group)
        direct = rope_utils.apply_rotary_pos_emb(rows, freqs, cfg, cu_seqlens=cu_here, cp_group=group)
        assert torch.equal(routed, direct)


def _built_mlps(rank, world, model_dir):
    import transformers
    from megatron.core.transformer.mlp import MLP

    from verl_lite.engine import speed_paths
    from verl_lite.engine.mlp import SwiGLUMLP
    from verl_lite.engine.model import build_model_chunks, transformer_config_from_hf
    from verl_lite.engine.config import MegatronConfig

    speed_paths.cpu_speed_paths = lambda: True  # the CPU's paths, also on a machine with CUDA

    from .conftest import use_layout

    parallel = MegatronConfig.layout()
    use_layout(rank, world, parallel)
    cfg = transformers.AutoConfig.from_pretrained(model_dir)
    [chunk] = build_model_chunks(cfg, transformer_config_from_hf(cfg, parallel))
    mlps = [m for m in chunk.modules() if isinstance(m, MLP)]
    x = torch.randn(7, 1, cfg.hidden_size, generator=torch.Generator().manual_seed(5), requires_grad=True)
    same = []
    for mlp in mlps:
        ours, _ = mlp(x)
        (dx_ours,) = torch.autograd.grad(ours.sum(), x)
        theirs, _ = MLP.forward(mlp, x)  # megatron's own forward on the same module
        (dx_theirs,) = torch.autograd.grad(theirs.sum(), x)
        same.append(torch.equal(ours, theirs) and torch.equal(dx_ours, dx_theirs))
    return [type(m) is SwiGLUMLP for m in mlps], same


def test_built_models_run_the_swiglu_mlp_with_megatrons_results(tmp_path):
    """``build_model_chunks`` makes every dense MLP a ``SwiGLUMLP`` (megatron's spec builds ``MLP``, with its
    TP group); its output and input gradient equal megatron's own MLP forward bit for bit."""
    from verl_lite.utils.tiny_model import make_tiny_hf_model

    from .conftest import spawn_ranks

    model_dir = make_tiny_hf_model(tmp_path / "m", "qwen2", hidden_size=32, num_layers=2, intermediate_size=48)
    [(swiglu_classes, same)] = spawn_ranks(_built_mlps, 1, str(model_dir))
    assert swiglu_classes == [True, True] and same == [True, True]
