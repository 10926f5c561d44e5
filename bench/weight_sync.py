"""The weight sync (actor -> rollout), per model, placement and bucket size: seconds per sync and GB per second.

- ``split`` (``actor_rollout_ref.hybrid_engine=false``, one rollout worker of its own): the actor's rank 0 packs
  its HF tensors into flat buckets of the size given (``rollout.checkpoint_engine.update_weights_bucket_megabytes``)
  and puts each into Ray's object store (``export_rollout_weights``); the rollout worker fetches and loads them
  (``load_weights``). Timed: the export, the load, and the two together. The bucket sizes run side by side on one
  started trainer, in alternating order per repeat; ``per tensor`` (1 byte: every tensor a bucket, one object each)
  is the unbucketed baseline, 2048 MB (verl's default) one bucket for these models.
- ``colocated`` (the default placement): the actor's worker copies its exported tensors into its own rollout in
  process (``sync_rollout_weights``): no buckets, no object store.

Models: the shipped tiny model and a compute-bound Qwen2 (h 1024, 4 layers, V 8192: 61 M parameters, 245 MB in
fp32; ``bench/memory_grid.py``'s) written into a temporary directory with the tiny model's tokenizer. The median
of ``--repeats`` syncs per cell (after one warm-up sync), GB = 1e9 bytes.

    .venv/bin/python bench/weight_sync.py [--repeats 5] [--models tiny,wide] [--buckets 0,1,64,2048]
        [--placements split,colocated]   (on GPUs split placement needs a second GPU for the rollout worker)
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.memory_grid import WIDE  # noqa: E402  (the compute-bound model's shape)

TINY = ROOT / "verl_lite" / "assets" / "tiny-addition"
BASE = {"trainer.total_training_steps": 1, "trainer.val_before_train": "false", "trainer.logger": "[jsonl]",
        "data.train_batch_size": 2, "actor_rollout_ref.actor.ppo_mini_batch_size": 2, "actor_rollout_ref.rollout.n": 2}


def _model(name: str, tmp: Path) -> Path:
    if name == "tiny":
        return TINY
    from verl_lite.utils.tiny_model import make_tiny_hf_model

    path = tmp / "wide"
    make_tiny_hf_model(path, "qwen2", **WIDE)
    for tokenizer_file in [*TINY.glob("*token*"), TINY / "chat_template.jinja"]:
        shutil.copy(tokenizer_file, path / tokenizer_file.name)
    return path


def _trainer(model: Path, split: bool, out: Path):
    from verl_lite.config import load_config
    from verl_lite.trainer.ppo_trainer import PPOTrainer

    overrides = {**BASE, "actor_rollout_ref.model.path": str(model), "trainer.output_dir": str(out),
                 "trainer.default_local_dir": str(out / "ckpt")}
    if split:
        overrides.update({"actor_rollout_ref.hybrid_engine": "false", "async_training.staleness_threshold": 1,
                          "actor_rollout_ref.rollout.n_gpus_per_node": 1})
    trainer = PPOTrainer(load_config([f"{k}={v}" for k, v in overrides.items()]))
    trainer.start()
    return trainer


def _split_sync(placement, bucket_mb: float, version: int) -> tuple[float, float, int]:
    """(export s, load s, bytes) of one sync through buckets of ``bucket_mb`` (0: one bucket per tensor)."""
    from verl_lite.rollout.buckets import bucket_bytes_of

    started = time.perf_counter()
    refs, nbytes = placement.actor.call_all("export_rollout_weights", max(1, bucket_bytes_of(bucket_mb)))[0]
    exported = time.perf_counter()
    placement.rollout.call_all("load_weights", refs, version)
    return exported - started, time.perf_counter() - exported, nbytes


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--models", default="tiny,wide")
    p.add_argument("--buckets", default="0,1,64,2048", help="bucket sizes in MB (0: one bucket per tensor)")
    p.add_argument("--placements", default="split,colocated")
    a = p.parse_args()
    placements = a.placements.split(",")
    buckets = [float(b) for b in a.buckets.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="weight-sync-"))
    print("model | placement | bucket | buckets | MB per sync | export s | load s | sync s | GB/s")
    for name in a.models.split(","):
        model = _model(name, tmp)
        if "split" in placements:
            _split_rows(name, model, buckets, a.repeats, tmp)
        if "colocated" in placements:
            _colocated_row(name, model, a.repeats, tmp)
    shutil.rmtree(tmp, ignore_errors=True)


def _split_rows(name: str, model: Path, buckets: list[float], repeats: int, tmp: Path) -> None:
    trainer = _trainer(model, split=True, out=tmp / f"{name}-split")
    try:
        version, times = 1, {b: [] for b in buckets}
        for repeat in range(repeats + 1):
            order = buckets if repeat % 2 == 0 else buckets[::-1]
            for bucket_mb in order:
                result = _split_sync(trainer.placement, bucket_mb, version)
                version += 1
                if repeat > 0:  # the first round warms up
                    times[bucket_mb].append(result)
        for bucket_mb in buckets:
            export_s, load_s = (statistics.median(t[i] for t in times[bucket_mb]) for i in (0, 1))
            nbytes = times[bucket_mb][0][2]
            count = _bucket_count(trainer.placement, bucket_mb)
            label = "per tensor" if bucket_mb == 0 else f"{bucket_mb:g} MB"
            print(f"{name} | split | {label} | {count} | {nbytes / 1e6:.1f} | {export_s:.3f} | {load_s:.3f} | "
                  f"{export_s + load_s:.3f} | {nbytes / 1e9 / (export_s + load_s):.3f}", flush=True)
    finally:
        trainer.close()


def _colocated_row(name: str, model: Path, repeats: int, tmp: Path) -> None:
    trainer = _trainer(model, split=False, out=tmp / f"{name}-colocated")
    try:
        durations = []
        for repeat in range(repeats + 1):
            started = time.perf_counter()
            trainer.placement.actor.call_all("sync_rollout_weights")
            if repeat > 0:
                durations.append(time.perf_counter() - started)
        sync_s = statistics.median(durations)
        nbytes = _model_bytes(model)
        print(f"{name} | colocated | none | - | {nbytes / 1e6:.1f} | - | - | {sync_s:.3f} | "
              f"{nbytes / 1e9 / sync_s:.3f}", flush=True)
    finally:
        trainer.close()


def _model_bytes(model: Path) -> int:
    """The bytes of the model's tensors (its safetensors files)."""
    from safetensors.torch import load_file

    return sum(t.numel() * t.element_size() for path in model.glob("*.safetensors")
               for t in load_file(str(path)).values())


def _bucket_count(placement, bucket_mb: float) -> int:
    """How many buckets a sync of ``bucket_mb`` makes (one more export, not timed)."""
    from verl_lite.rollout.buckets import bucket_bytes_of

    refs, _ = placement.actor.call_all("export_rollout_weights", max(1, bucket_bytes_of(bucket_mb)))[0]
    return len(refs)


if __name__ == "__main__":
    main()
