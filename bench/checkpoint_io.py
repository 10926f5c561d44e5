"""Checkpoint save / load time and size: the shipped tiny model and a hidden-512 model.

    python bench/checkpoint_io.py [--hidden 512] [--layers 4] [--repeats 3]

One process (gloo, CPU, fp32, the non-distributed optimizer) after one optimizer step, so the
checkpoint holds model + Adam moments + LR schedule. For each model it prints:

- save: ``save_role_state`` (megatron dist_checkpointing, torch_dist backend, + RNG + HF config);
  the first save of a process also builds megatron's save plan, so first and best-of-rest are shown;
- load: ``load_role_state`` into a freshly built engine (the resume path);
- hf: ``save_hf_pretrained`` (the ``huggingface/`` export written with every checkpoint);
- size: bytes on disk of the engine checkpoint and of the HF export, and the parameter count.

Timings are wall seconds, best of ``--repeats`` (after the first save); take them holding the
machine's heavy-run lock when it is shared.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _engine(model_path: str):
    from verl_lite.engine.config import EngineConfig, MegatronConfig, OptimConfig
    from verl_lite.engine.engine import MegatronEngine

    return MegatronEngine(EngineConfig(model_path=model_path, optim=OptimConfig(lr=1e-4), total_steps=10))


def _one_step(engine, vocab: int) -> None:
    from verl_lite.engine.engine import SequenceBatch

    g = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, vocab, (n,), generator=g) for n in (24, 32, 16, 28)]
    batch = SequenceBatch(ids, torch.tensor([8, 8, 8, 8]))
    engine.train_step(batch, [[0, 1, 2, 3]], lambda out, data: (-out["log_probs"].mean(), {}))


def bench_model(name: str, model_path: str, repeats: int) -> dict:
    from verl_lite.engine.checkpoint import load_role_state, save_hf_pretrained, save_role_state

    engine = _engine(model_path)
    vocab = engine.hf_config.vocab_size
    _one_step(engine, vocab)
    params = sum(p.numel() for c in engine.chunks for p in c.parameters())
    root = Path(tempfile.mkdtemp(prefix="verl_lite_ckpt_bench_"))
    try:
        saves = []
        for k in range(repeats + 1):
            d = root / f"save{k}"
            t0 = time.perf_counter()
            save_role_state(engine, d, tokenizer_path=model_path)
            saves.append(time.perf_counter() - t0)
        fresh = _engine(model_path)
        loads = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            load_role_state(fresh, root / "save0")
            loads.append(time.perf_counter() - t0)
        hf = []
        for k in range(repeats):
            t0 = time.perf_counter()
            save_hf_pretrained(engine, engine.hf_config, root / f"hf{k}", tokenizer_path=model_path)
            hf.append(time.perf_counter() - t0)
        return {"model": name, "params": params, "save_first_s": saves[0], "save_s": min(saves[1:]),
                "load_s": min(loads), "hf_s": min(hf), "ckpt_bytes": _dir_bytes(root / "save0"),
                "hf_bytes": _dir_bytes(root / "hf0")}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from verl_lite.engine.distributed import init_distributed
    from verl_lite.engine.config import MegatronConfig
    from verl_lite.utils import make_tiny_hf_model
    from verl_lite.utils.net import free_port

    torch.set_num_threads(1)
    init_distributed(0, 1, "127.0.0.1", free_port(), MegatronConfig.layout())
    shipped = str(Path(__file__).resolve().parents[1] / "verl_lite" / "assets" / "tiny-addition")
    with tempfile.TemporaryDirectory() as tmp:
        big = make_tiny_hf_model(Path(tmp) / f"h{args.hidden}", vocab_size=1024, hidden_size=args.hidden,
                                 num_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
                                 intermediate_size=4 * args.hidden, seed=0)
        rows = [bench_model("tiny-addition (shipped)", shipped, args.repeats),
                bench_model(f"hidden {args.hidden}, {args.layers} layers", str(big), args.repeats)]
    print(f"{'model':30s} {'params':>10s} {'save 1st':>9s} {'save':>7s} {'load':>7s} {'hf export':>10s} "
          f"{'ckpt MB':>8s} {'hf MB':>7s}")
    for r in rows:
        print(f"{r['model']:30s} {r['params']:>10,d} {r['save_first_s']:>8.3f}s {r['save_s']:>6.3f}s "
              f"{r['load_s']:>6.3f}s {r['hf_s']:>9.3f}s {r['ckpt_bytes'] / 2**20:>8.2f} {r['hf_bytes'] / 2**20:>7.2f}")


if __name__ == "__main__":
    main()
