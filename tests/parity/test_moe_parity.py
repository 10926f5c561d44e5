"""Mixture-of-experts layouts compute the gradient one float64 process would (Contract 1 + the
router-loss objective of ``verl_lite/engine/moe.py``), cell by cell.

Matrix: MoE layouts {EP2, EP2xTP2 (ETP1, sequence parallel), EP2xPP2, EP2xDP2, DP2xCP2xPP2 with EP2
(8 processes)} x losses {vanilla PPO, GSPO} x five aggregation modes x calculate_per_token_loss
{off, on} x micro-batching {1, 3, token budget}, on a tiny Qwen3-MoE (4 experts, top-2, 2 layers)
with moe_aux_loss_coeff and moe_z_loss_coeff > 0. One process launch per layout runs all its cells.

The reference uses no megatron: HF transformers' Qwen3-MoE in float64 on the same weights
(``output_router_logits=True``), the policy objective of ``algorithms.objective.actor_loss`` over the
whole mini-batch, plus the router objective R written out independently below from the router
logits of one sequence at a time. Per cell: every gradient (experts and router included) within
1e-5 relative, the parameters after one AdamW step, the reported policy loss (summed over the output
owners) and the reported router loss R (the same on every rank) equal the reference. Each layout's
export of freshly loaded weights is bit-exact (HF -> engine -> HF). A Qwen2-MoE (shared expert +
sigmoid gate, no top-k renormalisation) runs a slice of the matrix under EP2xTP2.

LoRA on the experts (two cells in EP2xTP2, router losses on): adapters on q/k/v/o and on gate/up/down of
every routed expert (random A and B); the reference is the float64 HF model with peft's LoRA on the
attention and the experts' adapters written out (``_lora_experts_forward``). Every A and B gradient (the
experts' also on their own), the factors after the step, the policy and router losses and the grad norm
meet the tolerances above; no base parameter trains or holds a gradient.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import asdict
from functools import partial
from pathlib import Path

import pytest
import torch

import harness as H

GRAD_TOL = 1e-5
PARAM_TOL = 1e-6
UPDATE_TOL = 5e-4
LOSS_TOL = 1e-5
AUX_COEFF = 0.02
Z_COEFF = 0.001
N_EXPERT_FACTORS = 2 * 4 * 3 * 2  # layers x experts x (gate, up, down) x (A, B) of the tiny Qwen3-MoE

# name -> (world size, MegatronConfig.layout kwargs, model arch)
MOE_LAYOUTS = {
    "moe_single": (1, dict(), "qwen3_moe"),
    "moe_ep2": (2, dict(ep=2), "qwen3_moe"),
    "moe_ep2_tp2": (4, dict(tp=2, sequence_parallel=True, ep=2, etp=1), "qwen3_moe"),
    "moe_ep2_pp2": (4, dict(pp=2, ep=2), "qwen3_moe"),
    "moe_ep2_dp2": (4, dict(ep=2), "qwen3_moe"),
    "moe_ep2_dp2_cp2_pp2": (8, dict(cp=2, pp=2, ep=2), "qwen3_moe"),
    "moe_qwen2_ep2_tp2": (4, dict(tp=2, sequence_parallel=True, ep=2), "qwen2_moe"),
    # megatron's distributed optimizer (expert states sharded over expert-DP): the step, not main_grad
    "moe_ep2_dp2_distopt": (4, dict(ep=2), "qwen3_moe"),
}
SLICES = ("moe_single", "moe_qwen2_ep2_tp2", "moe_ep2_dp2_distopt")
TOGGLE_CELLS = {("token-mean", "three"), ("seq-mean-token-mean", "budget")}
MATRIX = [n for n in MOE_LAYOUTS if n not in SLICES]


FULL_PRODUCT = "moe_ep2"  # the full product; the other matrix layouts rotate micro-batching (harness.cells_for)


def cells_for(layout: str) -> list[H.Cell]:
    cells = H.all_cells()
    if layout in SLICES:  # a slice: the baseline without EP; the shared-expert arch; the distributed optimizer
        cells = [c for c in cells if c.mb == "three" and c.mode in ("token-mean", "seq-mean-token-mean")]
    elif layout != FULL_PRODUCT:  # rotated, plus both per-token modes of the toggle test's cells
        toggle = [c for c in cells if (c.mode, c.mb) in TOGGLE_CELLS]
        cells = list(dict.fromkeys(H.rotate_micro_batching(cells, MATRIX.index(layout)) + toggle))
    return cells + (H.lora_cells() if layout in LORA_LAYOUTS else [])


# ---------------------------------------------------------------------------------- reference
def make_moe_problem(root: Path, arch: str) -> Path:
    """The dense harness's ragged batch (one fully masked trajectory, holes) on a tiny MoE model."""
    from verl_lite.utils.tiny_model import make_tiny_moe_model

    base = torch.load(H.make_problem(root / "dense"))
    model_dir = make_tiny_moe_model(root / arch, arch, vocab_size=64, hidden_size=32, num_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, num_experts=4, top_k=2,
                                    moe_intermediate_size=16, shared_expert_intermediate_size=24, seed=5)
    prob = {**base, "model_dir": str(model_dir)}
    path = root / f"problem_{arch}.pt"
    torch.save(prob, path)
    return path


