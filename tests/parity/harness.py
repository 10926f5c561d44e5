"""Parity harness: one optimizer step of the megatron engine under a parallel layout vs a
single-process float64 reference that uses no megatron (HF transformers on the same weights).

The reference (``reference_step``) computes, for one (policy loss, aggregation mode):
  L = actor_loss over the whole mini-batch (one call, plan from the whole mask),
  g = dL/dtheta (float64), the pre-clip global norm, megatron's clip coefficient
  min(1, clip / (|g| + 1e-6)), and the parameters after one AdamW step (decoupled weight decay,
  none on biases and 1-D parameters, as megatron's default param groups).

A layout run (``run_layout``) is one job of the ``world``-process pool (``run_in_pool``: one launch per
world size for the whole parity suite); each rank builds the engine (once per
``calculate_per_token_loss`` value), and for every cell resets the weights, plans micro-batches
with ``controller.planning``, takes one ``train_step`` on its DP share, and exports
``main_grad`` and the parameters through the HF bridge. Rank 0 streams the comparison (global
norm of the difference / global norm) and writes the numbers to JSON; the tests assert them.

References are computed once per problem: one float64 forward serves every (loss, mode) of it
(``policy_references``, ``critic_references``, ``lora_references``: each loss takes its gradient from
the shared graph, and the AdamW step runs on copies of the parameters).
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
# on-policy distillation (algorithms/distillation.py) on top of vanilla PPO: the supervised k3 reverse KL alone, k1
# as a per-token reward (PPO-clip of advantage -d) added to the task's loss, and the top-k forward KL as a loss added
# to the task's (its gradient through the student's log-probs at the teacher's top-k ids) (``distillation_cfg``)
DISTILL_LOSSES = ("distill_k3", "distill_k1_pg", "distill_topk")
TOPK = 4  # the teacher's top k in the distill_topk cells
DISTILL_LAYOUTS = ("single", "dp2", "tp2", "pp2", "cp2")  # DP, TP, PP, CP; micro-batching rotated in each
MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
MB_SCHEMES = ("one", "three", "budget")
TEMPERATURE = 0.9
ENTROPY_COEFF = 0.01
NUM_SEQS = 12

# name -> (world size, MegatronConfig.layout kwargs, use_distributed_optimizer)
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


def engine_config(prob, par, distopt: bool, per_token: bool = False, **kw):
    """The engine under test: ``optim_kwargs``' optimizer on layout ``par``."""
    import dataclasses

    from verl_lite.engine.config import EngineConfig, OptimConfig

    o = optim_kwargs()
    optim = OptimConfig(**{k: o[k] for k in ("lr", "weight_decay", "clip_grad", "lr_warmup_steps", "lr_decay_style")},
                        betas=list(o["betas"]))
    megatron = dataclasses.replace(par, use_distributed_optimizer=distopt, calculate_per_token_loss=per_token,
                                   **kw.pop("megatron", {}))
    return EngineConfig(model_path=prob["model_dir"], megatron=megatron, optim=optim, total_steps=o["total_steps"],
                        adam_eps=o["eps"], **kw)


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


FULL_PRODUCT_LAYOUTS = ("single", "dp2")  # every (loss, mode, per-token, micro-batching) cell


def rotate_micro_batching(cells: list[Cell], offset: int) -> list[Cell]:
    """One cell per (loss, mode, per-token) of ``cells``, its micro-batching rotated: the i-th combination
    (in ``all_cells`` order) runs scheme (i + offset) mod 3. So a layout still runs every loss x mode x
    per-token cell, and every mode with every scheme (its four (per-token, loss) combinations fall on
    schemes m, m+2, m+1, m mod 3); layouts with other offsets run the other schemes of each combination."""
    combos = list(dict.fromkeys((c.loss, c.mode, c.per_token) for c in cells))
    return [Cell(loss, mode, pt, MB_SCHEMES[(i + offset) % len(MB_SCHEMES)]) for i, (loss, mode, pt) in enumerate(combos)]


