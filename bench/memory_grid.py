"""The memory estimate (verl_lite/engine/memory.py) against the measured peak, over a grid of models and layouts.

    python bench/memory_grid.py [--points NAME,NAME...] [--list]

Per grid point, a fresh process (so no point's peak mixes with another's) per rank: imports, the batch built,
then a baseline: the process's anonymous resident memory (``RssAnon`` of /proc/self/status) right before the
engine is built; then the engine (``MegatronEngine`` on gloo, CPU), two ``train_step`` calls of one micro-batch
each (the second is the steady state: Adam's moments exist while its forward holds the activations), and the
peak: the kernel's high-water mark of the resident set (``VmHWM``: exact, no sampling) less the file-backed pages
resident at the end (``RssFile``: shared libraries' code touched while running, not allocations). Measured
growth = that peak minus the baseline, per rank (a 2-rank point reports its larger rank). The children run with
glibc's mmap threshold fixed at 1 MiB (``MALLOC_FOLLOWS_ALLOCATIONS``), so the resident set follows what is
allocated; ``--default-malloc`` measures with glibc's defaults (the heap's fragmentation included). The estimate is ``estimate_engine``'s total
for the same ``EngineSpec``: everything it counts (weights, gradients, optimizer state and scratch, activations,
LoRA); what it does not count (the runtime: Python, torch, megatron, the gloo group) is in the baseline. On a CUDA
device (``scripts/gpu_check.sh``) the growth is ``torch.cuda.max_memory_allocated`` over the same span instead.

Models: the shipped tiny model (``verl_lite/assets/tiny-addition``: h 128, 4 layers, V 128; its counted state
is small, so its points are LoRA at a large rank or attention-heavy micro-batches) and a compute-bound
Qwen2 (h 1024, 4 layers, f 2816, V 8192, 16 heads, 4 KV heads; 61 M parameters) written by
``make_tiny_hf_model`` into a temporary directory. Prints one row per point: estimate, growth,
estimate / growth; exits 1 when a point is outside ``--tolerance`` (15%).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "verl_lite" / "assets" / "tiny-addition"
WIDE = dict(vocab_size=8192, hidden_size=1024, num_layers=4, num_attention_heads=16, num_key_value_heads=4,
            intermediate_size=2816)
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
TOLERANCE = 0.15
# glibc serves every allocation of 1 MiB or more with its own mmap and unmaps it when freed (a fixed threshold
# turns off the dynamic one, which otherwise climbs to 32 MiB and keeps freed tensors in the heap): the resident
# set then follows what is allocated, without the heap's fragmentation (which the estimate does not count)
MALLOC_FOLLOWS_ALLOCATIONS = {"MALLOC_MMAP_THRESHOLD_": str(2**20)}


@dataclass(frozen=True)
class Point:
    """One engine to measure: model ('tiny' or 'wide'), dtype, LoRA rank (0: full fine-tuning), the micro-batch
    (``seqs`` sequences of ``length`` tokens), ranks and layout."""

    name: str
    model: str
    dtype: str = "float32"
    lora_rank: int = 0
    seqs: int = 4
    length: int = 128
    world: int = 1
    tp: int = 1
    distributed_optimizer: bool = False

    @property
    def dp(self) -> int:
        return self.world // self.tp


GRID = [
    Point("tiny-lora2000-s", "tiny", lora_rank=2000, seqs=4, length=127),
    Point("tiny-full-attn-l", "tiny", seqs=32, length=127),
    Point("wide-full-fp32-s", "wide", seqs=4, length=128),
    Point("wide-full-fp32-l", "wide", seqs=8, length=256),
    Point("wide-full-bf16-s", "wide", dtype="bfloat16", seqs=4, length=128),
    Point("wide-full-bf16-l", "wide", dtype="bfloat16", seqs=8, length=256),
    Point("wide-lora64-fp32-l", "wide", lora_rank=64, seqs=8, length=256),
    Point("wide-full-fp32-dp2", "wide", seqs=2, length=128, world=2),
    Point("wide-full-bf16-dp2-distopt", "wide", dtype="bfloat16", seqs=2, length=128, world=2,
          distributed_optimizer=True),
    Point("wide-full-fp32-tp2", "wide", seqs=4, length=128, world=2, tp=2),
]


def spec_of(point: Point, model_config: dict, cuda: bool = False):
    """The estimator's ``EngineSpec`` of ``point`` (CPU: no flash attention, gloo collectives; CUDA: NCCL, flash
    attention in bf16, as pre-flight builds it)."""
    from verl_lite.engine.memory import EngineSpec

    return EngineSpec(name=point.name, model=model_config, dtype=point.dtype, tp=point.tp, dp=point.dp,
                      distributed_optimizer=point.distributed_optimizer, lora_rank=point.lora_rank,
                      lora_projections=ALL_LINEAR if point.lora_rank else (),
                      micro_batch_tokens=point.seqs * point.length, micro_batch_sequences=point.seqs,
                      longest_sequence=point.length, flash_attention=cuda and point.dtype == "bfloat16",
                      gloo=not cuda)


def _loss(outputs, data):
    m = data["response_mask"]
    return -(outputs["log_probs"] * m).sum() / m.sum().clamp(min=1), {}


def _batch(seqs: int, length: int, vocab: int):
    import torch

    from verl_lite.engine import SequenceBatch

    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(3, vocab, (length,), generator=g) for _ in range(seqs)]
    response = length // 2
    return SequenceBatch(ids, torch.full((seqs,), response), {"response_mask": torch.ones(seqs, response)})


def _rank_growth(rank: int, world: int, point: Point, model_dir: str, port: int) -> int:
    """In this (fresh) process: baseline RSS, engine, two steps; returns the peak RSS growth in bytes."""
    import gc

    import torch

    from verl_lite.engine.config import EngineConfig, LoraConfig, MegatronConfig, OptimConfig
    from verl_lite.engine.distributed import destroy_distributed, init_distributed
    from verl_lite.engine.engine import MegatronEngine

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    layout = MegatronConfig.layout(tp=point.tp, dtype=point.dtype, use_distributed_optimizer=point.distributed_optimizer,
                                   timeout_s=600)
    init_distributed(rank, world, "127.0.0.1", port, layout)
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    batch = _batch(point.seqs, point.length, vocab)
    gc.collect()
    cuda = torch.cuda.is_available()
    if cuda:  # the device's allocator: what the estimate counts per device
        torch.cuda.reset_peak_memory_stats()
        allocated = torch.cuda.memory_allocated()
    before = _status()
    lora = (LoraConfig(rank=point.lora_rank, alpha=2.0 * point.lora_rank, target_modules=("all-linear",))
            if point.lora_rank else None)
    engine = MegatronEngine(EngineConfig(model_dir, layout, OptimConfig(lr=1e-5), lora=lora))
    for _ in range(2):
        engine.train_step(batch, [list(range(point.seqs))], _loss)
    after = _status()
    destroy_distributed()
    if cuda:
        return torch.cuda.max_memory_allocated() - allocated
    return after["VmHWM"] - after["RssFile"] - before["RssAnon"]


def _status() -> dict:
    """This process's VmHWM, RssAnon, RssFile, RssShmem from /proc/self/status, in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(value.split()[0]) * 1024
    return out