def hf_moe_model(model_dir: str):
    """HF's model in float64 with its eager (per-expert loop) experts: the grouped-GEMM default has no float64."""
    model = H._hf_model(model_dir)
    model.config._experts_implementation = "eager"
    return model


def reference_router_loss(model, prob, router_logits=None) -> tuple[torch.Tensor, float, float]:
    """R = sum over layers of Z_COEFF * Z_l + AUX_COEFF * A_l (see verl_lite/engine/moe.py), float64,
    one sequence at a time: Z_l = sum_t lse^2 / N, A_l = sum_s (n_s/N) E sum_e f_se P_se.
    ``router_logits``: each sequence's per-layer router logits (default: a forward here)."""
    n_total = sum(int(x.numel()) for x in prob["ids"])
    k, n_exp = model.config.num_experts_per_tok, model.config.num_experts
    z_terms, aux_terms = [], []
    if router_logits is None:
        router_logits = [model(ids.unsqueeze(0), output_router_logits=True).router_logits for ids in prob["ids"]]
    for per_layer in router_logits:
        for logits in per_layer:  # [n_s, E] per layer
            logits = logits.reshape(-1, n_exp)
            n_s = logits.shape[0]
            z_terms.append(torch.logsumexp(logits, -1).pow(2).sum() / n_total)
            probs = torch.softmax(logits, -1)
            top = torch.topk(probs, k, dim=-1).indices
            f = torch.zeros(n_exp, dtype=probs.dtype).index_add_(0, top.reshape(-1), torch.ones(top.numel(), dtype=probs.dtype)) / (k * n_s)
            aux_s = n_exp * (f * probs.mean(0)).sum()
            aux_terms.append(aux_s * n_s / n_total)
    z, aux = torch.stack(z_terms).sum(), torch.stack(aux_terms).sum()
    layers = model.config.num_hidden_layers
    return Z_COEFF * z + AUX_COEFF * aux, float(z.detach()) / layers, float(aux.detach()) / layers


def moe_forward(model, prob):
    """One float64 forward, one sequence at a time: (log-probs, entropy, R, mean Z_l, mean A_l)."""
    outputs: list = []
    lp, ent = H.reference_outputs(model, prob, outputs=outputs, output_router_logits=True)
    return (lp, ent, *reference_router_loss(model, prob, [o.router_logits for o in outputs]))


def moe_reference_steps(prob, specs, old_lp: torch.Tensor | None = None):
    """(old log-probs, {(loss, mode): reference}) from ONE forward: policy loss + router losses R (the same
    R for every spec: it does not depend on the policy loss); ``old_lp`` None: this forward's + noise."""
    from verl_lite.algorithms.aggregation import NormalizationPlan
    from verl_lite.algorithms.objective import actor_loss

    model = hf_moe_model(prob["model_dir"])
    params = dict(model.named_parameters())
    lp, ent, router, z_mean, aux_mean = moe_forward(model, prob)
    if old_lp is None:
        old_lp = (lp.detach() + prob["noise"].double()) * (prob["mask"] != 0)
    mask = prob["mask"].double()
    data = {"response_mask": mask, "old_log_probs": old_lp.double(), "advantages": prob["advantages"].double()}
    refs = {}
    for k, (loss, mode) in enumerate(specs):
        policy, _ = actor_loss({"log_probs": lp, "entropy": ent}, data, NormalizationPlan.from_mask(mask, mode),
                               H.loss_cfg(loss, mode))
        out = H.reference_update(params, policy + router, retain_graph=k + 1 < len(specs))
        refs[(loss, mode)] = {
            "policy_loss": float(policy.detach()), "router_loss": float(router.detach()),
            "router_z_loss": z_mean, "router_aux_loss": aux_mean, "grad_norm": out["grad_norm"],
            "grads_clipped": H.hf_checkpoint_names(model, out["grads_clipped"]),
            "params_before": H.hf_checkpoint_names(model, out["params_before"]),
            "params_after": H.hf_checkpoint_names(model, out["params_after"]),
        }
    return old_lp, refs


