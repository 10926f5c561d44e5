"""bf16 mixed precision computes the gradient one float64 process would, up to bf16 rounding, in
every layout, and scales the loss exactly as fp32 does.

Engine under test: ``megatron.dtype="bfloat16"`` = megatron's ``Float16Module`` (bf16
weights and activations, fp32 logits) + DDP with fp32 gradient accumulation/reduction + megatron's
mixed-precision optimizer (fp32 main parameters). Problem, reference and planning: ``harness.py``
(tiny Qwen2, 4 blocks, ragged batch with a fully masked row, float64 HF reference without megatron).
The behaviour log-probs keep every token a margin away from the clip boundaries
(``clip_safe_noise``), so a bf16 rounding cannot flip a clip decision and the objective is smooth
in the rounded values (the fp32 matrix in test_parity.py covers tokens on every boundary).

Cells: layouts {1 process, DP2, TP2, PP2, CP2, DP2 + distributed optimizer} x losses {vanilla, GSPO}
x modes {token-mean, seq-mean-token-mean} x calculate_per_token_loss {off, on}, three micro-batches;
one launch per layout. Per cell:

1. gradient vs float64 (after megatron's reduction, clipped as megatron clips): rel <= REF_TOL.
2. loss scaling as in fp32: the gradient's component along the reference gradient,
   alpha = <g, g_ref> / <g_ref, g_ref>, is 1 within SCALE_TOL; and the same against the
   single-process bf16 gradient. A missing 1/DP, 1/CP or 1/M factor makes |alpha - 1| >= 0.5.
3. multi-process vs single-process bf16 gradient: rel <= LAYOUT_TOL where the split does not
   change any bf16 rounding of a sequence's forward (DP, PP: only the fp32 accumulation order of
   micro-batch weight gradients changes), rel <= REF_TOL where it does (TP rounds each rank's
   partial sums to bf16 before the all-reduce, CP computes attention over different key blocks):
   two independent roundings of the same computation. The distributed optimizer's step equals the
   regular optimizer's (DP2) within 1e-5.
4. loss and pre-clip grad norm vs the reference within REF_TOL; the exported weights are the fp32
   main parameters: bit-exact HF -> engine -> HF in float32 before the step, and after it the bf16
   model weights are their rounding (relative gap <= 2^-8).

Tolerances. bf16 keeps an 8-bit significand: one round-to-nearest has relative error <= u = 2^-8.
Along the gradient's path the engine rounds R results to bf16: per block about 10 in the forward
(norm, qkv, attention, o_proj, residual, norm, fc1, SwiGLU, fc2, residual) and 10 in the backward,
plus embedding, final norm and head both ways: R = 4 * 20 + 6 = 86. Independent roundings add up
as a random walk, u * sqrt(R) = 0.036; REF_TOL = 2 u sqrt(R) = 0.072 allows for correlation.
Measured worst (rel vs float64, all cells): 0.033 (1 process, DP2, PP2), 0.037 (TP2), 0.031 (CP2).
SCALE_TOL = u / 2 = 2.0e-3: the random-walk error projected on g_ref averages over thousands of
parameters; measured worst |alpha - 1| = 6.7e-4 vs float64, 7.4e-4 vs 1-process bf16 (TP2).
LAYOUT_TOL = 2u = 7.8e-3 (one extra rounding of a weight gradient); measured 2.2e-3 (DP2), 1.4e-7 (PP2).
"""

from __future__ import annotations

import tempfile
import time
from functools import partial
from pathlib import Path

import pytest
import torch

import harness as H

BF16_U = 2.0**-8  # unit roundoff of bfloat16 (8-bit significand)
DEPTH = 4  # transformer blocks of harness.make_problem's model
ROUNDINGS = DEPTH * 20 + 6  # bf16-rounded results along the gradient's path (module docstring)
REF_TOL = 2 * BF16_U * ROUNDINGS**0.5  # 0.072
SCALE_TOL = BF16_U / 2  # 2.0e-3
LAYOUT_TOL = 2 * BF16_U  # 7.8e-3
SAME_ROUNDING = ("dp2", "pp2")  # layouts whose split leaves each sequence's bf16 forward unchanged

BF16_LOSSES = ("vanilla", "gspo")
BF16_MODES = ("token-mean", "seq-mean-token-mean")
BF16_LAYOUTS = {  # name -> (world size, MegatronConfig.layout kwargs, use_distributed_optimizer)
    "single": (1, dict(), False),
    "dp2": (2, dict(), False),
    "tp2": (2, dict(tp=2), False),
    "pp2": (2, dict(pp=2), False),
    "cp2": (2, dict(cp=2), False),
    "dp2_distopt": (2, dict(), True),
}
MEASURED: dict[str, dict[str, float]] = {}


CLIP_MARGIN_NOISE = (0.05, -0.45, -0.05, 0.5, 0.0, -0.6)  # per-sequence log-ratio offsets, cycled
JITTER = 0.04