def cells_for(layout: str) -> list[Cell]:
    """The cells one launch of ``layout`` runs.

    The single process and DP2 run the full product (losses x modes x per-token x micro-batching, and the
    critic's); every other matrix layout runs each loss x mode x per-token cell once with micro-batching
    rotated (``rotate_micro_batching``, offset = the layout's index), so each full-product cell runs in a
    third of them. The two extra layouts (distributed optimizer, sequence parallelism) run a slice.
    """
    if layout == "dp2_distopt":
        cells = [c for c in all_cells() if c.mb == "three" and c.mode in ("token-mean", "seq-mean-token-mean")]
    elif layout == "tp2_sp":
        cells = [c for c in all_cells() if c.mb == "budget" and c.mode in ("token-mean", "seq-mean-token-sum-norm")]
    elif layout in FULL_PRODUCT_LAYOUTS:
        cells = all_cells() + critic_cells()  # the critic's value loss: the same full product
    else:
        offset = list(LAYOUTS).index(layout)
        cells = rotate_micro_batching(all_cells(), offset) + rotate_micro_batching(critic_cells(), offset)
    return cells + lora_cells() + distill_cells(layout)


def distill_cells(layout: str) -> list[Cell]:
    """The distillation losses x five modes x per-token off/on, micro-batching rotated (offset = the layout's
    index), in ``DISTILL_LAYOUTS`` only (the suite's time budget): each layout runs every mode with every scheme."""
    if layout not in DISTILL_LAYOUTS:
        return []
    cells = [Cell(lo, mo, pt, MB_SCHEMES[0]) for pt in (False, True) for lo in DISTILL_LOSSES for mo in MODES]
    return rotate_micro_batching(cells, list(LAYOUTS).index(layout))


# ---------------------------------------------------------------------------------- problem
def make_problem(root: Path) -> Path:
    """Tiny Qwen2 (q/k/v bias, untied) + a ragged batch with one fully masked trajectory and multi-turn
    trajectories (several model segments of different lengths, environment tokens between them)."""
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
    # sequences with prompts of one length share that prompt (the n samples of one prompt in RL): the
    # engine packs a shared prompt once (engine/packing.py), across whatever micro-batches and DP ranks
    # the planner makes; prompts of lengths 7 and 8 stay unique
    for length in (2, 3, 4, 5):
        group = [i for i, p in enumerate(prompt_lens) if p == length]
        for i in group[1:]:
            ids[i][:length] = ids[group[0]][:length]
    width = max(resp_lens)
    mask = torch.zeros(NUM_SEQS, width)
    for i, r in enumerate(resp_lens):
        mask[i, :r] = 1.0
    mask[3, :] = 0.0  # fully masked trajectory
    mask[4, 8:] = 0.0  # a truncated tail inside the response
    mask[9, 2] = 0.0  # a hole
    # multi-turn trajectories: model segments (1) between environment tokens (0: tool responses, user turns)
    mask[0, 4:6] = 0.0  # 4 model tokens, then a tool response ends it (turn limit)
    mask[2, 3:5] = mask[2, 7] = 0.0  # 3 model segments (3, 2, 1 tokens), holes of 2 and 1
    mask[4, 4:6] = 0.0  # 2 model segments (4, 2) then the truncated tail
    mask[6, 2:5] = 0.0  # 2 model segments (2, 2), a hole of 3
    mask[9, 5:7] = 0.0  # with the hole above: 3 model segments (2, 2, 1)
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
        "teacher_noise": 0.5 * torch.randn(NUM_SEQS, width, generator=g),  # the draws above stay as they were
    }
    # a teacher's top k at every position: the k largest log-probs of a random distribution over the vocabulary
    teacher = torch.log_softmax(2.0 * torch.randn(NUM_SEQS, width, 64, generator=g), dim=-1).topk(TOPK, dim=-1)
    prob["teacher_topk_log_probs"], prob["teacher_topk_ids"] = teacher.values * (mask != 0)[..., None], teacher.indices
    path = root / "problem.pt"
    torch.save(prob, path)
    return path


