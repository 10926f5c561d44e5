"""Build the shipped tiny reward model: verl_lite/assets/tiny-addition-rm (docs/reward_models.md).

A Qwen2ForSequenceClassification (one logit) that prefers correct sums on the synthetic addition
task, trained on the megatron engine (a value-head engine, ``engine.train_step``) with the project's
own data and rollout:

1. the body starts from the shipped tiny policy (verl_lite/assets/tiny-addition; its LM head is
   dropped, ``score.weight`` starts at zero);
2. responses to score: the tiny policy's own samples (``HFRollout``, temperature 1, n per prompt) on
   the SFT prompts (``synthetic-addition/sft_train.parquet``; its pairs are disjoint from the val
   split), plus constructed ones per prompt (the bare sum, the restated "a+b=c", a near-miss sum, the
   same restated, a random sum);
   each is labelled by the task's strict verifier (1 = the bare correct sum, else 0);
3. the objective of one optimizer step over a batch of B responses is the mean squared error of the
   score at the last token against the label, L = (1/B) sum_i (r_i - y_i)^2 (so scores live on the
   verifier's 0..1 scale and PPO sees the same reward scale as with the rule);
4. evaluation on held-out prompts (the val split, the policy's samples): accuracy of r > 0.5 against
   the verifier, and the correct fraction of the RM's best-of-n choice vs a random choice.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/make_tiny_rm.py
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def init_rm(policy: Path, out: Path) -> Path:
    """The policy's body + a zero score head as an HF sequence-classification checkpoint (one logit)."""
    import torch
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(policy)
    cfg.num_labels, cfg.architectures = 1, ["Qwen2ForSequenceClassification"]
    cfg.id2label, cfg.label2id = {0: "score"}, {"score": 0}
    rm = transformers.AutoModelForSequenceClassification.from_config(cfg, dtype=torch.float32)
    lm = transformers.AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    missing, _ = rm.load_state_dict(lm.state_dict(), strict=False)
    assert missing == ["score.weight"], missing
    with torch.no_grad():
        rm.score.weight.zero_()
    rm.save_pretrained(out, safe_serialization=True)
    transformers.AutoTokenizer.from_pretrained(policy).save_pretrained(out)
    return out


def constructed(a: int, b: int, rng: random.Random) -> list[str]:
    """Responses every prompt gets besides the policy's samples: right, restated, near misses."""
    c = a + b
    wrong = rng.choice([d for d in (c - 10, c - 1, c + 1, c + 10, c + rng.randint(2, 9)) if d >= 0 and d != c])
    far = rng.choice([d for d in range(0, 199) if d != c])
    return [str(c), f"{a}+{b}={c}", str(wrong), f"{a}+{b}={wrong}", str(far)]


