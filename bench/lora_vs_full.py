"""LoRA vs full fine-tuning on the engine: step time, peak memory and optimizer-state bytes, side by side.

    python bench/lora_vs_full.py [--hidden 512] [--layers 4] [--rank 16] [--seqs 16] [--steps 4]

One process (gloo, CPU or one GPU): a tiny Qwen2 of the given hidden size (intermediate 4x, 8 heads);
the same ragged mini-batch for both engines. Per engine:
- step: the fastest of ``--steps`` ``train_step`` calls (seconds);
- peak memory: the process's peak resident set (CPU, ``ru_maxrss``, measured in a fresh process per
  engine) or ``torch.cuda.max_memory_allocated`` (GPU);
- optimizer state: bytes of the optimizer's tensors after a step (Adam's two moments and, in bf16,
  the fp32 main parameters), and the trainable parameters.
The last line states the optimizer-state ratio LoRA / full.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch


def _loss(outputs, data):
    m = data["response_mask"]
    return -(outputs["log_probs"] * m).sum() / m.sum().clamp(min=1), {}


def _batch(n, vocab, seed=0):
    from verl_lite.engine import SequenceBatch

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(32, 128, (n,), generator=g).tolist()
    ids = [torch.randint(1, vocab, (k,), generator=g) for k in lengths]
    resp = [k // 2 for k in lengths]
    mask = torch.zeros(n, max(resp))
    for i, r in enumerate(resp):
        mask[i, :r] = 1
    return SequenceBatch(ids, torch.tensor(resp), {"response_mask": mask})


def optimizer_state_bytes(engine) -> int:
    """Bytes of every tensor the optimizer holds (moments, fp32 main parameters)."""
    total = 0
    for opt in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]):
        for state in opt.optimizer.state.values():
            total += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v) and v.ndim > 0)
        for group in getattr(opt, "shard_fp32_from_float16_groups", None) or getattr(opt, "fp32_from_float16_groups", []):
            total += sum(p.numel() * p.element_size() for p in group)
    return total


def measure(kind: str, model_dir: str, rank: int, seqs: int, steps: int, dtype: str) -> dict:
    """One engine (``kind`` 'lora' or 'full') in this process: its numbers as a dict."""
    import resource

    from verl_lite.engine.distributed import init_distributed
    from verl_lite.engine.engine import MegatronEngine
    from verl_lite.engine.config import LoraConfig
    from verl_lite.utils.net import free_port
    from verl_lite.engine.config import EngineConfig, MegatronConfig, OptimConfig

    par = MegatronConfig.layout()
    init_distributed(0, 1, "127.0.0.1", free_port(), par)
    lora = None
    if kind == "lora":
        lora = LoraConfig(rank=rank, alpha=2.0 * rank, dropout=0.0, target_modules=("all-linear",),
                          exclude_modules=(), adapter_path=None)
    engine = MegatronEngine(EngineConfig(model_dir, MegatronConfig(dtype=dtype), OptimConfig(lr=1e-4),
                                         lora=lora))
    batch = _batch(seqs, engine.hf_config.vocab_size)
    mbs = [list(range(0, seqs // 2)), list(range(seqs // 2, seqs))]
    best = float("inf")
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.train_step(batch, mbs, _loss)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() if torch.cuda.is_available()
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    trainable = sum(p.numel() for c in engine.chunks for p in c.parameters() if p.requires_grad)
    total = sum(p.numel() for c in engine.chunks for p in c.parameters())
    return {"kind": kind, "step_s": best, "peak_bytes": peak, "optimizer_state_bytes": optimizer_state_bytes(engine),
            "trainable": trainable, "parameters": total}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # internal: kind,model_dir
    args = ap.parse_args(argv)
    if args.measure:
        kind, model_dir = args.measure.split(",", 1)
        print(json.dumps(measure(kind, model_dir, args.rank, args.seqs, args.steps, args.dtype)))
        return 0
    from verl_lite.utils.tiny_model import make_tiny_hf_model

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = make_tiny_hf_model(Path(tmp) / "m", "qwen2", vocab_size=1024, hidden_size=args.hidden,
                                       num_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                                       intermediate_size=4 * args.hidden)
        rows = []
        for kind in ("full", "lora"):  # a fresh process each: peak memory is per engine
            cmd = [sys.executable, __file__, "--measure", f"{kind},{model_dir}", "--rank", str(args.rank),
                   "--seqs", str(args.seqs), "--steps", str(args.steps), "--dtype", args.dtype]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
    print(f"hidden {args.hidden}, {args.layers} layers, LoRA rank {args.rank} on all linears, {args.dtype}, "
          f"{args.seqs} sequences x 2 micro-batches, {'GPU' if torch.cuda.is_available() else 'CPU'}")
    print(f"{'':6s} {'step s':>8s} {'peak MiB':>9s} {'optimizer-state MiB':>20s} {'trainable':>11s} {'parameters':>11s}")
    for r in rows:
        print(f"{r['kind']:6s} {r['step_s']:8.3f} {r['peak_bytes'] / 2**20:9.1f} {r['optimizer_state_bytes'] / 2**20:20.3f} "
              f"{r['trainable']:11,d} {r['parameters']:11,d}")
    full, lora = rows
    print(f"optimizer state LoRA / full = {lora['optimizer_state_bytes'] / full['optimizer_state_bytes']:.2%}, "
          f"step time LoRA / full = {lora['step_s'] / full['step_s']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