def _hf_model(model_dir: str):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    model.eval()
    return model


def hf_checkpoint_names(model, grads: dict) -> dict:
    """HF's in-memory parameters (experts fused [E, 2I, h] / [E, h, I]) -> checkpoint tensor names."""
    out = {}
    for name, t in grads.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            p = name[: -len("gate_up_proj")]
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2, dim=0)
                out[f"{p}{e}.gate_proj.weight"] = gate
                out[f"{p}{e}.up_proj.weight"] = up
        elif name.endswith("mlp.experts.down_proj"):
            p = name[: -len("down_proj")]
            for e in range(t.shape[0]):
                out[f"{p}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


def reference_outputs(model, prob, temperature=TEMPERATURE, outputs: list | None = None, **model_kwargs):
    """float64 log-probs and entropy [n, W] of the responses, one sequence at a time (no padding).
    ``outputs``: a list that receives each sequence's model output (e.g. its router logits)."""
    logps, ents, _ = _reference_outputs(model, prob, temperature, outputs, **model_kwargs)
    return logps, ents


def reference_outputs_at_topk(model, prob, temperature=TEMPERATURE):
    """float64 log-probs and entropy [n, W] and the log-probs at the teacher's top-k ids [n, W, K]."""
    return _reference_outputs(model, prob, temperature, None, at_ids=prob["teacher_topk_ids"])


def _reference_outputs(model, prob, temperature, outputs, at_ids=None, **model_kwargs):
    width = prob["mask"].shape[1]
    logps, ents, ats = [], [], []
    for i, (ids, r) in enumerate(zip(prob["ids"], prob["resp_lens"].tolist())):
        out = model(ids.unsqueeze(0), **model_kwargs)
        if outputs is not None:
            outputs.append(out)
        logits = out.logits[0] / temperature
        n = ids.numel()
        lp_all = torch.log_softmax(logits, -1)
        scored = lp_all[n - r - 1 : n - 1]
        lp = scored.gather(-1, ids[n - r :].unsqueeze(-1)).squeeze(-1)
        ent = -(scored.exp() * scored).sum(-1)
        logps.append(torch.nn.functional.pad(lp, (0, width - r)))
        ents.append(torch.nn.functional.pad(ent, (0, width - r)))
        if at_ids is not None:
            at = scored.gather(-1, at_ids[i, :r])
            ats.append(torch.cat([at, at.new_zeros(width - r, at.shape[-1])]))
    return torch.stack(logps), torch.stack(ents), torch.stack(ats) if ats else None


def old_log_probs(prob) -> torch.Tensor:
    """Behaviour log-probs: the initial policy's plus noise (ratios spread over the clip range)."""
    model = _hf_model(prob["model_dir"])
    with torch.no_grad():
        lp, _ = reference_outputs(model, prob)
    return (lp + prob["noise"].double()) * (prob["mask"] != 0)


def teacher_log_probs(prob, old_lp: torch.Tensor) -> torch.Tensor:
    """The distillation teacher's log-probs of the sampled tokens: the behaviour log-probs plus noise, masked."""
    return (old_lp.double() + prob["teacher_noise"].double()) * (prob["mask"] != 0)


def loss_cfg(loss: str, mode: str):
    from verl_lite.algorithms import ActorLossConfig, PolicyLossConfig

    policy_loss = "vanilla" if loss in DISTILL_LOSSES else loss
    return ActorLossConfig(policy_loss=PolicyLossConfig(loss_mode=policy_loss), loss_agg_mode=mode,
                           entropy_coeff=ENTROPY_COEFF)


def distillation_cfg(loss: str):
    """The ``distillation.distillation_loss`` section of a distillation cell (None for the other losses)."""
    from verl_lite.algorithms.config import DistillationLossConfig

    if loss == "distill_k3":
        return DistillationLossConfig(loss_mode="k3", use_policy_gradient=False, use_task_rewards=False)
    if loss == "distill_k1_pg":
        return DistillationLossConfig(loss_mode="k1", use_policy_gradient=True, use_task_rewards=True,
                                      distillation_loss_coef=0.5, clip_ratio_low=0.15, clip_ratio_high=0.25)
    if loss == "distill_topk":
        return DistillationLossConfig(loss_mode="forward_kl_topk", topk=TOPK, use_policy_gradient=False,
                                      use_task_rewards=True, distillation_loss_coef=0.5)
    return None


def student_outputs(loss: str) -> dict:
    """The engine's ``train_step`` output keywords a cell's loss needs (the student at the teacher's top-k ids)."""
    if loss != "distill_topk":
        return {}
    return {"outputs": ("log_probs", "entropy", "log_probs_at"), "ids_key": "teacher_topk_ids"}


def reference_step(prob, loss: str, mode: str, old_lp: torch.Tensor) -> dict:
    """One (policy loss, mode)'s reference (its own forward; :func:`policy_references` shares one)."""
    return policy_references(prob, [(loss, mode)], old_lp=old_lp)[1][(loss, mode)]


def policy_references(prob, specs, old_lp: torch.Tensor | None = None, noise: torch.Tensor | None = None):
    """(old log-probs, {(loss, mode): reference step}) from ONE float64 forward of the HF model: the loss of
    each spec is a function of the same log-probs / entropy, so each takes its gradient from the shared
    graph. ``old_lp`` None: the behaviour log-probs are this forward's plus ``noise`` (default prob["noise"]),
    masked, as :func:`old_log_probs`."""
    from verl_lite.algorithms.aggregation import NormalizationPlan
    from verl_lite.algorithms.objective import actor_loss

    model = _hf_model(prob["model_dir"])
    params = dict(model.named_parameters())
    lp, ent, at = reference_outputs_at_topk(model, prob)
    mask = prob["mask"].double()
    if old_lp is None:
        old_lp = (lp.detach() + (prob["noise"] if noise is None else noise).double()) * (prob["mask"] != 0)
    data = {"response_mask": mask, "old_log_probs": old_lp.double(), "advantages": prob["advantages"].double(),
            "teacher_log_probs": teacher_log_probs(prob, old_lp),
            "teacher_topk_log_probs": prob["teacher_topk_log_probs"].double(),
            "teacher_topk_ids": prob["teacher_topk_ids"]}
    refs = {}
    for k, (loss, mode) in enumerate(specs):
        L, _ = actor_loss({"log_probs": lp, "entropy": ent, "log_probs_at": at}, data,
                          NormalizationPlan.from_mask(mask, mode),
                          loss_cfg(loss, mode), distillation=distillation_cfg(loss))
        refs[(loss, mode)] = {**reference_update(params, L, retain_graph=k + 1 < len(specs)),
                              "log_probs": lp.detach(), "entropy": ent.detach()}
    return old_lp, refs


def reference_update(params: dict, L: torch.Tensor, retain_graph: bool = False) -> dict:
    """dL/dparams, the global grad norm clipped as megatron clips it, one AdamW step (float64) on copies
    of the parameters (the model is left as it is, so several losses can share its forward).

    Weight decay on matrices only (not biases / norms), as megatron's optimizer groups it."""
    o = optim_kwargs()
    names = list(params)
    grads = dict(zip(names, (g.detach() for g in torch.autograd.grad(L, [params[k] for k in names],
                                                                     retain_graph=retain_graph))))
    norm = torch.sqrt(sum((g**2).sum() for g in grads.values()))
    coef = min(1.0, o["clip_grad"] / (float(norm) + 1e-6))
    before = {k: p.detach().clone() for k, p in params.items()}
    work = {k: torch.nn.Parameter(before[k].clone()) for k in names}
    for k in names:
        work[k].grad = grads[k] * coef
    decay = [work[k] for k in names if work[k].ndim > 1 and not k.endswith(".bias")]
    no_decay = [work[k] for k in names if not (work[k].ndim > 1 and not k.endswith(".bias"))]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": o["weight_decay"]}, {"params": no_decay, "weight_decay": 0.0}],
        lr=o["lr"], betas=o["betas"], eps=o["eps"],
    )
    opt.step()
    return {
        "loss": float(L.detach()),
        "grad_norm": float(norm),
        "grads_clipped": {k: g * coef for k, g in grads.items()},
        "params_before": before,
        "params_after": {k: p.detach().clone() for k, p in work.items()},
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
    return critic_references(prob, [mode])[mode]


def critic_references(prob, modes) -> dict:
    """{mode: critic reference step} from one float64 forward (the values), as :func:`policy_references`."""
    from verl_lite.algorithms.aggregation import NormalizationPlan
    from verl_lite.algorithms.objective import critic_loss

    model = _hf_model(prob["model_dir"])
    score = torch.nn.Parameter(prob["score_weight"].double().clone())
    params = {f"model.{k}": p for k, p in model.model.named_parameters()}
    params["score.weight"] = score
    values = reference_values(model, score, prob)
    mask = prob["mask"].double()
    data = {"response_mask": mask, "old_values": prob["old_values"].double(), "returns": prob["returns"].double()}
    out = {}
    for k, mode in enumerate(modes):
        L, _ = critic_loss({"values": values}, data, NormalizationPlan.from_mask(mask, mode), CLIPRANGE_VALUE)
        out[mode] = {**reference_update(params, L, retain_graph=k + 1 < len(modes)), "values": values.detach()}
    return out


def make_references(root: Path, problem_path: Path) -> Path:
    """Every float64 reference of the dense matrix: one forward for the 2 x 5 policy cells and the 2 x 5
    distillation cells (and the old log-probs), one for the 5 critic modes, one for the LoRA modes."""
    prob = torch.load(problem_path)
    old_lp, policy = policy_references(prob, [(loss, mode) for loss in LOSSES + DISTILL_LOSSES for mode in MODES])
    refs = {"old_log_probs": old_lp, "lora_dir": str(make_lora_adapter(root, prob["model_dir"]))}
    refs.update(lora_references(prob, refs["lora_dir"], sorted({c.mode for c in lora_cells()}), old_lp))
    refs.update(policy)
    refs.update({("critic", mode): ref for mode, ref in critic_references(prob, MODES).items()})
    path = root / "refs.pt"
    torch.save(refs, path)
    return path


# ---------------------------------------------------------------------------------- LoRA
# Adapters on every linear (q, k, v, o, gate, up, down), rank 4, alpha 8, factors drawn at random (B != 0,
# so every A gets a gradient) and saved by peft; the reference is peft's LoRA on the HF model in float64.
LORA_RANK, LORA_ALPHA = 4, 8.0
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def lora_cells() -> list[Cell]:
    """Two LoRA cells per layout (vanilla PPO): token-mean / 3 micro-batches, and per-token
    seq-mean-token-mean / token budget."""
    return [Cell("lora", "token-mean", False, "three"), Cell("lora", "seq-mean-token-mean", True, "budget")]


def make_lora_adapter(root: Path, model_dir: str) -> Path:
    """A PEFT adapter directory saved by peft itself, with random A and B (std 0.1, seeded)."""
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    pm = peft.get_peft_model(model, peft.LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                                                    target_modules=list(LORA_TARGETS)))
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    out = root / "lora_adapter"
    pm.save_pretrained(str(out))
    return out