def _spawned(rank: int, world: int, point: Point, model_dir: str, port: int, out_dir: str) -> None:
    growth = _rank_growth(rank, world, point, model_dir, port)
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(growth))


def measure_point(point: Point, model_dir: str) -> int:
    """This process measures ``point``: one rank here, or ``world`` spawned ranks (each a fresh process);
    returns the largest rank's growth."""
    from verl_lite.utils.net import free_port

    port = free_port()
    if point.world == 1:
        return _rank_growth(0, 1, point, model_dir, port)
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_spawned, args=(point.world, point, model_dir, port, out), nprocs=point.world, join=True)
        return max(json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(point.world))


def model_dir_for(point: Point, tmp: str) -> str:
    """The shipped tiny model, or the compute-bound one (written once into ``tmp``)."""
    if point.model == "tiny":
        return str(TINY)
    path = Path(tmp) / "wide"
    if not (path / "config.json").is_file():
        from verl_lite.utils.tiny_model import make_tiny_hf_model

        make_tiny_hf_model(path, "qwen2", **WIDE)
    return str(path)


def run_point(point: Point, model_dir: str, default_malloc: bool = False) -> dict:
    """``point`` measured in a fresh child process, with its estimate: a row of the table."""
    from verl_lite.engine.memory import estimate_engine

    cmd = [sys.executable, __file__, "--child", json.dumps(asdict(point)), "--model-dir", model_dir]
    env = {**os.environ, "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // point.world)),
           **({} if default_malloc else MALLOC_FOLLOWS_ALLOCATIONS)}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if done.returncode != 0:
        raise RuntimeError(f"{point.name}: the measuring process failed:\n{done.stderr[-4000:]}")
    growth = int(done.stdout.strip().splitlines()[-1])
    import torch

    config = json.loads((Path(model_dir) / "config.json").read_text())
    estimate = estimate_engine(spec_of(point, config, cuda=torch.cuda.is_available()))
    return {"point": point.name, "estimate": estimate.total, "growth": growth, "ratio": estimate.total / growth,
            "parts": {k: v for k, v in estimate.parts.items() if v}}


def format_row(row: dict) -> str:
    mb = 1e6
    parts = ", ".join(f"{k} {v / mb:,.0f}" for k, v in row["parts"].items())
    return (f"{row['point']:28s} {row['estimate'] / mb:9,.0f} {row['growth'] / mb:9,.0f} {row['ratio']:6.2f}  "
            f"({parts})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--points", default="", help="comma-separated point names (default: the whole grid)")
    ap.add_argument("--list", action="store_true", help="print the grid's points and exit")
    ap.add_argument("--tolerance", type=float, default=TOLERANCE)
    ap.add_argument("--default-malloc", action="store_true",
                    help="measure under glibc's default thresholds (the heap's fragmentation included)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: one point, in this process
    ap.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(measure_point(Point(**json.loads(args.child)), args.model_dir))
        return 0
    if args.list:
        for p in GRID:
            print(p)
        return 0
    chosen = [p for p in GRID if not args.points or p.name in args.points.split(",")]
    unknown = set(filter(None, args.points.split(","))) - {p.name for p in GRID}
    if unknown:
        print(f"unknown point(s) {sorted(unknown)}; --list shows the grid", file=sys.stderr)
        return 2
    print(f"{'point':28s} {'est. MB':>9s} {'grown MB':>9s} {'ratio':>6s}  (estimate's parts, MB)")
    outside = 0
    with tempfile.TemporaryDirectory() as tmp:
        for point in chosen:
            row = run_point(point, model_dir_for(point, tmp), args.default_malloc)
            outside += abs(row["ratio"] - 1) > args.tolerance
            print(format_row(row), flush=True)
    print(f"{len(chosen) - outside}/{len(chosen)} point(s) within {args.tolerance:.0%}")
    return 1 if outside else 0


if __name__ == "__main__":
    sys.exit(main())
