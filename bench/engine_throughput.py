"""Engine training throughput on ragged data: THD packing vs padding, and the CPU adapter's share.

    python bench/engine_throughput.py [--hidden 128 512] [--seqs 16] [--steps 3]

One process (gloo, CPU): a tiny Qwen2 with the given hidden size; a mini-batch of sequences with
lengths uniform in [min_len, max_len]. Two ways to feed the same sequences:
- packed: THD, each sequence at its own length (what the engine does);
- padded: every sequence right-padded to the batch's longest one (what a [b, s] layout costs).
tokens/s counts REAL tokens (sum of lengths) per second of ``train_step`` in both cases.

CPU adapter share: the adapter (``engine/cpu_adapter.py``) is a globally entered
TorchFunctionMode, so every torch call pays one Python hop. We time the model's forward+backward
(outside megatron's schedule, which needs the adapter) with the mode entered and with it
temporarily popped, and report (t_with - t_without) / t_train_step. The adapter only runs on
CPU-only torch; on GPU it is not installed.
"""

from __future__ import annotations

import argparse
import random
import socket
import tempfile
import time
from functools import partial
from pathlib import Path

import torch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _loss(outputs, data):
    m = data["response_mask"]
    return -(outputs["log_probs"] * m).sum() / m.sum().clamp(min=1), {}


def _batch(lengths, vocab, pad_to=None):
    from verl_lite.engine import SequenceBatch

    g = torch.Generator().manual_seed(0)
    ids, resp = [], []
    for n in lengths:
        x = torch.randint(1, vocab, (n,), generator=g)
        r = n // 2
        if pad_to is not None:
            # the padded layout costs pad_to tokens per row; the loss values are irrelevant here
            x = torch.cat([x, torch.zeros(pad_to - n, dtype=torch.long)])
        ids.append(x)
        resp.append(r)
    width = max(resp)
    mask = torch.zeros(len(lengths), width)
    for i, r in enumerate(resp):
        mask[i, :r] = 1
    return SequenceBatch(ids, torch.tensor(resp), {"response_mask": mask})


def _time_steps(engine, batch, steps):
    mbs = [list(range(len(batch)))]
    engine.train_step(batch, mbs, _loss)  # warm-up
    t = time.perf_counter()
    for _ in range(steps):
        engine.train_step(batch, mbs, _loss)
    return (time.perf_counter() - t) / steps


def _adapter_overhead(engine, batch, reps):
    """Seconds per model forward+backward with the adapter's mode entered minus popped."""
    from torch.overrides import _pop_mode_temporarily

    from verl_lite.engine import cpu_adapter

    if not cpu_adapter.is_installed():
        return 0.0
    mb = engine._pack(batch, [list(range(len(batch)))])[0]
    model = engine.chunks[0]
    psp = engine._packed_seq_params(mb.packed)

    def fwd_bwd():
        out = model(mb.packed.input_ids, None, None, packed_seq_params=psp)
        out.float().pow(2).mean().backward()

    def timed():
        fwd_bwd()
        t = time.perf_counter()
        for _ in range(reps):
            fwd_bwd()
        return (time.perf_counter() - t) / reps

    with_mode = timed()
    with _pop_mode_temporarily():
        without = timed()
    return with_mode - without


def run(hidden: int, num_seqs: int, min_len: int, max_len: int, steps: int, root: Path) -> dict:
    from verl_lite.engine import EngineConfig, MegatronEngine, OptimConfig, ParallelConfig
    from verl_lite.utils.tiny_model import make_tiny_hf_model

    heads = max(4, hidden // 64)
    vocab = 2048
    model_dir = make_tiny_hf_model(root / f"h{hidden}", "qwen2", vocab_size=vocab, hidden_size=hidden, num_layers=4,
                                   num_attention_heads=heads, num_key_value_heads=heads // 2,
                                   intermediate_size=hidden * 3, seed=0, init_std=0.02)
    engine = MegatronEngine(EngineConfig(str(model_dir), ParallelConfig(), OptimConfig(lr=1e-5)))
    rnd = random.Random(0)
    lengths = [rnd.randint(min_len, max_len) for _ in range(num_seqs)]
    real = sum(lengths)
    t_packed = _time_steps(engine, _batch(lengths, vocab), steps)
    t_padded = _time_steps(engine, _batch(lengths, vocab, pad_to=max(lengths)), steps)
    overhead = _adapter_overhead(engine, _batch(lengths, vocab), reps=steps)
    return {
        "hidden": hidden,
        "real_tokens": real,
        "padded_tokens": max(lengths) * num_seqs,
        "packed_tok_s": real / t_packed,
        "padded_tok_s": real / t_padded,
        "adapter_share": max(0.0, overhead) / t_packed,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, nargs="+", default=[128, 512])
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--min-len", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()

    from verl_lite.engine import ParallelConfig, init_distributed

    init_distributed(0, 1, "127.0.0.1", _free_port(), ParallelConfig())
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for h in args.hidden:
            rows.append(run(h, args.seqs, args.min_len, args.max_len, args.steps, Path(tmp)))
    print(f"\n{'hidden':>6} {'real tok':>9} {'padded tok':>10} {'packed tok/s':>13} {'padded tok/s':>13} "
          f"{'speed-up':>8} {'adapter share':>13}")
    for r in rows:
        print(f"{r['hidden']:>6} {r['real_tokens']:>9} {r['padded_tokens']:>10} {r['packed_tok_s']:>13.0f} "
              f"{r['padded_tok_s']:>13.0f} {r['packed_tok_s'] / r['padded_tok_s']:>7.2f}x {100 * r['adapter_share']:>12.1f}%")


if __name__ == "__main__":
    main()
