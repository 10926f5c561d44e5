"""Parity harness: one optimizer step of the megatron engine under a parallel layout vs a
single-process float64 reference that uses no megatron (HF transformers on the same weights).

The reference (``reference_step``) computes, for one (policy loss, aggregation mode):
  L = actor_loss over the whole mini-batch (one call, plan from the whole mask),
  g = dL/dtheta (float64), the pre-clip global norm, megatron's clip coefficient
  min(1, clip / (|g| + 1e-6)), and the parameters after one AdamW step (decoupled weight decay,
  none on biases and 1-D parameters, as megatron's default param groups).

A layout run (``run_layout``) spawns ``world`` processes; each builds the engine (once per
``calculate_per_token_loss`` value), and for every cell resets the weights, plans micro-batches
with ``controller.planning``, takes one ``train_step`` on its DP share, and exports
``main_grad`` and the parameters through the HF bridge. Rank 0 streams the comparison (global
norm of the difference / global norm) and writes the numbers to JSON; the tests assert them.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch

from verl_lite.utils.net import free_port

LOSSES = ("vanilla", "gspo")
MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
MB_SCHEMES = ("one", "three", "budget")
TEMPERATURE = 0.9
ENTROPY_COEFF = 0.01
NUM_SEQS = 12

# name -> (world size, ParallelConfig kwargs, use_distributed_optimizer)
LAYOUTS = {
    "single": (1, dict(), False),
    "dp2": (2, dict(), False),
    "tp2": (2, dict(tp=2), False),
    "pp2": (2, dict(pp=2), False),
    "pp2_vpp2": (2, dict(pp=2, vpp=2), False),
    "pp4": (4, dict(pp=4), False),
    "tp2_pp2": (4, dict(tp=2, pp=2), False),
    "dp2_pp2": (4, dict(pp=2), False),
    "dp2_tp2_pp2": (8, dict(tp=2, pp=2), False),
    "cp2": (2, dict(cp=2), False),
    "cp4": (4, dict(cp=4), False),
    "cp2_tp2": (4, dict(cp=2, tp=2), False),
    "cp2_pp2": (4, dict(cp=2, pp=2), False),
    "cp2_dp2": (4, dict(cp=2), False),
    "dp2_cp2_pp2": (8, dict(cp=2, pp=2), False),
    # distributed optimizer: parameters after the step (main_grad is only valid per shard there)
    "dp2_distopt": (2, dict(), True),
    "tp2_sp": (2, dict(tp=2, sequence_parallel=True), False),
}


def optim_kwargs() -> dict:
    return dict(lr=1e-3, weight_decay=0.1, betas=(0.9, 0.95), eps=1e-6, clip_grad=0.5, lr_warmup_steps=0,
                lr_decay_style="constant", total_steps=1)


@dataclass(frozen=True)
class Cell:
    loss: str
    mode: str
    per_token: bool
    mb: str

    @property
    def key(self) -> str:
        return f"{self.loss}|{self.mode}|pt={int(self.per_token)}|mb={self.mb}"


def all_cells() -> list[Cell]:
    return [Cell(lo, mo, pt, mb) for pt in (False, True) for lo in LOSSES for mo in MODES for mb in MB_SCHEMES]


def cells_for(layout: str) -> list[Cell]:
    """The cells one launch of ``layout`` runs.

    Every matrix layout runs the full product (losses x modes x per-token x micro-batching);
    the two extra layouts (distributed optimizer, sequence parallelism) run a slice of it.
    """
    if layout == "dp2_distopt":
        cells = [c for c in all_cells() if c.mb == "three" and c.mode in ("token-mean", "seq-mean-token-mean")]
    elif layout == "tp2_sp":
        cells = [c for c in all_cells() if c.mb == "budget" and c.mode in ("token-mean", "seq-mean-token-sum-norm")]
    else:
        cells = all_cells() + critic_cells()  # the critic's value loss: the same full product
    return cells


# ---------------------------------------------------------------------------------- problem
def make_problem(root: Path) -> Path:
    """Tiny Qwen2 (q/k/v bias, untied) + a ragged batch with one fully masked trajectory."""
    from verl_lite.utils.tiny_model import make_tiny_hf_model

    model_dir = make_tiny_hf_model(
        root / "model", "qwen2", vocab_size=64, hidden_size=32, num_layers=4, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, tie_word_embeddings=False, seed=3, init_std=0.15,
    )
    g = torch.Generator().manual_seed(7)
    prompt_lens = [3, 4, 2, 7, 4, 5, 4, 8, 2, 5, 4, 3]
    resp_lens = [6, 3, 9, 4, 11, 2, 7, 5, 3, 8, 1, 6]
    lengths = [p + r for p, r in zip(prompt_lens, resp_lens)]
    assert len(lengths) == NUM_SEQS
    assert all(n % 2 for n in lengths)  # odd: no length divides by 2*CP, padding is always exercised
    ids = [torch.randint(1, 64, (n,), generator=g) for n in lengths]
    width = max(resp_lens)
    mask = torch.zeros(NUM_SEQS, width)
    for i, r in enumerate(resp_lens):
        mask[i, :r] = 1.0
    mask[3, :] = 0.0  # fully masked trajectory
    mask[4, 8:] = 0.0  # a truncated tail inside the response
    mask[9, 2] = 0.0  # a hole
    prob = {
        "model_dir": str(model_dir),
        "ids": ids,
        "resp_lens": torch.tensor(resp_lens),
        "mask": mask,
        "advantages": torch.randn(NUM_SEQS, width, generator=g) * mask,
        "noise": 0.3 * torch.randn(NUM_SEQS, width, generator=g),
        "score_weight": 0.3 * torch.randn(1, 32, generator=g),
        "old_values": torch.randn(NUM_SEQS, width, generator=g),
        "returns": torch.randn(NUM_SEQS, width, generator=g),
    }
    path = root / "problem.pt"
    torch.save(prob, path)
    return path


def _hf_model(model_dir: str):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    model.eval()
    return model


def reference_outputs(model, prob, temperature=TEMPERATURE):
    """float64 log-probs and entropy [n, W] of the responses, one sequence at a time (no padding)."""
    width = prob["mask"].shape[1]
    logps, ents = [], []
    for ids, r in zip(prob["ids"], prob["resp_lens"].tolist()):
        logits = model(ids.unsqueeze(0)).logits[0] / temperature
        n = ids.numel()
        lp_all = torch.log_softmax(logits, -1)
        scored = lp_all[n - r - 1 : n - 1]
        lp = scored.gather(-1, ids[n - r :].unsqueeze(-1)).squeeze(-1)
        ent = -(scored.exp() * scored).sum(-1)
        logps.append(torch.nn.functional.pad(lp, (0, width - r)))
        ents.append(torch.nn.functional.pad(ent, (0, width - r)))
    return torch.stack(logps), torch.stack(ents)


def old_log_probs(prob) -> torch.Tensor:
    """Behaviour log-probs: the initial policy's plus noise (ratios spread over the clip range)."""
    model = _hf_model(prob["model_dir"])
    with torch.no_grad():
        lp, _ = reference_outputs(model, prob)
    return (lp + prob["noise"].double()) * (prob["mask"] != 0)