def scored_examples(dataset, rollout, tok, n: int, max_new_tokens: int, seed: int, extra: bool):
    """(prompt_ids, response_ids, label) for the policy's n samples per prompt (+ the constructed ones)."""
    from verl_lite.reward import default_compute_score

    rng = random.Random(seed)
    items = [dataset[i] for i in range(len(dataset))]
    out = []
    for s in range(0, len(items), 256):
        chunk = items[s:s + 256]
        outs = rollout.generate([it["prompt_ids"] for it in chunk], n=n, do_sample=True, temperature=1.0,
                                max_new_tokens=max_new_tokens, seed=seed + s)
        for k, o in enumerate(outs):
            it = chunk[k // n]
            text = tok.decode(o["response_ids"], skip_special_tokens=True)
            label = default_compute_score(it["data_source"], text, it["ground_truth"], it["extra_info"])
            out.append((it["prompt_ids"], list(o["response_ids"]), float(label), k % n))
        if extra:
            for it in chunk:
                for text in constructed(it["extra_info"]["a"], it["extra_info"]["b"], rng):
                    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
                    label = default_compute_score(it["data_source"], text, it["ground_truth"], it["extra_info"])
                    out.append((it["prompt_ids"], ids, float(label), -1))
    return out


def sequence_batch(examples, placeholder: int = 0):
    """RM inputs as the reward-model role sends them: prompt + response + one placeholder 'response'
    token whose value-head output is the score at the last real token (workers/reward_model.py)."""
    import torch

    from verl_lite.engine import SequenceBatch

    return SequenceBatch(input_ids=[torch.tensor(list(p) + list(r) + [placeholder]) for p, r, *_ in examples],
                         response_lengths=torch.ones(len(examples), dtype=torch.long),
                         data={"label": torch.tensor([[e[2]] for e in examples])}, response_width=1)


def mse_loss_fn(batch_size: int):
    """loss_fn for engine.train_step: this micro-batch's share of (1/B) sum_i (r_i - y_i)^2."""

    def loss_fn(outputs, data):
        err = (outputs["values"] - data["label"]).pow(2).sum() / batch_size
        return err, {"mse": err.detach()}

    return loss_fn


def rm_scores(engine, examples, micro: int = 256):
    import torch

    out = []
    for s in range(0, len(examples), micro):
        chunk = examples[s:s + micro]
        res = engine.infer(sequence_batch(chunk), [list(range(len(chunk)))], outputs=("values",))
        out.append(res["values"][:, 0])
    return torch.cat(out)


def evaluate(engine, examples, n: int) -> dict:
    """Pointwise accuracy vs the verifier; best-of-n by the RM vs a random pick, over the policy samples."""
    import torch

    sampled = [e for e in examples if e[3] >= 0]
    scores = rm_scores(engine, sampled)
    labels = torch.tensor([e[2] for e in sampled])
    groups = scores.view(-1, n), labels.view(-1, n)
    best = groups[1].gather(1, groups[0].argmax(1, keepdim=True)).mean()
    constructed_ex = [e for e in examples if e[3] < 0]
    c_scores = rm_scores(engine, constructed_ex)
    c_labels = torch.tensor([e[2] for e in constructed_ex])
    return {"pointwise_accuracy": float(((scores > 0.5).float() == labels).float().mean()),
            "sample_correct_fraction": float(labels.mean()),
            "best_of_n_correct": float(best),
            "constructed_accuracy": float(((c_scores > 0.5).float() == c_labels).float().mean()),
            "score_mean_correct": float(scores[labels == 1].mean()) if (labels == 1).any() else None,
            "score_mean_wrong": float(scores[labels == 0].mean()) if (labels == 0).any() else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--policy", default=str(ROOT / "verl_lite/assets/tiny-addition"))
    ap.add_argument("--data-dir", default=str(ROOT / "verl_lite/assets/synthetic-addition"))
    ap.add_argument("--out", default=str(ROOT / "verl_lite/assets/tiny-addition-rm"))
    ap.add_argument("--n-prompts", type=int, default=6000, help="SFT prompts whose responses are scored")
    ap.add_argument("--samples", type=int, default=4, help="policy samples per prompt")
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--eval-every", type=int, default=300)
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import tempfile

    import pandas as pd
    import torch
    import transformers

    torch.set_num_threads(1)
    from verl_lite.data import RLDataset
    from verl_lite.engine import MegatronEngine, init_distributed
    from verl_lite.engine.distributed import destroy_distributed
    from verl_lite.rollout import HFRollout
    from verl_lite.utils.net import free_port
    from verl_lite.engine.config import EngineConfig, MegatronConfig, OptimConfig

    t0 = time.time()
    tmp = Path(tempfile.mkdtemp(prefix="tiny_rm_"))
    init = init_rm(Path(args.policy), tmp / "init")
    tok = transformers.AutoTokenizer.from_pretrained(args.policy)
    sft = pd.read_parquet(Path(args.data_dir) / "sft_train.parquet").iloc[: args.n_prompts]
    sft.to_parquet(tmp / "rm_train.parquet")
    train = RLDataset([str(tmp / "rm_train.parquet")], tok, 32, verbose=False)
    val = RLDataset([str(Path(args.data_dir) / "val.parquet")], tok, 32, verbose=False)
    rollout = HFRollout(args.policy, tok)
    train_ex = scored_examples(train, rollout, tok, args.samples, args.max_new_tokens, args.seed, extra=True)
    val_ex = scored_examples(val, rollout, tok, args.samples, args.max_new_tokens, args.seed + 1, extra=True)
    print(f"[rm] {len(train_ex)} train / {len(val_ex)} val responses, positives "
          f"{sum(e[2] for e in train_ex) / len(train_ex):.3f}, {time.time() - t0:.0f}s", flush=True)

    init_distributed(0, 1, "127.0.0.1", free_port(), MegatronConfig.layout(), seed=args.seed)
    try:
        optim = OptimConfig(lr=args.lr, lr_decay_style="cosine", min_lr=args.lr / 10)
        engine = MegatronEngine(EngineConfig(model_path=str(init), optim=optim, total_steps=args.steps, seed=args.seed,
                                             value_head=True))
        history = [{"step": 0, **evaluate(engine, val_ex, args.samples)}]
        print(f"[rm] step 0 {history[-1]}", flush=True)
        rng = random.Random(args.seed)
        order: list[int] = []
        for step in range(1, args.steps + 1):
            if len(order) < args.batch_size:
                order += rng.sample(range(len(train_ex)), len(train_ex))
            idx, order = order[: args.batch_size], order[args.batch_size:]
            chunk = [train_ex[j] for j in idx]
            engine.advance_lr_schedule()  # the schedule counts optimizer steps here (SFT's order)
            m = engine.train_step(sequence_batch(chunk), [list(range(len(chunk)))], mse_loss_fn(len(chunk)))
            if step % args.eval_every == 0 or step == args.steps:
                history.append({"step": step, "mse": float(m["mse"]), **evaluate(engine, val_ex, args.samples),
                                "time_s": round(time.time() - t0, 1)})
                print(f"[rm] step {step} {history[-1]}", flush=True)
        weights = dict(engine.export_hf())
    finally:
        destroy_distributed()

    rm = transformers.AutoModelForSequenceClassification.from_pretrained(init, dtype=torch.float32)
    rm.load_state_dict({k: v.float() for k, v in weights.items()}, strict=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rm.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    summary = {"args": vars(args), "train_responses": len(train_ex), "val_responses": len(val_ex),
               "final": history[-1], "history": history, "build_s": round(time.time() - t0, 1)}
    (out / "rm_summary.json").write_text(json.dumps(summary, indent=1))
    print(f"[rm] wrote {out} in {time.time() - t0:.0f}s", flush=True)


if __name__ == "__main__":
    main()