def moe_reference_step(prob, loss: str, mode: str, old_lp: torch.Tensor) -> dict:
    return moe_reference_steps(prob, [(loss, mode)], old_lp)[1][(loss, mode)]


# ---------------------------------------------------------------------------------- LoRA on the experts
# Adapters (rank 4, alpha 8) on q, k, v, o and on gate/up/down of every routed expert, A and B random (std 0.1,
# seeded), router losses on. The reference: HF's Qwen3-MoE in float64 with peft's LoRA on the attention
# projections and the experts' adapters written out below (HF keeps the experts as fused 3-D parameters,
# which peft's target_modules do not reach).
LORA_LAYOUTS = ("moe_ep2_tp2",)  # TP-split attention adapters + sequence parallelism + experts split over EP
LORA_EXPERT_PROJS = ("gate_proj", "up_proj", "down_proj")


def lora_factor_name(layer: int, module: str, proj: str, factor: str) -> str:
    """PEFT's saved name: ``base_model.model.model.layers.{i}.{module}{proj}.lora_{A,B}.weight``."""
    return f"base_model.model.model.layers.{layer}.{module}{proj}.lora_{factor}.weight"


def make_moe_lora_factors(model_dir: str) -> dict:
    """Full float64 factors, PEFT-named: every layer's q/k/v/o and every routed expert's gate/up/down."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    q, kv, h, ffn = c.num_attention_heads * hd, c.num_key_value_heads * hd, c.hidden_size, c.moe_intermediate_size
    shapes = {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
              "gate_proj": (ffn, h), "up_proj": (ffn, h), "down_proj": (h, ffn)}
    g = torch.Generator().manual_seed(13)
    out = {}
    for i in range(c.num_hidden_layers):
        sites = [("self_attn.", p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
        sites += [(f"mlp.experts.{e}.", p) for e in range(c.num_experts) for p in LORA_EXPERT_PROJS]
        for module, proj in sites:
            n_out, n_in = shapes[proj]
            out[lora_factor_name(i, module, proj, "A")] = 0.1 * torch.randn(H.LORA_RANK, n_in, generator=g, dtype=torch.float64)
            out[lora_factor_name(i, module, proj, "B")] = 0.1 * torch.randn(n_out, H.LORA_RANK, generator=g, dtype=torch.float64)
    return out


def _lora_experts_forward(experts, factors: dict, scaling: float, hidden_states, top_k_index, top_k_weights):
    """HF's eager expert loop with each expert's three adapters: for expert e and its tokens x,
    gate = x W_g^T + s (x A_g^T) B_g^T, up likewise, y = (act(gate) * up) W_d^T + s (. A_d^T) B_d^T, times
    the routing weight, summed into the tokens' outputs."""
    out = torch.zeros_like(hidden_states)
    for e in range(experts.num_experts):
        token_idx, pos = torch.where(top_k_index == e)
        if token_idx.numel() == 0:
            continue
        x = hidden_states[token_idx]
        w_gate, w_up = experts.gate_up_proj[e].chunk(2, dim=0)

        def lora(x, proj, w):
            a, b = factors[(e, proj, "A")], factors[(e, proj, "B")]
            return x @ w.T + scaling * ((x @ a.T) @ b.T)

        y = lora(experts.act_fn(lora(x, "gate_proj", w_gate)) * lora(x, "up_proj", w_up), "down_proj", experts.down_proj[e])
        out.index_add_(0, token_idx, y * top_k_weights[token_idx, pos, None])
    return out