def loss_cfg(loss: str, mode: str):
    from verl_lite.workers.from_config import actor_loss_config

    return actor_loss_config(policy_loss=loss, loss_agg_mode=mode, entropy_coeff=ENTROPY_COEFF)


def reference_step(prob, loss: str, mode: str, old_lp: torch.Tensor) -> dict:
    from verl_lite.algorithms.aggregation import NormalizationPlan
    from verl_lite.algorithms.objective import actor_loss

    model = _hf_model(prob["model_dir"])
    params = dict(model.named_parameters())
    lp, ent = reference_outputs(model, prob)
    mask = prob["mask"].double()
    data = {"response_mask": mask, "old_log_probs": old_lp.double(), "advantages": prob["advantages"].double()}
    plan = NormalizationPlan.from_mask(mask, mode)
    L, _ = actor_loss({"log_probs": lp, "entropy": ent}, data, plan, loss_cfg(loss, mode))
    return {**reference_update(params, L), "log_probs": lp.detach(), "entropy": ent.detach()}


def reference_update(params: dict, L: torch.Tensor) -> dict:
    """Backward L, clip the global grad norm as megatron does, take one AdamW step (float64).

    Weight decay on matrices only (not biases / norms), as megatron's optimizer groups it."""
    o = optim_kwargs()
    L.backward()
    grads = {k: p.grad.detach().clone() for k, p in params.items()}
    norm = torch.sqrt(sum((g**2).sum() for g in grads.values()))
    coef = min(1.0, o["clip_grad"] / (float(norm) + 1e-6))
    for p in params.values():
        p.grad.mul_(coef)
    decay = [p for k, p in params.items() if p.ndim > 1 and not k.endswith(".bias")]
    no_decay = [p for k, p in params.items() if not (p.ndim > 1 and not k.endswith(".bias"))]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": o["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=o["lr"], betas=o["betas"], eps=o["eps"],
    )
    before = {k: p.detach().clone() for k, p in params.items()}
    opt.step()
    return {
        "loss": float(L.detach()),
        "grad_norm": float(norm),
        "grads_clipped": {k: g * coef for k, g in grads.items()},
        "params_before": before,
        "params_after": {k: p.detach().clone() for k, p in params.items()},
    }


