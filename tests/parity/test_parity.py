"""Every layout computes the gradient one process would (Contract 1), proven cell by cell.

Matrix: layouts {1 process, DP2, TP2, PP2, PP2+VPP2, PP4, TP2xPP2, DP2xPP2, DP2xTP2xPP2, CP2, CP4,
CP2xTP2, CP2xPP2, CP2xDP2, DP2xCP2xPP2} (+ DP2 with the distributed optimizer, TP2 with sequence
parallelism) x losses {vanilla PPO, GSPO} x five aggregation modes x calculate_per_token_loss
{off, on} x micro-batching {1, 3, token budget}. One process launch per layout runs all its cells: the
single process and DP2 run the full product; every other matrix layout runs every loss x mode x
per-token cell once, with micro-batching rotated so that each layout runs every mode with each of the
three schemes and each full-product cell runs in a third of the layouts (``harness.cells_for``). The
critic (value head, clipped value loss: five modes x per-token off/on x micro-batching) runs the same way.
On-policy distillation (``harness.DISTILL_LOSSES``: the supervised k3 reverse KL to a teacher's log-probs alone,
k1 as a per-token reward added to vanilla PPO, and the top-k forward KL added to it as a loss, its gradient through
the engine's log-probs at the teacher's top-k ids) runs five modes x per-token off/on with micro-batching rotated
in the single process, DP2, TP2, PP2 and CP2 (``harness.distill_cells``): its gradient does not depend on the
micro-batch split or the layout (verl #7200).

Against a float64 single-process reference WITHOUT megatron (HF transformers on the same weights,
see harness.py), per cell:
- every parameter's gradient after megatron's reduction (``export_hf("main_grad")``, clipped as
  megatron clips) within 1e-5 relative (global norm of the difference / global norm);
- parameters after one AdamW step within 1e-6 relative to their norm, and the update itself
  within 5e-4 relative (Adam's first step g / (|g| + eps) amplifies float32 noise in tiny grads);
- the reported loss (summed over the output owners, one per DP rank) equals the reference L
  and the pre-clip grad norm the reference norm.
LoRA (two cells in every layout, run inside its launch): adapters (rank 4) on all seven
projections, started from a PEFT adapter with random A and B saved by peft; the reference is peft's
LoRA on the HF model in float64. Every A and B gradient, the adapters after the step, the loss and
the grad norm meet the same tolerances; no base parameter trains or holds a gradient, and the
trainable parameters are exactly the adapters.
Every batch has ragged (odd) lengths, so no sequence divides by 2*CP, one fully masked
trajectory, and multi-turn trajectories: 2-3 model segments of different lengths with environment
tokens (mask 0) between them and after the last, so CP's zig-zag split puts holes on every rank and
every denominator must count model tokens only. Each layout's export of the freshly loaded weights is bit-exact (HF -> engine -> HF).
Forward-only log-probs/entropy of each layout are checked against HF (1e-5) and,
at CP2 and CP4, against the single-process engine (1e-6 relative to max(1, |value|)).
"""

from __future__ import annotations

import pytest
import torch

import harness as H

GRAD_TOL = 1e-5
PARAM_TOL = 1e-6
UPDATE_TOL = 5e-4
LOSS_TOL = 1e-5

MATRIX_LAYOUTS = [name for name in H.LAYOUTS if name not in ("dp2_distopt", "tp2_sp")]


def layout_world(name) -> int:
    """The conftest's test order: tests run grouped by the world size of their layout."""
    return H.layout_world(H.LAYOUTS, name)


@pytest.fixture(scope="session")
def problem(tmp_path_factory):
    root = tmp_path_factory.mktemp("parity")
    problem_path = H.make_problem(root)
    refs_path = H.make_references(root, problem_path)
    return problem_path, refs_path


def layout_results(name: str, problem) -> dict:
    if name not in H.RESULTS:  # one launch per layout per session, shared by the tests below
        H.RESULTS[name] = H.run_layout(name, H.cells_for(name), *problem)
    return H.RESULTS[name]


def _check_cells(res: dict, check_grads: bool = True):
    failures = []
    for key, c in res["cells"].items():
        problems = []
        if check_grads:
            if c["grad_missing"]:
                problems.append(f"grads missing {c['grad_missing'][:3]}")
            if not c["grad_rel"] < GRAD_TOL:
                problems.append(f"grad rel {c['grad_rel']:.2e}")
        if c["param_missing"]:
            problems.append(f"params missing {c['param_missing'][:3]}")
        if not c["param_rel"] < PARAM_TOL:
            problems.append(f"param rel {c['param_rel']:.2e}")
        if not c["update_rel"] < UPDATE_TOL:
            problems.append(f"update rel {c['update_rel']:.2e}")
        if not abs(c["loss"] - c["ref_loss"]) <= LOSS_TOL * max(1.0, abs(c["ref_loss"])):
            problems.append(f"loss {c['loss']:.8g} vs ref {c['ref_loss']:.8g}")
        if not abs(c["grad_norm"] - c["ref_grad_norm"]) <= GRAD_TOL * c["ref_grad_norm"]:
            problems.append(f"grad_norm {c['grad_norm']:.8g} vs ref {c['ref_grad_norm']:.8g}")
        if "base_with_grad" in c:  # LoRA: the frozen base trains nothing, the adapters are all that trains
            if c["base_with_grad"]:
                problems.append(f"base parameters with a gradient {c['base_with_grad'][:3]}")
            if not c["trainable_is_adapter"]:
                problems.append("trainable parameters other than the adapters")
        if problems:
            failures.append(f"{key}: {'; '.join(problems)}")
    assert not failures, f"{len(failures)}/{len(res['cells'])} cells differ from the reference:\n" + "\n".join(failures)


