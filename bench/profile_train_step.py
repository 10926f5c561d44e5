"""Where ``MegatronEngine.train_step`` spends its time: torch.profiler per-op tables, one process.

    python bench/profile_train_step.py [--hidden 128 512] [--seqs 128] [--steps 5] [--rows 25]

The RL update's shape: ``--seqs`` sequences of prompt ~9 + response 2..12 tokens (the shipped
task at n=8), one micro-batch, the real actor loss (GRPO advantages, token-mean, clip 0.2).
hidden 128 = the shipped tiny model's shape (vocab 128, 4 layers); hidden 512 = the same at 4x
width. For each size: the min step time over ``--steps`` steps, then the profiler's per-op table
of one step (self CPU time), and the time by phase: forward+backward (the schedule),
optimizer step, the rest (packing, zeroing grads, scheduler).
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from functools import partial
from pathlib import Path

import torch


def _setup(hidden: int, root: Path):
    from verl_lite.engine import MegatronEngine
    from verl_lite.workers.from_config import engine_config, optim_config, parallel_config
    from verl_lite.utils.tiny_model import make_tiny_hf_model

    heads = max(4, hidden // 32)
    model_dir = make_tiny_hf_model(root / f"h{hidden}", "qwen2", vocab_size=128, hidden_size=hidden, num_layers=4,
                                   num_attention_heads=heads, num_key_value_heads=heads // 2,
                                   intermediate_size=hidden * 3, seed=0, init_std=0.02)
    return MegatronEngine(engine_config(str(model_dir), parallel_config(), optim_config(lr=1e-4, clip_grad=1.0,
                                                                                      betas=(0.9, 0.99))))


def _batch(num_seqs: int, vocab: int = 128):
    from verl_lite.engine import SequenceBatch

    rnd = random.Random(0)
    g = torch.Generator().manual_seed(0)
    ids, resp = [], []
    for _ in range(num_seqs):
        p, r = rnd.randint(8, 10), rnd.randint(2, 12)
        ids.append(torch.randint(3, vocab, (p + r,), generator=g))
        resp.append(r)
    width = max(resp)
    mask = torch.zeros(num_seqs, width)
    for i, r in enumerate(resp):
        mask[i, :r] = 1
    adv = torch.randn(num_seqs, 1, generator=g).expand(-1, width) * mask
    old = -torch.rand(num_seqs, width, generator=g) * mask
    return SequenceBatch(ids, torch.tensor(resp), {"response_mask": mask, "advantages": adv.contiguous(),
                                                   "old_log_probs": old})


def _loss_fn(batch):
    from verl_lite.algorithms import NormalizationPlan, actor_loss
    from verl_lite.workers.from_config import actor_loss_config

    plan = NormalizationPlan.from_mask(batch.data["response_mask"], "token-mean")
    return partial(actor_loss, plan=plan, cfg=actor_loss_config(loss_agg_mode="token-mean"))


def _phases(engine, batch, loss_fn, mbs):
    """Seconds of (schedule, optimizer.step, rest) in one train_step, by wrapping the two calls."""
    import megatron.core.pipeline_parallel as pp_mod

    spent = {"schedule": 0.0, "optimizer": 0.0}
    orig_get = pp_mod.get_forward_backward_func
    orig_step = engine.optimizer.step

    def timed(key, fn):
        def run(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[key] += time.perf_counter() - t
        return run

    pp_mod.get_forward_backward_func = lambda *a, **k: timed("schedule", orig_get(*a, **k))
    engine.optimizer.step = timed("optimizer", orig_step)
    try:
        t = time.perf_counter()
        engine.train_step(batch, mbs, loss_fn)
        total = time.perf_counter() - t
    finally:
        pp_mod.get_forward_backward_func = orig_get
        engine.optimizer.step = orig_step
    return total, spent


def run(hidden: int, num_seqs: int, steps: int, rows: int, root: Path) -> None:
    engine = _setup(hidden, root)
    batch = _batch(num_seqs)
    loss_fn = _loss_fn(batch)
    mbs = [list(range(len(batch)))]
    engine.train_step(batch, mbs, loss_fn)  # warm-up
    best = float("inf")
    for _ in range(steps):
        t = time.perf_counter()
        engine.train_step(batch, mbs, loss_fn)
        best = min(best, time.perf_counter() - t)
    total, spent = min((_phases(engine, batch, loss_fn, mbs) for _ in range(3)), key=lambda x: x[0])
    tokens = sum(batch.lengths)
    print(f"\n##### hidden {hidden}: {num_seqs} sequences, {tokens} tokens; train_step min {best * 1e3:.1f} ms "
          f"({tokens / best:.0f} tok/s)")
    print(f"phases of one step ({total * 1e3:.1f} ms): forward+backward {spent['schedule'] * 1e3:.1f} ms, "
          f"optimizer.step {spent['optimizer'] * 1e3:.1f} ms, rest {(total - sum(spent.values())) * 1e3:.1f} ms")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.train_step(batch, mbs, loss_fn)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=48))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--seqs", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from verl_lite.engine import init_distributed
    from verl_lite.workers.from_config import parallel_config
    from verl_lite.utils.net import free_port

    init_distributed(0, 1, "127.0.0.1", free_port(), parallel_config())
    with tempfile.TemporaryDirectory() as tmp:
        for h in args.hidden:
            run(h, args.seqs, args.steps, args.rows, Path(tmp))


if __name__ == "__main__":
    main()