def moe_lora_model(model_dir: str, factors: dict):
    """(HF float64 model with peft's attention LoRA and the written-out expert LoRA, {PEFT name: trainable
    factor}); the base frozen."""
    import peft

    base = hf_moe_model(model_dir)
    model = peft.get_peft_model(base, peft.LoraConfig(r=H.LORA_RANK, lora_alpha=H.LORA_ALPHA, lora_dropout=0.0,
                                                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    params = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                key = name.replace(".default.weight", ".weight")
                p.copy_(factors[key])
                params[key] = p
    for i, layer in enumerate(base.model.layers):
        local = {}
        for e in range(layer.mlp.experts.num_experts):
            for proj in LORA_EXPERT_PROJS:
                for f in ("A", "B"):
                    key = lora_factor_name(i, f"mlp.experts.{e}.", proj, f)
                    local[(e, proj, f)] = params[key] = torch.nn.Parameter(factors[key].clone())
        layer.mlp.experts.forward = partial(_lora_experts_forward, layer.mlp.experts, local, H.LORA_ALPHA / H.LORA_RANK)
    assert not any(p.requires_grad for n, p in model.named_parameters() if "lora_" not in n)
    model.eval()
    return model, params


def moe_lora_references(prob, factors: dict, modes, old_lp: torch.Tensor) -> dict:
    """{("lora", mode): reference}: policy loss (vanilla PPO) + router losses R through the adapted model
    (one forward); gradients and one AdamW step of the factors only."""
    from verl_lite.algorithms.aggregation import NormalizationPlan
    from verl_lite.algorithms.objective import actor_loss

    model, params = moe_lora_model(prob["model_dir"], factors)
    lp, ent, router, z_mean, aux_mean = moe_forward(model, prob)
    mask = prob["mask"].double()
    data = {"response_mask": mask, "old_log_probs": old_lp.double(), "advantages": prob["advantages"].double()}
    refs = {}
    for k, mode in enumerate(modes):
        policy, _ = actor_loss({"log_probs": lp, "entropy": ent}, data, NormalizationPlan.from_mask(mask, mode),
                               H.loss_cfg("vanilla", mode))
        out = H.reference_update(params, policy + router, retain_graph=k + 1 < len(modes))
        refs[("lora", mode)] = {**out, "policy_loss": float(policy.detach()), "router_loss": float(router.detach()),
                                "router_z_loss": z_mean, "router_aux_loss": aux_mean}
    return refs


def make_moe_references(root: Path, problem_path: Path, arch: str) -> Path:
    """Every float64 reference of one MoE problem: one forward for the 2 x 5 cells and the old log-probs,
    one for the LoRA modes (when a LoRA layout uses this arch)."""
    prob = torch.load(problem_path)
    old_lp, refs = moe_reference_steps(prob, [(loss, mode) for loss in H.LOSSES for mode in H.MODES])
    refs["old_log_probs"] = old_lp
    if any(MOE_LAYOUTS[n][2] == arch for n in LORA_LAYOUTS):
        refs["lora_factors"] = make_moe_lora_factors(prob["model_dir"])
        refs.update(moe_lora_references(prob, refs["lora_factors"], sorted({c.mode for c in H.lora_cells()}), old_lp))
    path = root / f"refs_{arch}.pt"
    torch.save(refs, path)
    return path


# ---------------------------------------------------------------------------------- worker
def _worker_body(rank, world, port, layout, cell_dicts, problem_path, refs_path, out_path):
    from megatron.core import parallel_state as ps

    from verl_lite.algorithms.aggregation import NormalizationPlan
    from verl_lite.algorithms.objective import actor_loss
    from verl_lite.engine.distributed import init_distributed
    from verl_lite.engine.config import MegatronConfig
    from verl_lite.engine.engine import MegatronEngine

    t_start = time.perf_counter()
    _, par_kw, _ = MOE_LAYOUTS[layout]
    par = MegatronConfig.layout(**par_kw, timeout_s=180)
    init_distributed(rank, world, "127.0.0.1", port, par, seed=1234)
    prob, refs, lengths, data_all = H.load_problem(problem_path, refs_path)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mask = prob["mask"]
    state = {k: v.float() for k, v in refs[(H.LOSSES[0], H.MODES[0])]["params_before"].items()}
    cells = [H.Cell(**c) for c in cell_dicts]
    results: dict = {"cells": {}, "grads": {}, "timeline": {"init": time.perf_counter() - t_start}}
    # the expert groups (megatron creates the expert-DP gloo groups without a timeout) carry ours
    results["expert_group_timeouts_s"] = [
        g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
        for g in (ps.get_expert_model_parallel_group(), ps.get_expert_data_parallel_group(),
                  ps.get_expert_tensor_parallel_group())
    ]
    overrides = {"moe_aux_loss_coeff": AUX_COEFF, "moe_z_loss_coeff": Z_COEFF}

    from verl_lite.engine.config import LoraConfig

    lora_cfg = LoraConfig(rank=H.LORA_RANK, alpha=H.LORA_ALPHA, dropout=0.0, target_modules=H.LORA_TARGETS,
                          exclude_modules=(), adapter_path=None)
    for lora, per_token in ((False, False), (False, True), (True, False), (True, True)):
        todo = [c for c in cells if c.per_token == per_token and (c.loss == "lora") == lora]
        if not todo:
            continue
        engine = MegatronEngine(H.engine_config(
            prob, par, layout.endswith("distopt"), per_token, megatron={"override_transformer_config": dict(overrides)},
            lora=lora_cfg if lora else None))
        if lora:
            _run_lora_cells(engine, todo, rank, world, prob, refs, lengths, data_all, dp, dp_rank, results)
            del engine
            continue
        if "export_max_abs" not in results:
            diffs = [float((t - state[n]).abs().max()) if n in state else float("inf")
                     for n, t in engine.export_hf("param")]
            results["export_max_abs"] = max(diffs) if len(diffs) == len(state) else float("inf")
        for cell in todo:
            engine.load_hf(state)
            _, batch, mbs = H.rank_share(prob, data_all, H._plan(lengths, dp, cell.mb, 1), dp_rank)
            loss_fn = partial(actor_loss, plan=NormalizationPlan.from_mask(mask, cell.mode),
                              cfg=H.loss_cfg(cell.loss, cell.mode))
            out = engine.train_step(batch, mbs, loss_fn, temperature=H.TEMPERATURE, global_token_count=sum(lengths))
            ref = refs[(cell.loss, cell.mode)]
            kept: list[torch.Tensor] = []  # the gradient itself, for the per-token toggle test
            keep = rank == 0 and (cell.mode, cell.mb) in TOGGLE_CELLS

            def stream(it):
                for name, t in it:
                    if keep:
                        kept.append(t.double().reshape(-1).clone())
                    yield name, t

            grads = H._compare(stream(engine.export_hf("main_grad")), ref["grads_clipped"])
            if keep:
                results["grads"][cell.key] = torch.cat(kept).tolist()
            upd = H._compare(engine.export_hf("param"), ref["params_after"], base=ref["params_before"])
            cell_result = _cell_result(engine, out, ref, grads, upd, world)
            if rank == 0:
                results["cells"][cell.key] = cell_result
        del engine
    results["timeline"]["total"] = time.perf_counter() - t_start
    if rank == 0:
        Path(out_path).write_text(json.dumps(results))
    H.end_job()


def _cell_result(engine, out, ref, grads, upd, world) -> dict:
    """One cell's figures next to the reference's: gradient and update errors, the policy loss (summed over the
    ranks that own the output), each rank's router loss, the router z/aux losses and the grad norm. A
    collective: every rank calls it; only rank 0's copy is recorded."""
    import torch.distributed as dist

    gathered = [None] * world
    dist.all_gather_object(gathered, (out.get("loss") if engine.is_output_owner else None, out.get("router_loss")))
    owners = [x[0] for x in gathered if x[0] is not None]
    return {
        "grad_rel": grads["rel"], "grad_missing": grads["missing"], "param_rel": upd["rel"],
        "update_rel": upd["update_rel"], "param_missing": upd["missing"],
        "loss": sum(owners), "ref_loss": ref["policy_loss"],
        "router_losses": [x[1] for x in gathered], "ref_router_loss": ref["router_loss"],
        "router_z_loss": out.get("router_z_loss"), "ref_router_z_loss": ref["router_z_loss"],
        "router_aux_loss": out.get("router_aux_loss"), "ref_router_aux_loss": ref["router_aux_loss"],
        "grad_norm": out["grad_norm"], "ref_grad_norm": ref["grad_norm"],
    }


def _run_lora_cells(engine, cells, rank, world, prob, refs, lengths, data_all, dp, dp_rank, results) -> None:
    """LoRA cells: the factors reset from ``refs["lora_factors"]`` before each; every A and B gradient and the
    factors after the step vs ``moe_lora_references``, the base's gradients (none), the losses."""
    import torch.distributed as dist

    from verl_lite.algorithms.aggregation import NormalizationPlan
    from verl_lite.algorithms.objective import actor_loss

    factors = {k: v.float() for k, v in refs["lora_factors"].items()}
    for cell in cells:
        engine.load_adapter(factors)
        _, batch, mbs = H.rank_share(prob, data_all, H._plan(lengths, dp, cell.mb, 1), dp_rank)
        loss_fn = partial(actor_loss, plan=NormalizationPlan.from_mask(prob["mask"], cell.mode),
                          cfg=H.loss_cfg("vanilla", cell.mode))
        out = engine.train_step(batch, mbs, loss_fn, temperature=H.TEMPERATURE, global_token_count=sum(lengths))
        ref = refs[("lora", cell.mode)]
        exported = engine.export_adapter("main_grad")
        grads = H._compare(exported.items(), ref["grads_clipped"])
        upd = H._compare(engine.export_adapter("param").items(), ref["params_after"], base=ref["params_before"])
        base = [None] * world
        dist.all_gather_object(base, H.base_gradient_report(engine))
        cell_result = _cell_result(engine, out, ref, grads, upd, world)
        if rank == 0:
            results["cells"][cell.key] = {**cell_result,
                "base_with_grad": sorted({n for b in base for n in b["base_with_grad"]}),
                "trainable_is_adapter": all(b["trainable"] == b["adapter"] > 0 for b in base),
                "expert_factors": sum(".mlp.experts." in k for k in exported),
                "expert_grad_rel": H._compare(((k, v) for k, v in exported.items() if ".mlp.experts." in k),
                                              {k: v for k, v in ref["grads_clipped"].items() if ".mlp.experts." in k})["rel"],
            }


def run_moe_layout(layout: str, problem_path: Path, refs_path: Path, cells=None) -> dict:
    """All cells of a MoE layout in the harness's process pool of its world size; rank 0's results."""
    out_path = Path(tempfile.mkdtemp(prefix=f"parity_{layout}_")) / "result.json"
    cells = cells_for(layout) if cells is None else cells
    H.run_in_pool(MOE_LAYOUTS[layout][0], f"MoE layout {layout}", _worker_body,
                  (layout, [asdict(c) for c in cells], str(problem_path), str(refs_path), str(out_path)))
    return json.loads(out_path.read_text())


def layout_world(name) -> int:
    """The conftest's test order: tests run grouped by the world size of their layout."""
    return H.layout_world(MOE_LAYOUTS, name)


# ---------------------------------------------------------------------------------- tests
@pytest.fixture(scope="session")
def moe_problems(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_parity")
    out = {}
    for arch in sorted({a for _, _, a in MOE_LAYOUTS.values()}):
        problem = make_moe_problem(root, arch)
        out[arch] = (problem, make_moe_references(root, problem, arch))
    return out


RESULTS: dict[str, dict] = {}


def moe_results(layout: str, moe_problems) -> dict:
    if layout not in RESULTS:
        RESULTS[layout] = run_moe_layout(layout, *moe_problems[MOE_LAYOUTS[layout][2]])
    return RESULTS[layout]


def _rel_ok(a, b, tol) -> bool:
    return a is not None and abs(a - b) <= tol * max(1.0, abs(b))


@pytest.mark.parametrize("layout", list(MOE_LAYOUTS))
def test_moe_layout_matches_float64_reference(layout, moe_problems):
    res = moe_results(layout, moe_problems)
    assert sorted(res["cells"]) == sorted(c.key for c in cells_for(layout))
    assert res["export_max_abs"] == 0.0, "HF -> engine -> HF export of the MoE model is not bit-exact"
    assert res["expert_group_timeouts_s"] == [180.0] * 3, res["expert_group_timeouts_s"]
    failures = []
    for key, c in res["cells"].items():
        problems = []
        if c["grad_missing"] or c["param_missing"]:
            problems.append(f"missing {(c['grad_missing'] + c['param_missing'])[:3]}")
        if not c["grad_rel"] < GRAD_TOL and not layout.endswith("distopt"):  # main_grad: per shard there
            problems.append(f"grad rel {c['grad_rel']:.2e}")
        if not c["param_rel"] < PARAM_TOL:
            problems.append(f"param rel {c['param_rel']:.2e}")
        if not c["update_rel"] < UPDATE_TOL:
            problems.append(f"update rel {c['update_rel']:.2e}")
        if not _rel_ok(c["loss"], c["ref_loss"], LOSS_TOL):
            problems.append(f"policy loss {c['loss']:.8g} vs {c['ref_loss']:.8g}")
        if not all(_rel_ok(r, c["ref_router_loss"], LOSS_TOL) for r in c["router_losses"]):
            problems.append(f"router loss {c['router_losses']} vs {c['ref_router_loss']:.8g}")
        for k in ("router_z_loss", "router_aux_loss"):
            if not _rel_ok(c[k], c[f"ref_{k}"], LOSS_TOL):
                problems.append(f"{k} {c[k]} vs {c[f'ref_{k}']:.8g}")
        if not abs(c["grad_norm"] - c["ref_grad_norm"]) <= GRAD_TOL * c["ref_grad_norm"]:
            problems.append(f"grad_norm {c['grad_norm']:.8g} vs {c['ref_grad_norm']:.8g}")
        if "base_with_grad" in c:  # LoRA: the frozen base trains nothing; the experts' adapters are all there
            if c["base_with_grad"]:
                problems.append(f"base parameters with a gradient {c['base_with_grad'][:3]}")
            if not c["trainable_is_adapter"]:
                problems.append("trainable parameters other than the adapters")
            if c["expert_factors"] != N_EXPERT_FACTORS:
                problems.append(f"{c['expert_factors']} expert factors exported, {N_EXPERT_FACTORS} expected")
            if not c["expert_grad_rel"] < GRAD_TOL:
                problems.append(f"expert adapters' grad rel {c['expert_grad_rel']:.2e}")
        if problems:
            failures.append(f"{key}: {'; '.join(problems)}")
    assert not failures, f"{len(failures)}/{len(res['cells'])} cells differ:\n" + "\n".join(failures)


def test_matrix_layouts_cover_every_loss_mode_and_micro_batching():
    full = {c.key for c in H.all_cells()}
    assert len(full) == 2 * 5 * 2 * 3
    lora = {c.key for c in H.lora_cells()}
    rotated = set()
    for layout in MATRIX:
        cells = [c for c in cells_for(layout) if c.key not in lora]
        assert {(c.loss, c.mode, c.per_token) for c in cells} == {(c.loss, c.mode, c.per_token) for c in H.all_cells()}
        for mode in H.MODES:  # every mode meets every micro-batching scheme in every layout
            assert {c.mb for c in cells if c.mode == mode} == set(H.MB_SCHEMES), (layout, mode)
        assert lora <= {c.key for c in cells_for(layout)} or layout not in LORA_LAYOUTS
        if layout == FULL_PRODUCT:
            assert {c.key for c in cells} == full
        else:
            rotated |= {c.key for c in cells}
    assert rotated == full, "the rotated layouts together run the full product"
    assert set(LORA_LAYOUTS) <= set(MATRIX)


@pytest.mark.parametrize("layout", ["moe_ep2_dp2_cp2_pp2", "moe_ep2_tp2"])
def test_per_token_mode_toggle_keeps_router_loss_gradient(layout, moe_problems):
    """verl #6609: with aux and z coefficients > 0, switching calculate_per_token_loss must change neither
    the gradient (every parameter, experts and router included) nor the grad norm beyond float noise."""
    res = moe_results(layout, moe_problems)
    pairs = 0
    for key, g0 in res["grads"].items():
        if "pt=0" not in key:
            continue
        g0, g1 = torch.tensor(g0), torch.tensor(res["grads"][key.replace("pt=0", "pt=1")])
        assert (g0 - g1).norm() <= 1e-6 * g0.norm(), f"{key}: per-token toggle moves the gradient by {(g0 - g1).norm() / g0.norm():.2e}"
        n0, n1 = res["cells"][key]["grad_norm"], res["cells"][key.replace("pt=0", "pt=1")]["grad_norm"]
        assert abs(n0 - n1) <= 1e-6 * n0, f"{key}: grad norm {n0} vs {n1}"
        pairs += 1
    assert pairs == len(H.LOSSES) * len(TOGGLE_CELLS)