CLIPRANGE_VALUE = 0.2


def critic_cells() -> list[Cell]:
    """Clipped value loss x five modes x per-token off/on x three micro-batchings."""
    return [Cell("critic", mo, pt, mb) for pt in (False, True) for mo in MODES for mb in MB_SCHEMES]


def reference_values(model, score_w, prob):
    """float64 critic values [n, W]: final-norm hidden states @ score_w^T at the scoring positions."""
    width = prob["mask"].shape[1]
    rows = []
    for ids, r in zip(prob["ids"], prob["resp_lens"].tolist()):
        h = model.model(ids.unsqueeze(0)).last_hidden_state[0]
        v = (h @ score_w.T).squeeze(-1)
        n = ids.numel()
        rows.append(torch.nn.functional.pad(v[n - r - 1 : n - 1], (0, width - r)))
    return torch.stack(rows)


def critic_reference_step(prob, mode: str) -> dict:
    """Same as reference_step for the critic: clipped value loss through the plan."""
    from verl_lite.algorithms.aggregation import NormalizationPlan
    from verl_lite.algorithms.objective import critic_loss

    model = _hf_model(prob["model_dir"])
    score = torch.nn.Parameter(prob["score_weight"].double().clone())
    params = {f"model.{k}": p for k, p in model.model.named_parameters()}
    params["score.weight"] = score
    values = reference_values(model, score, prob)
    mask = prob["mask"].double()
    data = {"response_mask": mask, "old_values": prob["old_values"].double(), "returns": prob["returns"].double()}
    L, _ = critic_loss({"values": values}, data, NormalizationPlan.from_mask(mask, mode), CLIPRANGE_VALUE)
    return {**reference_update(params, L), "values": values.detach()}


def make_references(root: Path, problem_path: Path) -> Path:
    prob = torch.load(problem_path)
    old_lp = old_log_probs(prob)
    refs = {"old_log_probs": old_lp}
    for loss in LOSSES:
        for mode in MODES:
            refs[(loss, mode)] = reference_step(prob, loss, mode, old_lp)
    for mode in MODES:
        refs[("critic", mode)] = critic_reference_step(prob, mode)
    path = root / "refs.pt"
    torch.save(refs, path)
    return path


