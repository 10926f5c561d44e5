"""Routing replay on the engine (``SequenceBatch.routing``, engine/moe.py): every MoE router takes the given experts.

Reference: HF transformers' MoE model in float64 with each router forced to the same experts (its gates are the
softmax of its own logits at those experts, renormalised where the model renormalises: what megatron-core's
``RouterReplay`` computes), one sequence at a time. The given routing is random (k distinct experts per token and
layer, far from the routers' own choice), with the last token of every sequence and one layer of one sequence left
unrecorded (``UNKNOWN_EXPERT``: those tokens take the router's own choice). Layouts: 1 process; TP2 with sequence
parallelism, PP2, CP2 and EP2 (DP2) in one 2-process launch; EP2 x PP2 (DP2) in a 4-process one; Qwen3-MoE and, at
TP2, Qwen2-MoE (shared expert, no renormalisation):
- log-probs from ``infer`` equal the forced float64 reference (1e-5), and differ from the unforced model's (so the
  replay took effect; without ``routing`` the engine gives the unforced log-probs); its routing counts per sequence
  and layer (recorded tokens compared, and those where the router itself would have chosen other experts) equal
  the reference's;
- a ``train_step``'s gradients equal the forced float64 reference's within 1e-5 relative (global norm of the
  difference / global norm), and so do the routers' own (the gates carry the router's gradient);
- recording (``infer(record_routing=True)``, R2's first pass): the experts every token was routed to equal the
  float64 model's own top k at every position, and replaying them gives the recording pass's log-probs;
- ``routing`` given to an engine built without ``routing_replay`` is one clear error.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from .conftest import spawn_ranks

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parity"))
import harness as H  # noqa: E402

LENGTHS, RESPONSES = [9, 14, 5, 11], [4, 6, 2, 5]
NUM_LAYERS, NUM_EXPERTS, TOP_K = 2, 4, 2
LAYOUTS = {"single": (1, {}), "tp2_sp": (2, dict(tp=2, sequence_parallel=True)), "pp2": (2, dict(pp=2)),
           "cp2": (2, dict(cp=2)), "ep2": (2, dict(ep=2)), "ep2_pp2": (4, dict(ep=2, pp=2))}  # name: (world, layout)
UNKNOWN = 255


def _problem(seed: int = 3):
    gen = torch.Generator().manual_seed(seed)
    ids = [torch.randint(1, 64, (n,), generator=gen) for n in LENGTHS]
    routing = torch.full((len(ids), max(LENGTHS), NUM_LAYERS, TOP_K), UNKNOWN, dtype=torch.uint8)
    for i, n in enumerate(LENGTHS):
        choice = torch.rand(n, NUM_LAYERS, NUM_EXPERTS, generator=gen).argsort(-1)[..., :TOP_K]
        routing[i, : n - 1] = choice[: n - 1].to(torch.uint8)  # the last token: not recorded
    routing[2, :, 1] = UNKNOWN  # one layer of one sequence unrecorded: its tokens take their router's own choice
    weights = torch.randn(len(ids), max(RESPONSES), generator=gen, dtype=torch.float64)
    return ids, routing, weights


def _forced_experts(routing_row: torch.Tensor, layer: int, n: int) -> torch.Tensor:
    """The recorded experts ([n, k] long), UNKNOWN where not recorded (the router's own choice there)."""
    return routing_row[:n, layer].long()


def _force_routing(model, forced: dict, mismatched: dict):
    """Wrap every HF router: its own logits, the experts ``forced[layer]`` ([tokens, k]) and their gates; per layer
    ``mismatched[layer]`` = recorded tokens ([:-1] of the sequence, the known rows) where the router's own top k
    differs."""
    for layer, block in enumerate(model.model.layers):
        gate = block.mlp.gate

        def forward(hidden, gate=gate, layer=layer, original=gate.forward):
            logits, _, _ = original(hidden)
            own = logits.topk(TOP_K, dim=-1).indices
            known = forced["known"][layer]
            experts = torch.where(known[:, None], forced[layer].to(logits.device), own)
            differs = (own.sort(-1).values != experts.sort(-1).values).any(-1)
            mismatched[layer] = int((differs & known).sum())
            probs = torch.softmax(logits, dim=-1, dtype=torch.float)
            values = probs.gather(-1, experts)
            if getattr(gate, "norm_topk_prob", False):
                values = values / values.sum(dim=-1, keepdim=True)
            return logits, values.to(logits.dtype), experts

        gate.forward = forward


def _reference(model_dir: str, ids, routing, weights) -> dict:
    """float64 HF: forced and unforced response log-probs; the forced loss's gradients (checkpoint names)."""
    import transformers

    out = {}
    for forced_run in (False, True):
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
        model.config._experts_implementation = "eager"
        forced: dict = {}
        mismatched: dict = {}
        counts = torch.zeros(2, len(ids), NUM_LAYERS, dtype=torch.float64)  # mismatched, compared
        if forced_run:
            _force_routing(model, forced, mismatched)
        log_probs, loss = [], 0.0
        for i, (seq, r) in enumerate(zip(ids, RESPONSES)):
            n = seq.numel()
            forced.update({layer: _forced_experts(routing[i], layer, n) for layer in range(NUM_LAYERS)})
            forced["known"] = {layer: (routing[i, :n, layer] != UNKNOWN).all(-1) for layer in range(NUM_LAYERS)}
            output = model(seq[None], output_router_logits=not forced_run)
            lsm = output.logits[0].log_softmax(-1)[n - r - 1 : n - 1]
            if not forced_run:  # the model's own routing of every token, per layer
                own = torch.stack([lg.topk(TOP_K, dim=-1).indices for lg in output.router_logits], dim=1)
                out.setdefault("own_routing", []).append(own.sort(-1).values)
            for layer in range(NUM_LAYERS):
                counts[:, i, layer] = torch.tensor([mismatched.get(layer, 0), int(forced["known"][layer].sum())])
            lp = lsm.gather(-1, seq[n - r :, None])[:, 0]
            log_probs.append(lp.detach())
            loss = loss - (weights[i, :r] * lp).sum() / 10.0
        out["forced" if forced_run else "own"] = log_probs
        if forced_run:
            out["counts"] = counts
            loss.backward()
            out["grads"] = H.hf_checkpoint_names(model, {k: p.grad for k, p in model.named_parameters()})
    return out


def _layout_run(rank, model_dir, layout: str, ids, routing, weights, ref) -> dict:
    from megatron.core import parallel_state as ps

    from verl_lite.engine import MegatronEngine, SequenceBatch
    from verl_lite.engine.config import EngineConfig, MegatronConfig, OptimConfig

    from .conftest import use_layout

    world, shape = LAYOUTS[layout]
    par = MegatronConfig.layout(timeout_s=120.0, **shape)
    use_layout(rank, world, par)
    engine = MegatronEngine(EngineConfig(model_dir, par, OptimConfig(lr=1e-2, weight_decay=0.0, clip_grad=1e9),
                                         routing_replay=True))
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    rows = list(range(dp_rank, len(ids), dp))  # this DP rank's sequences
    batch = SequenceBatch([ids[i] for i in rows], torch.tensor([RESPONSES[i] for i in rows]),
                          {"weights": weights[rows].float()}, response_width=max(RESPONSES), routing=routing[rows])
    plain = SequenceBatch(batch.input_ids, batch.response_lengths, batch.data, batch.response_width)
    micro = [[0], list(range(1, len(rows)))]  # two micro-batches of different sizes
    out = {"layout": layout}
    replayed, own = engine.infer(batch, micro, outputs=("log_probs",)), engine.infer(plain, micro, outputs=("log_probs",))
    if replayed is not None:
        err = own_err = forced_vs_own = 0.0
        for k, i in enumerate(rows):
            r = RESPONSES[i]
            err = max(err, (replayed["log_probs"][k, :r].double() - ref["forced"][i]).abs().max().item())
            own_err = max(own_err, (own["log_probs"][k, :r].double() - ref["own"][i]).abs().max().item())
            forced_vs_own = max(forced_vs_own, (ref["forced"][i] - ref["own"][i]).abs().max().item())
        out.update(lp_err=err, own_lp_err=own_err, forced_vs_own=forced_vs_own)
        got = torch.stack([replayed["routing_mismatched"], replayed["routing_compared"]])
        out["counts_equal"] = torch.equal(got, ref["counts"][:, rows])
        out["mismatched"] = float(got[0].sum())

    recorded = engine.infer(plain, micro, outputs=("log_probs",), record_routing=True)
    if recorded is not None:
        rec = recorded["routed_experts"]
        out["recorded_equal"] = all(torch.equal(rec[k, : LENGTHS[i]].long().sort(-1).values, ref["own_routing"][i])
                                    for k, i in enumerate(rows))
    import torch.distributed as dist

    owners = [None] * world  # the owner's recording, for every rank of its model replica (the controller's job)
    dist.all_gather_object(owners, None if recorded is None else (dp_rank, recorded["routed_experts"]))
    routing_back = next(o[1] for o in owners if o is not None and o[0] == dp_rank)
    again = engine.infer(SequenceBatch(plain.input_ids, plain.response_lengths, plain.data, plain.response_width,
                                       routing=routing_back), micro, outputs=("log_probs",))
    if recorded is not None:  # R2's second pass: the recorded routing replayed gives the recording pass's outputs
        out["replay_recorded_err"] = float((again["log_probs"] - recorded["log_probs"]).abs().max())

    def loss(outputs, data):
        return -(outputs["log_probs"] * data["weights"]).sum() / 10.0, {}

    out["grad_norm"] = engine.train_step(batch, micro, loss)["grad_norm"]
    grads = dict(engine.export_hf("main_grad"))
    diff = sum(float((grads[k].double() - g).pow(2).sum()) for k, g in ref["grads"].items() if k in grads)
    norm = sum(float(g.pow(2).sum()) for g in ref["grads"].values())
    out["grad_rel"] = (diff / norm) ** 0.5
    router = [k for k in ref["grads"] if k.endswith("mlp.gate.weight")]
    out["router_grad_rel"] = (sum(float((grads[k].double() - ref["grads"][k]).pow(2).sum()) for k in router)
                              / sum(float(ref["grads"][k].pow(2).sum()) for k in router)) ** 0.5
    out["grad_norm_rel"] = abs(out["grad_norm"] - norm ** 0.5) / norm ** 0.5
    out["grads_missing"] = sorted(set(ref["grads"]) - set(grads))
    out["router_grad"] = sum(float(g.abs().sum()) for k, g in grads.items() if k.endswith("mlp.gate.weight"))
    return out


def _no_replay_engine_refuses(rank, model_dir, ids, routing) -> str:
    from verl_lite.engine import MegatronEngine, SequenceBatch
    from verl_lite.engine.config import EngineConfig, MegatronConfig

    from .conftest import use_layout

    par = MegatronConfig.layout(timeout_s=120.0, ep=2)
    use_layout(rank, 2, par)
    engine = MegatronEngine(EngineConfig(model_dir, par, forward_only=True, optim=None))
    try:
        engine.infer(SequenceBatch(ids[:2], torch.tensor(RESPONSES[:2]), routing=routing[:2]), [[0, 1]])
    except ValueError as e:
        return str(e)
    return "no error"


def _run(rank, world, cases):
    results = [_layout_run(rank, *case) for case in cases]
    model_dir, _, ids, routing, _, _ = cases[0]
    refused = _no_replay_engine_refuses(rank, model_dir, ids, routing) if world == 2 else None
    return {"layouts": results, "refused": refused}


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    """{world size: per-rank results} of one launch per world size."""
    from verl_lite.utils.tiny_model import make_tiny_moe_model

    ids, routing, weights = _problem()
    cases: dict[int, list] = {}
    for arch, layouts in (("qwen3_moe", list(LAYOUTS)), ("qwen2_moe", ["tp2_sp"])):
        model_dir = str(make_tiny_moe_model(tmp_path_factory.mktemp(arch) / "m", arch, num_layers=NUM_LAYERS,
                                            num_experts=NUM_EXPERTS, top_k=TOP_K, seed=5))
        ref = _reference(model_dir, ids, routing, weights)
        for layout in layouts:
            cases.setdefault(LAYOUTS[layout][0], []).append((model_dir, layout, ids, routing, weights, ref))
    return {world: spawn_ranks(_run, world, world_cases, timeout_s=300.0) for world, world_cases in cases.items()}


def test_replayed_routing_gives_the_forced_float64_log_probs_and_gradients(launch):
    layouts = set()
    for world, ranks in launch.items():
        compared = set()
        for rank, res in enumerate(ranks):
            for k, r in enumerate(res["layouts"]):
                layouts.add(r["layout"])
                _check_layout(r, (world, rank, k))
                compared.add(k) if "lp_err" in r else None
        assert compared == set(range(len(ranks[0]["layouts"]))), world  # every layout's outputs read somewhere
    assert layouts == set(LAYOUTS)


def _check_layout(r: dict, where) -> None:
    assert r["grad_rel"] < 1e-5 and r["grad_norm_rel"] < 1e-5 and not r["grads_missing"], (where, r)
    assert r["router_grad_rel"] < 1e-5, (where, r)
    assert r["router_grad"] > 0, (where, r)  # the router learns through the replayed gates
    if "lp_err" in r:
        assert r["lp_err"] < 1e-5 and r["own_lp_err"] < 1e-5, (where, r)
        assert r["forced_vs_own"] > 1e-2, (where, r)  # the forced routing changes the outputs
        assert r["counts_equal"] and r["mismatched"] > 0, (where, r)
        assert r["recorded_equal"] and r["replay_recorded_err"] < 1e-6, (where, r)


def test_routing_for_an_engine_without_replay_is_refused(launch):
    for res in launch[2]:
        assert "SequenceBatch.routing given to an engine built without routing_replay" in res["refused"]