def peft_model(model_dir: str, adapter_dir, dtype=torch.float64):
    """HF model + the PEFT adapter (peft's own loading), adapters trainable, base frozen."""
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model = peft.PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=True)
    model.eval()
    return model


def lora_reference_step(prob, lora_dir, mode: str, old_lp: torch.Tensor) -> dict:
    """``reference_step`` for the adapters: gradients and one AdamW step of the PEFT factors only
    (named as peft saves them), the base frozen."""
    return lora_references(prob, lora_dir, [mode], old_lp)[("lora", mode)]


def lora_references(prob, lora_dir, modes, old_lp: torch.Tensor) -> dict:
    """{("lora", mode): reference step} from one float64 forward of peft's model (vanilla PPO)."""
    from verl_lite.algorithms.aggregation import NormalizationPlan
    from verl_lite.algorithms.objective import actor_loss

    model = peft_model(prob["model_dir"], lora_dir)
    params = {k.replace(".default.weight", ".weight"): p for k, p in model.named_parameters() if p.requires_grad}
    assert params and all("lora_" in k for k in params)
    lp, ent = reference_outputs(model, prob)
    mask = prob["mask"].double()
    data = {"response_mask": mask, "old_log_probs": old_lp.double(), "advantages": prob["advantages"].double()}
    out = {}
    for k, mode in enumerate(modes):
        L, _ = actor_loss({"log_probs": lp, "entropy": ent}, data, NormalizationPlan.from_mask(mask, mode),
                          loss_cfg("vanilla", mode))
        out[("lora", mode)] = {**reference_update(params, L, retain_graph=k + 1 < len(modes)), "log_probs": lp.detach()}
    return out