def clip_safe_noise(mask: torch.Tensor) -> torch.Tensor:
    """old_log_probs - log_probs for the bf16 cells: every token's (and every sequence's mean) log
    ratio lies either inside |x| <= 0.09 (unclipped) or in 0.41 <= |x| <= 0.64 (clipped), never
    within 0.09 of the clip boundaries log(1 - 0.2) = -0.223 / log(1.2) = 0.182 nor near the dual
    clip log 3 = 1.1. bf16 log-probs here are off by <= 0.03, so no clip decision can flip: the
    objective is smooth in the rounded values and the rounding bound below applies. (The fp32
    matrix in test_parity.py puts tokens on both sides of every boundary.)"""
    g = torch.Generator().manual_seed(11)
    base = torch.tensor([CLIP_MARGIN_NOISE[i % len(CLIP_MARGIN_NOISE)] for i in range(mask.shape[0])])
    jitter = (torch.rand(mask.shape, generator=g) * 2 - 1) * JITTER
    return (base[:, None] + jitter).double()


def bf16_cells() -> list[H.Cell]:
    return [H.Cell(lo, mo, pt, "three") for pt in (False, True) for lo in BF16_LOSSES for mo in BF16_MODES]


# ---------------------------------------------------------------------------------- worker
def _worker_body(rank, world, port, layout, problem_path, refs_path, out_dir, timeout_s):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from verl_lite.algorithms.aggregation import NormalizationPlan
    from verl_lite.algorithms.objective import actor_loss
    from verl_lite.engine.distributed import init_distributed
    from verl_lite.engine.config import MegatronConfig
    from verl_lite.engine.engine import MegatronEngine

    t0 = time.perf_counter()
    _, par_kw, distopt = BF16_LAYOUTS[layout]
    par = MegatronConfig.layout(**par_kw, timeout_s=timeout_s)
    init_distributed(rank, world, "127.0.0.1", port, par, seed=1234)
    prob, refs, lengths, data_all = H.load_problem(problem_path, refs_path)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mask = prob["mask"]
    state = {k: v.float() for k, v in refs[(BF16_LOSSES[0], BF16_MODES[0])]["params_before"].items()}
    out: dict = {"cells": {}}
    for per_token in (False, True):
        engine = MegatronEngine(H.engine_config(
            prob, par, distopt, per_token, megatron={"dtype": "bfloat16"}))
        if "export_max_abs" not in out:  # the fp32 main params hold the HF weights exactly
            exported = {n: t.cpu().clone() for n, t in engine.export_hf("param")}
            out["export_dtypes"] = sorted({str(t.dtype) for t in exported.values()})
            out["export_max_abs"] = max(float((exported[n] - state[n]).abs().max()) for n in state)
            out["model_param_dtypes"] = sorted({str(p.dtype) for c in engine.chunks for p in c.parameters()})
        for cell in [c for c in bf16_cells() if c.per_token == per_token]:
            engine.load_hf(state)
            _, batch, mbs = H.rank_share(prob, data_all, H._plan(lengths, dp, cell.mb, 1), dp_rank)
            nplan = NormalizationPlan.from_mask(mask, cell.mode)
            loss_fn = partial(actor_loss, plan=nplan, cfg=H.loss_cfg(cell.loss, cell.mode))
            res = engine.train_step(batch, mbs, loss_fn,
                                    temperature=H.TEMPERATURE, global_token_count=sum(lengths))
            grads = None if distopt else {n: t.float().cpu().clone() for n, t in engine.export_hf("main_grad")}
            params = {n: t.cpu().clone() for n, t in engine.export_hf("param")}
            # the bf16 model weights are the rounding of the fp32 main params after the step
            bf16_gap = 0.0
            model_params = {}
            from verl_lite.engine.hf_bridge import export_hf

            for n, t in export_hf(engine.chunks, engine.hf_config):
                t = t.cpu()
                model_params[n] = t
                bf16_gap = max(bf16_gap, float(((t.float() - params[n]).abs() / params[n].abs().clamp(min=1e-30)).max()))
            losses = [None] * world
            dist.all_gather_object(losses, res.get("loss") if engine.is_output_owner else None)
            if rank == 0:
                out["cells"][cell.key] = {"grads": grads, "params": params, "grad_norm": res["grad_norm"],
                                          "loss": sum(x for x in losses if x is not None), "bf16_gap": bf16_gap}
        del engine
    out["seconds"] = time.perf_counter() - t0
    if rank == 0:
        torch.save(out, Path(out_dir, "result.pt"))
    H.end_job()


def run_bf16_layout(layout: str, problem_path: Path, refs_path: Path, timeout_s: float = 180) -> dict:
    """The layout's bf16 cells in the harness's process pool of its world size; rank 0's results."""
    out_dir = tempfile.mkdtemp(prefix=f"bf16_parity_{layout}_")
    H.run_in_pool(BF16_LAYOUTS[layout][0], f"bf16 layout {layout}", _worker_body,
                  (layout, str(problem_path), str(refs_path), out_dir, timeout_s))
    return torch.load(Path(out_dir, "result.pt"))


def layout_world(name) -> int:
    """The conftest's test order: tests run grouped by the world size of their layout."""
    return H.layout_world(BF16_LAYOUTS, name)