@pytest.mark.parametrize("layout", MATRIX_LAYOUTS)
def test_layout_matches_single_process_reference(layout, problem):
    res = layout_results(layout, problem)
    cells = H.cells_for(layout)
    assert sorted(res["cells"]) == sorted(c.key for c in cells)
    assert {c.mb for c in cells} == set(H.MB_SCHEMES)
    _check_cells(res)
    inf = res["infer"]
    assert inf["lp_err"] < 1e-5 and inf["ent_err"] < 1e-5, {k: v for k, v in inf.items() if k.endswith("err")}
    assert res["export_max_abs"] == 0.0, "HF -> engine -> HF export is not bit-exact"
    assert inf["values_err"] < 1e-5, inf["values_err"]
    assert res["critic_export_max_abs"] == 0.0, "HF -> engine -> HF export of the critic is not bit-exact"


def test_every_matrix_layout_covers_every_loss_mode_and_micro_batching():
    full = {c.key for c in H.all_cells()}
    critic = {c.key for c in H.critic_cells()}
    lora = {c.key for c in H.lora_cells()}
    assert len(full) == 2 * 5 * 2 * 3 and len(critic) == 5 * 2 * 3 and len(lora) == 2
    runs = {}
    for layout in MATRIX_LAYOUTS:
        cells = H.cells_for(layout)
        keys = {c.key for c in cells if c.loss not in H.DISTILL_LOSSES}
        assert lora <= keys and keys <= full | critic | lora, layout
        if layout in H.FULL_PRODUCT_LAYOUTS:
            assert keys == full | critic | lora, layout
        policy = [c for c in cells if c.loss in H.LOSSES]
        # every (loss, mode, per-token) exactly once or (full product) once per scheme
        combos = [(c.loss, c.mode, c.per_token) for c in policy]
        assert set(combos) == {(lo, mo, pt) for lo in H.LOSSES for mo in H.MODES for pt in (False, True)}, layout
        for mode in H.MODES:  # every mode meets every micro-batching scheme in every layout
            assert {c.mb for c in policy if c.mode == mode} == set(H.MB_SCHEMES), (layout, mode)
        assert {(c.mode, c.per_token) for c in cells if c.loss == "critic"} == \
            {(mo, pt) for mo in H.MODES for pt in (False, True)}, layout
        for key in keys:
            runs[key] = runs.get(key, 0) + 1
    # every full-product cell runs in the two full layouts and in at least 4 of the others
    assert min(runs[k] for k in full | critic) >= 2 + 4, sorted(runs.items(), key=lambda kv: kv[1])[:3]
    for layout in ("dp2_distopt", "tp2_sp"):
        assert lora <= {c.key for c in H.cells_for(layout)}, layout


def test_distillation_runs_every_mode_per_token_mode_and_micro_batching_in_dp_tp_pp_cp():
    """The distillation cells: every (loss, mode, per-token) once in each of the single process, DP2, TP2, PP2
    and CP2; every mode meets every micro-batching scheme in each; none elsewhere (the suite's time budget)."""
    assert {"dp2", "tp2", "pp2", "cp2"} <= set(H.DISTILL_LAYOUTS) <= set(MATRIX_LAYOUTS)
    for layout in MATRIX_LAYOUTS:
        distill = [c for c in H.cells_for(layout) if c.loss in H.DISTILL_LOSSES]
        if layout not in H.DISTILL_LAYOUTS:
            assert not distill, layout
            continue
        combos = [(c.loss, c.mode, c.per_token) for c in distill]
        assert sorted(combos) == sorted((lo, mo, pt) for lo in H.DISTILL_LOSSES for mo in H.MODES
                                        for pt in (False, True)), layout
        for mode in H.MODES:
            assert {c.mb for c in distill if c.mode == mode} == set(H.MB_SCHEMES), (layout, mode)


@pytest.mark.parity_layouts("dp2_distopt")
def test_distributed_optimizer_step_matches(problem):
    res = layout_results("dp2_distopt", problem)
    _check_cells(res, check_grads=False)


@pytest.mark.parity_layouts("tp2_sp")
def test_sequence_parallel_matches(problem):
    res = layout_results("tp2_sp", problem)
    _check_cells(res)


@pytest.mark.parametrize("cp_layout", ["cp2", "cp4"])
def test_cp_log_probs_and_entropy_equal_cp1(cp_layout, problem):
    base = layout_results("single", problem)["infer"]
    other = layout_results(cp_layout, problem)["infer"]
    for key in ("log_probs", "entropy"):
        a, b = torch.tensor(base[key]), torch.tensor(other[key])
        # 1e-6 relative to max(1, |value|): |log p| ~ 5 here, where one float32 ulp is 4.8e-7
        err = ((a - b).abs() / a.abs().clamp(min=1.0)).max()
        assert err <= 1e-6, f"{key}: CP1 vs {cp_layout} max rel diff {err:.2e}, abs {(a - b).abs().max():.2e}"