def lora_engine_config(prob, lora_dir, par, per_token: bool, distopt: bool):
    from verl_lite.engine.config import LoraConfig

    lora = LoraConfig(rank=LORA_RANK, alpha=LORA_ALPHA, dropout=0.0, target_modules=list(LORA_TARGETS),
                      exclude_modules=[], adapter_path=str(lora_dir))
    return engine_config(prob, par, distopt, per_token, lora=lora)


def base_gradient_report(engine) -> dict:
    """What the frozen base holds after a step: parameters that train or carry a gradient (none
    expected), and the adapter vs trainable element counts on this rank."""
    from verl_lite.engine.lora import is_adapter_name
    from verl_lite.engine.model import unwrap_model

    with_grad, trainable, adapter = [], 0, 0
    for chunk in engine.chunks:
        for name, p in unwrap_model(chunk).named_parameters():
            if is_adapter_name(name):
                adapter += p.numel()
            elif p.requires_grad or getattr(p, "main_grad", None) is not None or p.grad is not None:
                with_grad.append(name)
            trainable += p.numel() if p.requires_grad else 0
    return {"base_with_grad": with_grad, "trainable": trainable, "adapter": adapter}


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


def load_problem(problem_path, refs_path):
    """A layout run's inputs: the problem and its float64 references (both written by the test), the
    sequence lengths, and the actor's per-token data in fp32 (response mask, old log-probs, advantages, the
    teacher's log-probs, its top-k log-probs and their ids)."""
    prob, refs = torch.load(problem_path), torch.load(refs_path)
    lengths = [int(x.numel()) for x in prob["ids"]]
    data_all = {"response_mask": prob["mask"], "old_log_probs": refs["old_log_probs"].float(),
                "advantages": prob["advantages"].float(),
                "teacher_log_probs": teacher_log_probs(prob, refs["old_log_probs"]).float(),
                "teacher_topk_log_probs": prob["teacher_topk_log_probs"].float(),
                "teacher_topk_ids": prob["teacher_topk_ids"]}
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
    from verl_lite.engine.config import EngineConfig, OptimConfig
    from verl_lite.engine.distributed import init_distributed
    from verl_lite.engine.config import MegatronConfig
    from verl_lite.engine.engine import MegatronEngine

    t_start = time.perf_counter()
    _, par_kw, distopt = LAYOUTS[layout_name]
    par = MegatronConfig.layout(**par_kw, timeout_s=timeout_s)
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
            todo = [c for c in cells if c.per_token == per_token and (c.loss == "critic") == critic and c.loss != "lora"]
            if not todo:
                continue
            t0 = time.perf_counter()
            cfg = engine_config(prob, par, distopt, per_token, value_head=critic)
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
                    loss_fn = partial(actor_loss, plan=nplan, cfg=loss_cfg(cell.loss, cell.mode),
                                      distillation=distillation_cfg(cell.loss))
                out = engine.train_step(batch, mbs, loss_fn, temperature=TEMPERATURE,
                                        global_token_count=sum(lengths), **student_outputs(cell.loss))
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
    _run_lora_cells([c for c in cells if c.loss == "lora"], rank, world, par, distopt, prob, refs, lengths,
                    data_all, dp, dp_rank, vpp_multiple, results)
    timeline["total"] = time.perf_counter() - t_start
    if rank == 0:
        Path(out_path).write_text(json.dumps(results))
    end_job()