# ---------------------------------------------------------------------------------- worker
def _plan(lengths, dp, scheme, vpp_multiple):
    from verl_lite.controller.planning import plan_micro_batches

    per_rank = len(lengths) // dp
    if scheme == "one":
        return plan_micro_batches(lengths, dp, micro_batch_size=per_rank, vpp_multiple=vpp_multiple)
    if scheme == "three":
        return plan_micro_batches(lengths, dp, micro_batch_size=-(-per_rank // 3), vpp_multiple=vpp_multiple)
    return plan_micro_batches(lengths, dp, max_tokens_per_micro_batch=max(lengths) + 8, vpp_multiple=vpp_multiple)


class _NormAcc:
    def __init__(self):
        self.diff = 0.0
        self.ref = 0.0
        self.missing: list[str] = []

    def add(self, a: torch.Tensor, b: torch.Tensor):
        self.diff += float(((a.double() - b.double()) ** 2).sum())
        self.ref += float((b.double() ** 2).sum())

    @property
    def rel(self) -> float:
        return (self.diff / max(self.ref, 1e-300)) ** 0.5


def _compare(stream, ref: dict, base: dict | None = None) -> dict:
    """Stream (name, tensor) pairs against ref[name] (minus base[name] when given: compares updates)."""
    acc = _NormAcc()
    whole = _NormAcc()  # |t - ref| / |ref| on the tensors themselves
    seen = set()
    for name, t in stream:
        seen.add(name)
        if name not in ref:
            acc.missing.append(name)
            continue
        whole.add(t, ref[name])
        if base is not None:
            acc.add(t.double() - base[name], ref[name] - base[name])
    missing = sorted(set(ref) - seen) + acc.missing
    return {"rel": whole.rel, "update_rel": acc.rel if base is not None else None, "missing": missing}


def _worker(rank, world, port, layout_name, cell_dicts, problem_path, refs_path, out_path, timeout_s):
    torch.set_num_threads(1)
    try:
        _worker_body(rank, world, port, layout_name, cell_dicts, problem_path, refs_path, out_path, timeout_s)
    except BaseException:
        Path(f"{out_path}.rank{rank}.err").write_text(traceback.format_exc())
        raise


def load_problem(problem_path, refs_path):
    """A layout run's inputs: the problem and its float64 references (both written by the test), the
    sequence lengths, and the actor's per-token data in fp32 (response mask, old log-probs, advantages)."""
    prob, refs = torch.load(problem_path), torch.load(refs_path)
    lengths = [int(x.numel()) for x in prob["ids"]]
    data_all = {"response_mask": prob["mask"], "old_log_probs": refs["old_log_probs"].float(),
                "advantages": prob["advantages"].float()}
    return prob, refs, lengths, data_all


def rank_share(prob, data_all, plan, dp_rank):
    """This DP rank's rows of a micro-batch ``plan``: (the rows in order, their ``SequenceBatch``, and the
    plan's micro-batches as positions within that batch)."""
    from verl_lite.engine.engine import SequenceBatch

    rows = sorted(i for mb in plan[dp_rank] for i in mb)
    pos = {r: k for k, r in enumerate(rows)}
    batch = SequenceBatch([prob["ids"][i] for i in rows], prob["resp_lens"][rows],
                          {k: v[rows] for k, v in data_all.items()}, response_width=prob["mask"].shape[1])
    return rows, batch, [[pos[i] for i in mb] for mb in plan[dp_rank]]


def _worker_body(rank, world, port, layout_name, cell_dicts, problem_path, refs_path, out_path, timeout_s):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from verl_lite.algorithms.aggregation import NormalizationPlan
    from verl_lite.algorithms.objective import actor_loss, critic_loss
    from verl_lite.workers.from_config import engine_config, optim_config
    from verl_lite.engine.distributed import destroy_distributed, init_distributed
    from verl_lite.workers.from_config import parallel_config
    from verl_lite.engine.engine import MegatronEngine

    t_start = time.perf_counter()
    _, par_kw, distopt = LAYOUTS[layout_name]
    par = parallel_config(**par_kw, timeout_s=timeout_s)
    init_distributed(rank, world, "127.0.0.1", port, par, seed=1234)
    timeline = {"init": time.perf_counter() - t_start}
    prob, refs, lengths, data_all = load_problem(problem_path, refs_path)
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mask = prob["mask"]
    data_all.update(old_values=prob["old_values"].float(), returns=prob["returns"].float())
    actor_state = {k: v.float() for k, v in refs[(LOSSES[0], MODES[0])]["params_before"].items()}
    critic_state = {k: v.float() for k, v in refs[("critic", MODES[0])]["params_before"].items()}
    vpp_multiple = par.pp if par.vpp else 1
    cells = [Cell(**c) for c in cell_dicts]
    results: dict = {"cells": {}, "infer": {}, "timeline": timeline}

    def local_batch(plan):
        return rank_share(prob, data_all, plan, dp_rank)

    def gather_rows(engine, rows, out, names):
        gathered = [None] * world
        dist.all_gather_object(gathered, (rows, out) if engine.is_output_owner else None)
        full = {k: torch.zeros_like(mask) for k in names}
        for item in gathered:
            if item is not None:
                for k in names:
                    full[k][item[0]] = item[1][k]
        return full

    for critic in (False, True):
        for per_token in (False, True):
            todo = [c for c in cells if c.per_token == per_token and (c.loss == "critic") == critic]
            if not todo:
                continue
            t0 = time.perf_counter()
            cfg = engine_config(
                model_path=prob["model_dir"], parallel=par,
                optim=optim_config(**optim_kwargs(), use_distributed_optimizer=distopt),
                calculate_per_token_loss=per_token, value_head=critic,
            )
            engine = MegatronEngine(cfg)
            if critic:
                engine.load_hf(critic_state)
            timeline[f"build critic={critic} pt={per_token}"] = time.perf_counter() - t0
            key = "critic_export_max_abs" if critic else "export_max_abs"
            if key not in results:  # HF -> engine -> HF must be bit-exact
                state = critic_state if critic else actor_state
                diffs = [float((t - state[n]).abs().max()) if n in state else float("inf")
                         for n, t in engine.export_hf("param")]
                results[key] = max(diffs) if len(diffs) == len(state) else float("inf")
            infer_key = "values" if critic else "log_probs"
            if infer_key not in results["infer"]:  # forward-only outputs on the whole batch, gathered
                names = ("values",) if critic else ("log_probs", "entropy")
                rows, batch, mbs = local_batch(_plan(lengths, dp, "three", vpp_multiple))
                full = gather_rows(engine, rows, engine.infer(batch, mbs, temperature=TEMPERATURE), names)
                if critic:
                    ref = refs[("critic", MODES[0])]
                    results["infer"]["values"] = full["values"].tolist()
                    results["infer"]["values_err"] = float((full["values"].double() - ref["values"]).abs().max())
                else:
                    ref = refs[(LOSSES[0], MODES[0])]
                    results["infer"]["log_probs"] = full["log_probs"].tolist()
                    results["infer"]["entropy"] = full["entropy"].tolist()
                    results["infer"]["lp_err"] = float((full["log_probs"].double() - ref["log_probs"]).abs().max())
                    results["infer"]["ent_err"] = float((full["entropy"].double() - ref["entropy"]).abs().max())
            for cell in todo:
                t0 = time.perf_counter()
                engine.load_hf(critic_state if critic else actor_state)
                t1 = time.perf_counter()
                plan = _plan(lengths, dp, cell.mb, vpp_multiple)
                _, batch, mbs = local_batch(plan)
                nplan = NormalizationPlan.from_mask(mask, cell.mode)
                if critic:
                    loss_fn = partial(critic_loss, plan=nplan, cliprange_value=CLIPRANGE_VALUE)
                else:
                    loss_fn = partial(actor_loss, plan=nplan, cfg=loss_cfg(cell.loss, cell.mode))
                out = engine.train_step(batch, mbs, loss_fn, temperature=TEMPERATURE,
                                        global_token_count=sum(lengths))
                t2 = time.perf_counter()
                ref = refs[(cell.loss, cell.mode)]
                grads = None if distopt else _compare(engine.export_hf("main_grad"), ref["grads_clipped"])
                upd = _compare(engine.export_hf("param"), ref["params_after"], base=ref["params_before"])
                gathered = [None] * world
                dist.all_gather_object(gathered, out.get("loss") if engine.is_output_owner else None)
                owners = [x for x in gathered if x is not None]
                t3 = time.perf_counter()
                if rank == 0:
                    results["cells"][cell.key] = {
                        "grad_rel": None if grads is None else grads["rel"],
                        "grad_missing": None if grads is None else grads["missing"],
                        "param_rel": upd["rel"], "update_rel": upd["update_rel"], "param_missing": upd["missing"],
                        "loss": sum(owners), "num_owners": len(owners), "ref_loss": ref["loss"],
                        "grad_norm": out["grad_norm"], "ref_grad_norm": ref["grad_norm"], "lr": out["lr"],
                        "num_micro_batches": len(mbs), "seconds": [t1 - t0, t2 - t1, t3 - t2],
                    }
            del engine
    timeline["total"] = time.perf_counter() - t_start
    if rank == 0:
        Path(out_path).write_text(json.dumps(results))
    dist.barrier()
    destroy_distributed()


RESULTS: dict[str, dict] = {}  # layout -> rank 0's results, filled by the tests (one launch each)


def summary_lines() -> list[str]:
    """One line per layout run: worst errors over its cells and where its time went."""
    lines = []
    for name, res in RESULTS.items():
        cells = res["cells"].values()
        worst = {k: max((c[k] or 0.0) for c in cells) for k in ("grad_rel", "param_rel", "update_rel")}
        loss = max(abs(c["loss"] - c["ref_loss"]) / max(1.0, abs(c["ref_loss"])) for c in cells)
        tl = res.get("timeline", {})
        lines.append(
            f"{name:12s} cells={len(res['cells']):2d} grad={worst['grad_rel']:.1e} param={worst['param_rel']:.1e} "
            f"update={worst['update_rel']:.1e} loss={loss:.1e} init={tl.get('init', 0):.1f}s "
            f"total={tl.get('total', 0):.1f}s cells_s={sum(sum(c['seconds']) for c in cells):.1f}s"
        )
    return lines


def run_layout(layout_name: str, cells: list[Cell], problem_path: Path, refs_path: Path, timeout_s: float = 180):
    """Spawn the layout's processes, run all cells, return rank 0's JSON results."""
    import torch.multiprocessing as mp

    world = LAYOUTS[layout_name][0]
    out_path = Path(tempfile.mkdtemp(prefix=f"parity_{layout_name}_")) / "result.json"
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        mp.spawn(
            _worker,
            args=(world, free_port(), layout_name, [asdict(c) for c in cells], str(problem_path), str(refs_path),
                  str(out_path), timeout_s),
            nprocs=world,
            join=True,
        )
    except Exception as e:
        errs = sorted(out_path.parent.glob("*.err"))
        detail = "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in errs)
        raise RuntimeError(f"layout {layout_name} failed: {e}\n{detail}") from e
    return json.loads(out_path.read_text())
