"""Engine training throughput on ragged data: THD packing vs padding, and the CPU adapter's share.

    python bench/engine_throughput.py [--hidden 128 512] [--seqs 16] [--steps 4]

One process (gloo, CPU): a tiny Qwen2 with the given hidden size; a mini-batch of sequences with
lengths uniform in [min_len, max_len]. Two ways to feed the same sequences:
- packed: THD, each sequence at its own length (what the engine does);
- padded: every sequence right-padded to the batch's longest one (what a [b, s] layout costs).
tokens/s counts REAL tokens (sum of lengths) per second of ``train_step`` in both cases (the
fastest of ``--steps`` alternating steps, so load spikes from other processes matter less).

CPU adapter share: the adapter (``compat/cpu_adapter.py``) is a globally entered
TorchFunctionMode, so every torch call pays one Python hop. We count the torch calls of one
packed ``train_step`` (a counting mode stacked on top) and multiply by the adapter's cost per call
(a tight loop of tiny ops with its mode entered vs temporarily popped, minimum of repetitions);
share = that / the step time. The adapter only runs on CPU-only torch; on GPU it is not installed.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from verl_lite.utils.net import free_port as _free_port


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


def _time_steps(engine, batches, steps):
    """Min seconds per train_step for each batch; the batches alternate so load spikes hit both."""
    best = [float("inf")] * len(batches)
    for b in batches:  # warm-up
        engine.train_step(b, [list(range(len(b)))], _loss)
    for _ in range(steps):
        for k, b in enumerate(batches):
            t = time.perf_counter()
            engine.train_step(b, [list(range(len(b)))], _loss)
            best[k] = min(best[k], time.perf_counter() - t)
    return best


class _CountCalls(TorchFunctionMode):
    """Counts torch-function calls (each one also passes through the adapter's mode below it)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += 1
        return func(*args, **(kwargs or {}))


def _per_call_overhead(reps: int = 5, n: int = 20000) -> float:
    """Seconds the adapter adds to one torch call: a tight loop of tiny ops with its mode vs popped."""
    from torch.overrides import _pop_mode_temporarily

    x = torch.ones(4)

    def loop():
        t = time.perf_counter()
        for _ in range(n):
            torch.add(x, x)
        return time.perf_counter() - t

    with_mode, without = float("inf"), float("inf")
    for _ in range(reps):
        with_mode = min(with_mode, loop())
        with _pop_mode_temporarily():
            without = min(without, loop())
    return max(0.0, with_mode - without) / n


def _adapter_seconds_per_step(engine, batch) -> float:
    """(torch calls in one train_step) x (adapter cost per call); 0 when the adapter is not active."""
    from verl_lite.compat import cpu_adapter

    if not cpu_adapter.is_installed():
        return 0.0
    counter = _CountCalls()
    with counter:
        engine.train_step(batch, [list(range(len(batch)))], _loss)
    return counter.calls * _per_call_overhead()


def run(hidden: int, num_seqs: int, min_len: int, max_len: int, steps: int, root: Path) -> dict:
    from verl_lite.engine import MegatronEngine
    from verl_lite.engine.config import EngineConfig, MegatronConfig, OptimConfig
    from verl_lite.utils.tiny_model import make_tiny_hf_model

    heads = max(4, hidden // 64)
    vocab = 2048
    model_dir = make_tiny_hf_model(root / f"h{hidden}", "qwen2", vocab_size=vocab, hidden_size=hidden, num_layers=4,
                                   num_attention_heads=heads, num_key_value_heads=heads // 2,
                                   intermediate_size=hidden * 3, seed=0, init_std=0.02)
    engine = MegatronEngine(EngineConfig(str(model_dir), MegatronConfig.layout(), OptimConfig(lr=1e-5)))
    rnd = random.Random(0)
    lengths = [rnd.randint(min_len, max_len) for _ in range(num_seqs)]
    real = sum(lengths)
    t_packed, t_padded = _time_steps(engine, [_batch(lengths, vocab), _batch(lengths, vocab, pad_to=max(lengths))], steps)
    overhead = _adapter_seconds_per_step(engine, _batch(lengths, vocab))
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
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args()

    from verl_lite.engine import init_distributed
    from verl_lite.engine.config import MegatronConfig

    init_distributed(0, 1, "127.0.0.1", _free_port(), MegatronConfig.layout())
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