def _run_lora_cells(cells, rank, world, par, distopt, prob, refs, lengths, data_all, dp, dp_rank, vpp_multiple,
                    results) -> None:
    """The layout's LoRA cells: one engine per per-token value, the adapters reset from the PEFT adapter
    before each cell; the adapters' gradients and parameters vs ``lora_reference_step``, and the base's
    (``base_gradient_report``)."""
    import torch.distributed as dist

    from verl_lite.algorithms.aggregation import NormalizationPlan
    from verl_lite.algorithms.objective import actor_loss
    from verl_lite.engine.engine import MegatronEngine

    for per_token in (False, True):
        todo = [c for c in cells if c.per_token == per_token]
        if not todo:
            continue
        t0 = time.perf_counter()
        engine = MegatronEngine(lora_engine_config(prob, refs["lora_dir"], par, per_token, distopt))
        results["timeline"][f"build lora pt={per_token}"] = time.perf_counter() - t0
        for cell in todo:
            t0 = time.perf_counter()
            engine.load_adapter(refs["lora_dir"])
            t1 = time.perf_counter()
            plan = _plan(lengths, dp, cell.mb, vpp_multiple)
            _, batch, mbs = rank_share(prob, data_all, plan, dp_rank)
            nplan = NormalizationPlan.from_mask(prob["mask"], cell.mode)
            loss_fn = partial(actor_loss, plan=nplan, cfg=loss_cfg("vanilla", cell.mode))
            out = engine.train_step(batch, mbs, loss_fn, temperature=TEMPERATURE, global_token_count=sum(lengths))
            t2 = time.perf_counter()
            ref = refs[("lora", cell.mode)]
            grads = None if distopt else _compare(engine.export_adapter("main_grad").items(), ref["grads_clipped"])
            upd = _compare(engine.export_adapter("param").items(), ref["params_after"], base=ref["params_before"])
            base = [None] * world
            dist.all_gather_object(base, base_gradient_report(engine))
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
                    "base_with_grad": sorted({n for b in base for n in b["base_with_grad"]}),
                    "trainable_is_adapter": all(b["trainable"] == b["adapter"] > 0 for b in base),
                }
        del engine


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
    """Run all cells of a layout in the ``world``-process pool (:func:`run_in_pool`); rank 0's JSON results."""
    world = LAYOUTS[layout_name][0]
    out_path = Path(tempfile.mkdtemp(prefix=f"parity_{layout_name}_")) / "result.json"
    run_in_pool(world, f"layout {layout_name}", _worker_body,
                (layout_name, [asdict(c) for c in cells], str(problem_path), str(refs_path), str(out_path), timeout_s))
    return json.loads(out_path.read_text())


