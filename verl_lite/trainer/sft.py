"""Supervised fine-tuning (SFT) on the megatron engine, single process; used to warm-start the shipped model.

Each example is a prompt of an RL parquet file and a target response + EOS (``extra_info[response_key]``, else
the ground truth). One optimizer step over a batch minimizes the token-mean NLL of the response tokens,

    L = - sum_{i,t} m_i,t log p(y_i,t | x_i, y_i,<t) / N,    N = sum_{i,t} m_i,t,

through ``NormalizationPlan("token-mean")`` of the whole batch: the gradient does not depend on the
micro-batches. Validation is greedy accuracy (``HFRollout``, the built-in reward); ``target_accuracy`` stops at
the first evaluation reaching it (how the shipped checkpoint is kept partial: room for RL).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from verl_lite.algorithms import NormalizationPlan
from verl_lite.data import RLDataset
from verl_lite.engine import EngineConfig, MegatronConfig, MegatronEngine, OptimConfig, SequenceBatch, init_distributed
from verl_lite.engine.distributed import destroy_distributed
from verl_lite.reward import default_compute_score
from verl_lite.rollout import HFRollout
from verl_lite.trainer.checkpointing import DataCursor
from verl_lite.utils.net import free_port as _free_port


@dataclass
class SFTConfig:
    model_path: str  # HF model dir to start from (tokenizer files included)
    out_dir: str  # where the final HF model + tokenizer are written
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    max_prompt_length: int = 32
    response_key: str | None = None  # extra_info field holding the target response; None = ground truth
    steps: int = 1000  # optimizer steps at most
    batch_size: int = 64  # examples per optimizer step
    micro_batch_size: int = 64  # examples per micro-batch (never changes the math)
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.99)
    lr_warmup_steps: int = 0
    lr_decay_style: str = "constant"
    min_lr: float = 0.0
    eval_every: int = 100  # steps between greedy validation runs (0: only at the end)
    max_new_tokens: int = 12  # generation budget during validation
    target_accuracy: float | None = None  # stop at the first validation with accuracy >= this
    seed: int = 0
    log: bool = True


def sft_examples(dataset, tokenizer, response_key: str | None = None) -> list[tuple[list[int], list[int]]]:
    """(prompt_ids, response_ids) pairs: response = tokens of extra_info[response_key] (or ground truth) + EOS."""
    eos = tokenizer.eos_token_id
    out = []
    for it in dataset:
        if response_key is None:
            text = str(it["ground_truth"])
        elif response_key in it["extra_info"]:
            text = str(it["extra_info"][response_key])
        else:
            raise KeyError(f"SFT row {it['index']} has no extra_info[{response_key!r}]; set SFTConfig.response_key=None "
                           f"to train on the ground truth")
        out.append((it["prompt_ids"], tokenizer.encode(text, add_special_tokens=False) + [eos]))
    return out


def make_sequence_batch(examples: list[tuple[list[int], list[int]]]):
    """SequenceBatch of prompt+response with data["response_mask"] [n, W] (W = longest response)."""
    lengths = torch.tensor([len(r) for _, r in examples])
    mask = (torch.arange(int(lengths.max()))[None, :] < lengths[:, None]).float()
    return SequenceBatch(input_ids=[torch.tensor(p + r, dtype=torch.long) for p, r in examples],
                         response_lengths=lengths, data={"response_mask": mask}, response_width=mask.shape[1])


def nll_loss_fn(plan):
    """loss_fn for engine.train_step: the plan-aggregated NLL contribution of one micro-batch."""

    def loss_fn(outputs, data):
        mask = data["response_mask"]
        nll = -outputs["log_probs"]
        return plan.aggregate(nll, mask), {"nll": plan.token_mean(nll.detach(), mask)}

    return loss_fn


def sft_step(engine, examples, micro_batch_size: int) -> dict:
    """One optimizer step of token-mean NLL over `examples` (one process, DP = 1)."""
    engine.advance_lr_schedule()  # SFT's schedule counts optimizer steps
    batch = make_sequence_batch(examples)
    plan = NormalizationPlan.from_mask(batch.data["response_mask"], "token-mean")
    idx = list(range(len(examples)))
    micro = [idx[i:i + micro_batch_size] for i in range(0, len(idx), micro_batch_size)]
    return engine.train_step(batch, micro, nll_loss_fn(plan), outputs=("log_probs",))


def greedy_accuracy(rollout, dataset, max_new_tokens: int, batch_size: int = 256) -> float:
    """Mean built-in reward of greedy responses over the dataset."""
    total = 0.0
    for s in range(0, len(dataset), batch_size):
        items = [dataset[j] for j in range(s, min(s + batch_size, len(dataset)))]
        outs = rollout.generate([it["prompt_ids"] for it in items], n=1, do_sample=False, max_new_tokens=max_new_tokens)
        for it, o in zip(items, outs):
            text = rollout.tokenizer.decode(o["response_ids"], skip_special_tokens=True)
            total += default_compute_score(it["data_source"], text, it["ground_truth"], it["extra_info"])
    return total / len(dataset)


def run_sft(cfg: SFTConfig) -> dict:
    """Train, validate, write the final HF model + tokenizer to cfg.out_dir; return the history."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(cfg.model_path)
    train = RLDataset(cfg.train_files, tok, cfg.max_prompt_length, verbose=cfg.log)
    val = RLDataset(cfg.val_files, tok, cfg.max_prompt_length, verbose=cfg.log) if cfg.val_files else None
    examples = sft_examples(train, tok, cfg.response_key)

    init_distributed(0, 1, "127.0.0.1", _free_port(), MegatronConfig(), seed=cfg.seed)
    try:
        optim = OptimConfig(lr=cfg.lr, weight_decay=cfg.weight_decay, betas=list(cfg.betas),
                            lr_warmup_steps=cfg.lr_warmup_steps, lr_decay_style=cfg.lr_decay_style, min_lr=cfg.min_lr)
        engine = MegatronEngine(EngineConfig(model_path=cfg.model_path, optim=optim, total_steps=max(cfg.steps, 1),
                                             seed=cfg.seed))
        rollout = HFRollout(cfg.model_path, tok) if val is not None else None
        history: list[dict] = []
        t0 = time.time()

        def evaluate() -> float | None:
            if rollout is None:
                return None
            rollout.load_weights(engine.export_hf())
            return greedy_accuracy(rollout, val, cfg.max_new_tokens)

        batches = DataCursor(list(range(len(examples))), cfg.batch_size, shuffle=True, seed=cfg.seed)  # every epoch
        for step, idx in enumerate(batches, start=1):
            m = sft_step(engine, [examples[j] for j in idx], cfg.micro_batch_size)
            rec = {"step": step, "nll": m.get("nll"), "grad_norm": m["grad_norm"], "lr": m["lr"],
                   "time_s": round(time.time() - t0, 1)}
            last = step >= cfg.steps
            if (cfg.eval_every and step % cfg.eval_every == 0) or last:
                rec["val_accuracy"] = evaluate()
                if cfg.log:
                    print(f"[sft] step {step} nll {rec['nll']:.4f} val_acc {rec['val_accuracy']} "
                          f"t {rec['time_s']}s", flush=True)
                if cfg.target_accuracy is not None and (rec["val_accuracy"] or 0.0) >= cfg.target_accuracy:
                    last = True
            history.append(rec)
            if last:
                break

        out = Path(cfg.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        final = HFRollout(cfg.model_path, tok)
        final.load_weights(engine.export_hf(), strict=True)
        final.model.save_pretrained(out, safe_serialization=True)
        tok.save_pretrained(out)
        summary = {"config": asdict(cfg), "steps": step,
                   "final_val_accuracy": next((h["val_accuracy"] for h in reversed(history) if "val_accuracy" in h), None),
                   "history": [h for h in history if "val_accuracy" in h]}
        (out / "sft_summary.json").write_text(json.dumps(summary, indent=1, default=str))
        return summary
    finally:
        destroy_distributed()
