"""Where ``MegatronEngine.train_step`` spends its time: torch.profiler per-op tables, one process.

    python bench/profile_train_step.py [--hidden 128 512] [--compute] [--seqs 128] [--samples 8] [--steps 5] [--rows 25]

The RL update's shape: ``--seqs`` sequences of prompt ~9 + response 2..12 tokens (the shipped
task at n=8), ``--samples`` consecutive sequences per prompt, one micro-batch, the real actor loss
(GRPO advantages, token-mean, clip 0.2). The step is timed with the engine packing every prompt per
sequence and with shared prompts packed once (``engine/packing.py``), alternating, and the FLOP
figures count the model FLOPs of the unshared sequences for both.
hidden 128 = the shipped tiny model's shape (vocab 128, 4 layers); hidden 512 = the same at 4x
width. ``--compute`` adds the compute point of ``bench/rl_step_vs_trl.py --workload compute``: its
model's shape (``COMPUTE_MODEL``: hidden 512, 8 layers, 8 heads, 2 KV heads, intermediate 1408) and
its update's sequences (prompt 6..10 + response 56..64 tokens). For each: the min step time over
``--steps`` steps and its model FLOP/s (6 x matmul parameters per token) as a fraction of this
machine's fp32 GEMM peak measured in the same run, then the profiler's per-op table of one step
(self CPU time), and the time by phase: forward+backward (the schedule), optimizer step, the rest
(packing, zeroing grads, scheduler). The process runs with glibc's heap settings the engine's
workers get (``controller.worker_env.HEAP_TUNABLES``): the script re-executes itself with them.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

from rl_step_vs_trl import COMPUTE_MODEL, gemm_peak_flops, matmul_params


def _shapes(hidden_sizes: list[int], compute: bool) -> list[dict]:
    """(name, model shape, prompt and response length ranges) of each case to run."""
    shapes = []
    for hidden in hidden_sizes:
        heads = max(4, hidden // 32)
        shapes.append(dict(name=f"hidden {hidden}", hidden_size=hidden, num_layers=4, num_attention_heads=heads,
                           num_key_value_heads=heads // 2, intermediate_size=hidden * 3, prompt=(8, 10), response=(2, 12)))
    if compute:
        shapes.append(dict(name="compute point", hidden_size=COMPUTE_MODEL["hidden_size"],
                           num_layers=COMPUTE_MODEL["num_hidden_layers"],
                           num_attention_heads=COMPUTE_MODEL["num_attention_heads"],
                           num_key_value_heads=COMPUTE_MODEL["num_key_value_heads"],
                           intermediate_size=COMPUTE_MODEL["intermediate_size"], prompt=(6, 10), response=(56, 64)))
    return shapes


def _setup(shape: dict, root: Path):
    from verl_lite.engine import MegatronEngine
    from verl_lite.engine.config import EngineConfig, MegatronConfig, OptimConfig
    from verl_lite.utils.tiny_model import make_tiny_hf_model

    model_dir = make_tiny_hf_model(root / shape["name"].replace(" ", "_"), "qwen2", vocab_size=128, seed=0, init_std=0.02,
                                   **{k: shape[k] for k in ("hidden_size", "num_layers", "num_attention_heads",
                                                            "num_key_value_heads", "intermediate_size")})
    engine = MegatronEngine(EngineConfig(str(model_dir), MegatronConfig.layout(), OptimConfig(lr=1e-4, clip_grad=1.0,
                                                                                        betas=(0.9, 0.99))))
    return engine, Path(model_dir)


def _batch(num_seqs: int, samples: int, prompt: tuple[int, int], response: tuple[int, int], vocab: int = 128):
    """``num_seqs`` sequences, ``samples`` per prompt (consecutive), as the RL update sees them."""
    from verl_lite.engine import SequenceBatch

    rnd = random.Random(0)
    g = torch.Generator().manual_seed(0)
    ids, resp = [], []
    for i in range(num_seqs):
        if i % samples == 0:
            prompt_ids = torch.randint(3, vocab, (rnd.randint(*prompt),), generator=g)
        r = rnd.randint(*response)
        ids.append(torch.cat([prompt_ids, torch.randint(3, vocab, (r,), generator=g)]))
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
    from verl_lite.algorithms import ActorLossConfig

    plan = NormalizationPlan.from_mask(batch.data["response_mask"], "token-mean")
    return partial(actor_loss, plan=plan, cfg=ActorLossConfig(loss_agg_mode="token-mean"))


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


def run(shape: dict, num_seqs: int, samples: int, steps: int, rows: int, root: Path, peak: float) -> None:
    engine, model_dir = _setup(shape, root)
    batch = _batch(num_seqs, samples, shape["prompt"], shape["response"])
    loss_fn = _loss_fn(batch)
    mbs = [list(range(len(batch)))]
    engine.train_step(batch, mbs, loss_fn)  # warm-up
    best = {True: float("inf"), False: float("inf")}  # by engine.share_prompts, alternating
    shares = engine.share_prompts  # the engine's own choice for this model and layout
    for _ in range(steps):
        for share in (False, True):
            engine.share_prompts = share
            t = time.perf_counter()
            engine.train_step(batch, mbs, loss_fn)
            best[share] = min(best[share], time.perf_counter() - t)
    engine.share_prompts = shares  # the phases and the profile below: as the engine runs
    total, spent = min((_phases(engine, batch, loss_fn, mbs) for _ in range(3)), key=lambda x: x[0])
    tokens = sum(batch.lengths)
    pack_rows = engine._pack(batch, mbs)[0].packed.num_local_tokens
    unshared = best[False]
    flops = 6 * matmul_params(model_dir) * tokens / unshared
    print(f"\n##### {shape['name']}: {num_seqs} sequences ({samples} per prompt), {tokens} tokens; train_step min "
          f"{unshared * 1e3:.1f} ms with every prompt packed per sequence ({tokens / unshared:.0f} tok/s, "
          f"{flops / 1e9:.1f} GFLOP/s = {100 * flops / peak:.1f}% of the fp32 GEMM peak)")
    print(f"shared prompts ({pack_rows} pack rows): train_step min {best[True] * 1e3:.1f} ms, "
          f"{best[True] / unshared:.2f}x; the same model FLOPs would be {100 * flops / peak * unshared / best[True]:.1f}% "
          f"of the peak")
    print(f"phases of one step ({total * 1e3:.1f} ms): forward+backward {spent['schedule'] * 1e3:.1f} ms, "
          f"optimizer.step {spent['optimizer'] * 1e3:.1f} ms, rest {(total - sum(spent.values())) * 1e3:.1f} ms")
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.train_step(batch, mbs, loss_fn)
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=48))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, nargs="*", default=[128, 512])
    ap.add_argument("--compute", action="store_true", help="also the compute point's shape (see above)")
    ap.add_argument("--seqs", type=int, default=128)
    ap.add_argument("--samples", type=int, default=8, help="sequences per prompt (1: every prompt distinct)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    from verl_lite.controller.worker_env import HEAP_TUNABLES

    if "GLIBC_TUNABLES" not in os.environ:  # glibc reads it at process start: run again with it
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "GLIBC_TUNABLES": HEAP_TUNABLES})
    torch.set_num_threads(args.threads)
    peak = gemm_peak_flops(args.threads)
    print(f"fp32 GEMM peak at {args.threads} threads: {peak / 1e9:.1f} GFLOP/s")

    from verl_lite.engine import init_distributed
    from verl_lite.engine.config import MegatronConfig
    from verl_lite.utils.net import free_port

    init_distributed(0, 1, "127.0.0.1", free_port(), MegatronConfig.layout())
    with tempfile.TemporaryDirectory() as tmp:
        for shape in _shapes(args.hidden, args.compute):
            run(shape, args.seqs, args.samples, args.steps, args.rows, Path(tmp), peak)


if __name__ == "__main__":
    main()