# ---------------------------------------------------------------------------------- process pool
# A parity layout needs a fresh megatron decomposition, not fresh processes: ``init_distributed`` on an
# initialised process keeps the default (gloo) group and rebuilds megatron's groups. So every world size
# gets ONE launch of ``world`` processes that runs the layouts of that size one after another, for all three
# parity modules (the conftest orders the tests by world size, so each pool is started once and closed
# when the next size starts). A job is ``body(rank, world, port, *args)``; it writes its own results and
# ends with ``parallel_state.destroy_model_parallel()``. Any failure (an exception on a rank, a dead
# process, the deadline) closes the pool and raises with every rank's traceback; the next job starts a
# fresh one. Every wait is bounded: each collective by the layout's ``timeout_s``, a job by JOB_DEADLINE_S.
JOB_DEADLINE_S = 840.0  # under the suite's 900 s per-test timeout
FAILED_RANKS_GRACE_S = 20.0  # after one rank fails, how long the others get to report theirs


def _pool_main(rank: int, world: int, port: int, jobs, replies) -> None:
    torch.set_num_threads(1)
    while True:
        job = jobs.get()
        if job is None:
            break
        body, args = job
        try:
            body(rank, world, port, *args)
            replies.put((rank, None))
        except BaseException:
            replies.put((rank, traceback.format_exc()))
            return  # the groups may be broken: this pool is closed by the parent
    from verl_lite.engine.distributed import destroy_distributed

    destroy_distributed()