# ---------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="session")
def problem(tmp_path_factory):
    """harness.make_problem + float64 references for the bf16 cells only (old log-probs shared)."""
    root = tmp_path_factory.mktemp("bf16_parity")
    problem_path = H.make_problem(root)
    prob = torch.load(problem_path)
    # one float64 forward: old log-probs = its log-probs + clip_safe_noise, and the four cells' references
    old_lp, refs = H.policy_references(prob, [(lo, mo) for lo in BF16_LOSSES for mo in BF16_MODES],
                                       noise=clip_safe_noise(prob["mask"]))
    refs["old_log_probs"] = old_lp
    refs_path = root / "refs.pt"
    torch.save(refs, refs_path)
    return problem_path, refs_path, refs


_RESULTS: dict[str, dict] = {}


def results(layout: str, problem) -> dict:
    world = BF16_LAYOUTS[layout][0]
    if torch.cuda.is_available() and world > torch.cuda.device_count():
        pytest.skip(f"layout {layout} needs {world} GPUs (one process per GPU under NCCL), "
                    f"{torch.cuda.device_count()} visible")
    if layout not in _RESULTS:  # one launch per layout per session
        _RESULTS[layout] = run_bf16_layout(layout, problem[0], problem[1])
    return _RESULTS[layout]


def scale(a: dict, b: dict) -> float:
    """|<a, b> / <b, b> - 1|: how far ``a`` is from ``b`` along ``b`` (a mis-scaled loss moves it)."""
    num = sum(float((a[k].double() * b[k].double()).sum()) for k in b)
    den = sum(float((b[k].double() ** 2).sum()) for k in b)
    return abs(num / den - 1.0)


def rel(a: dict, b: dict) -> float:
    num = sum(float(((a[k].double() - b[k].double()) ** 2).sum()) for k in b)
    den = sum(float((b[k].double() ** 2).sum()) for k in b)
    return (num / den) ** 0.5


# ---------------------------------------------------------------------------------- tests
def _updates(params: dict, before: dict) -> dict:
    return {k: params[k] - before[k] for k in before}


@pytest.mark.parametrize("layout", list(BF16_LAYOUTS))
def test_bf16_gradient_matches_float64_reference_and_single_process(layout, problem):
    refs = problem[2]
    res = results(layout, problem)
    single = results("single", problem)
    assert sorted(res["cells"]) == sorted(c.key for c in bf16_cells())
    assert res["model_param_dtypes"] == ["torch.bfloat16"], "bf16 engine built non-bf16 model weights"
    assert res["export_dtypes"] == ["torch.float32"], "a trainable bf16 engine exports its fp32 main params"
    assert res["export_max_abs"] == 0.0, "HF -> fp32 main params -> HF is not bit-exact"
    worst: dict[str, float] = {}
    failures = []
    for cell in bf16_cells():
        c, s, ref = res["cells"][cell.key], single["cells"][cell.key], refs[(cell.loss, cell.mode)]
        before = ref["params_before"]
        errs, limits = {}, {}
        errs["loss"] = abs(c["loss"] - ref["loss"]) / max(1.0, abs(ref["loss"]))
        errs["grad_norm"] = abs(c["grad_norm"] - ref["grad_norm"]) / ref["grad_norm"]
        limits.update(loss=REF_TOL, grad_norm=REF_TOL)
        if c["grads"] is not None:
            errs["ref"], limits["ref"] = rel(c["grads"], ref["grads_clipped"]), REF_TOL
            errs["ref_scale"], limits["ref_scale"] = scale(c["grads"], ref["grads_clipped"]), SCALE_TOL
            if layout != "single":
                errs["layout"] = rel(c["grads"], s["grads"])
                limits["layout"] = LAYOUT_TOL if layout in SAME_ROUNDING else REF_TOL
                errs["layout_scale"], limits["layout_scale"] = scale(c["grads"], s["grads"]), SCALE_TOL
        else:  # distributed optimizer: main_grad is per shard; its step must equal DP2's regular one
            dp2 = results("dp2", problem)["cells"][cell.key]
            errs["step_vs_dp2"] = rel(_updates(c["params"], before), _updates(dp2["params"], before))
            limits["step_vs_dp2"] = 1e-5
        errs["bf16_gap"], limits["bf16_gap"] = c["bf16_gap"], BF16_U
        for k, v in errs.items():
            worst[k] = max(worst.get(k, 0.0), v)
        bad = [f"{k} {v:.2e} > {limits[k]:.1e}" for k, v in errs.items() if not v <= limits[k]]
        if bad:
            failures.append(f"{cell.key}: {'; '.join(bad)}")
    MEASURED[layout] = worst
    print(f"bf16 {layout}: worst " + ", ".join(f"{k}={v:.2e}" for k, v in worst.items())
          + f" (REF_TOL={REF_TOL:.3f}, SCALE_TOL={SCALE_TOL:.1e}, LAYOUT_TOL={LAYOUT_TOL:.1e}); {res['seconds']:.1f}s")
    assert not failures, "\n".join(failures)