class RankPool:
    """``world`` spawned processes that run parity jobs (see above)."""

    def __init__(self, world: int):
        from tests.fork_ranks import context, with_launch_env

        os.environ.setdefault("OMP_NUM_THREADS", "1")
        ctx = context()  # ranks forked from a server that imported torch and megatron once (tests/fork_ranks.py)
        self.world, self.port, self.launched = world, free_port(), time.perf_counter()
        self.jobs = [ctx.Queue() for _ in range(world)]
        self.replies = ctx.Queue()
        self.procs = [ctx.Process(target=with_launch_env, daemon=True, args=(
            r, dict(os.environ), _pool_main, (world, self.port, self.jobs[r], self.replies))) for r in range(world)]
        for proc in self.procs:
            proc.start()
        self.alive = True

    def run(self, what: str, body, args: tuple, deadline_s: float = JOB_DEADLINE_S) -> None:
        import queue

        for q in self.jobs:
            q.put((body, args))
        errors, done, end = {}, set(), time.monotonic() + deadline_s
        while len(done) < self.world:
            if errors:
                end = min(end, time.monotonic() + FAILED_RANKS_GRACE_S)
            try:
                rank, err = self.replies.get(timeout=max(0.1, min(5.0, end - time.monotonic())))
                done.add(rank)
                if err is not None:
                    errors[rank] = err
                continue
            except queue.Empty:
                pass
            dead = [r for r, p in enumerate(self.procs) if not p.is_alive() and r not in done]
            if dead and not errors:
                errors.update({r: f"process exited with code {self.procs[r].exitcode}" for r in dead})
            if time.monotonic() >= end:
                missing = sorted(set(range(self.world)) - done - set(errors))
                if not errors:
                    errors.update({r: f"no reply within {deadline_s:.0f} s" for r in missing})
                break
        if errors:
            self.close(kill=True)  # a rank may sit in a collective its failed peer never joins
            detail = "\n".join(f"--- rank {r}\n{e[-3000:]}" for r, e in sorted(errors.items()))
            raise RuntimeError(f"{what} failed ({self.world} processes):\n{detail}")

    def close(self, kill: bool = False, grace_s: float = 30.0) -> None:
        """Stop the processes: ask them to exit (``kill``: do not ask), kill what is left after ``grace_s``."""
        if not self.alive:
            return
        self.alive = False
        if not kill:
            for q in self.jobs:
                q.put(None)
            end = time.monotonic() + grace_s
            for proc in self.procs:
                proc.join(timeout=max(0.0, end - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=10)


_POOL: RankPool | None = None
LAUNCHES: list[int] = []  # world size of every pool started this session (the summary prints them)


def run_in_pool(world: int, what: str, body, args: tuple) -> None:
    """Run ``body(rank, world, port, *args)`` on every rank of the ``world``-process pool (started here,
    closing the pool of another size, which the test order has finished with)."""
    global _POOL
    if _POOL is not None and (_POOL.world != world or not _POOL.alive):
        _POOL.close()
        _POOL = None
    if _POOL is None:
        _POOL = RankPool(world)
        LAUNCHES.append(world)
    _POOL.run(what, body, args)


def close_pool() -> None:
    global _POOL
    if _POOL is not None:
        _POOL.close()
        _POOL = None


def end_job() -> None:
    """A job's last step on every rank: wait for the others, drop megatron's groups (the default group stays)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    dist.barrier()
    ps.destroy_model_parallel()


def layout_world(layouts: dict, name) -> int:
    """World size of a layout name of ``layouts`` (0 for anything else): the conftest's test order."""
    return layouts[name][0] if isinstance(name, str) and name in layouts else 0
