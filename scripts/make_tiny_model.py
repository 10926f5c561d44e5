"""Build the shipped tiny model and data: verl_lite/assets/tiny-addition + verl_lite/assets/synthetic-addition.

Steps (all local, deterministic given --seed; CPU is enough):
1. the synthetic addition task (verl parquet rows): train + held-out val (disjoint pairs);
2. a character-level HF fast tokenizer with a chat template (verl_lite.data.char_tokenizer);
3. a randomly initialised Qwen2-architecture model (HF format);
4. SFT on the megatron engine (verl_lite.trainer.sft) until greedy held-out accuracy first
   reaches --target-accuracy (a PARTIAL accuracy, so that RL has room to improve);
5. the result (config.json, model.safetensors, tokenizer files, sft_summary.json) is written to
   the asset folder.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/make_tiny_model.py
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def init_model(out: Path, args) -> Path:
    """A Qwen2-architecture model with transformers' standard initialisation (N(0, 0.02), unit norms, zero biases)."""
    import torch
    import transformers

    from verl_lite.data.char_tokenizer import BOS_ID, EOS_ID, PAD_ID

    cfg = transformers.Qwen2Config(
        vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads, num_key_value_heads=args.num_kv_heads,
        intermediate_size=args.intermediate_size, max_position_embeddings=128, tie_word_embeddings=False,
        rope_theta=10000.0, rms_norm_eps=1e-6, use_sliding_window=False, bos_token_id=BOS_ID,
        eos_token_id=EOS_ID, pad_token_id=PAD_ID, initializer_range=0.02,
    )
    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=str(ROOT / "verl_lite/assets/tiny-addition"))
    ap.add_argument("--data-dir", default=str(ROOT / "verl_lite/assets/synthetic-addition"))
    ap.add_argument("--max-digits", type=int, default=2)
    ap.add_argument("--n-train", type=int, default=8000)
    ap.add_argument("--n-val", type=int, default=256)
    ap.add_argument("--restate-fraction", type=float, default=0.5,
                    help="fraction of SFT demonstrations that restate the problem (scored 0 by the strict verifier)")
    ap.add_argument("--hidden-size", type=int, default=128)
    ap.add_argument("--num-layers", type=int, default=4)
    ap.add_argument("--num-heads", type=int, default=4)
    ap.add_argument("--num-kv-heads", type=int, default=2)
    ap.add_argument("--intermediate-size", type=int, default=384)
    ap.add_argument("--vocab-size", type=int, default=128)
    ap.add_argument("--sft-steps", type=int, default=3000, help="upper bound; stops earlier at --target-accuracy")
    ap.add_argument("--sft-lr", type=float, default=1e-3)
    ap.add_argument("--sft-batch-size", type=int, default=64)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--target-accuracy", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    from verl_lite.data import make_synthetic_task, save_char_tokenizer
    from verl_lite.data.char_tokenizer import char_vocab
    from verl_lite.trainer.sft import SFTConfig, run_sft

    if args.vocab_size < len(char_vocab()):
        raise SystemExit(f"--vocab-size must be >= {len(char_vocab())} (the char vocabulary)")
    t0 = time.time()
    data_dir = Path(args.data_dir)
    train, val = make_synthetic_task(data_dir, args.n_train, args.n_val, seed=args.seed, max_digits=args.max_digits,
                                     restate_fraction=args.restate_fraction)
    train = train.replace(train.with_name("sft_train.parquet"))  # the SFT demonstrations; the RL split is derived below
    print(f"data: {train} ({args.n_train} rows), {val} ({args.n_val} rows)")
    subprocess.run([sys.executable, str(ROOT / "scripts" / "make_rl_train_split.py"), "--data-dir", str(data_dir)],
                   check=True)

    with tempfile.TemporaryDirectory() as tmp:
        init = init_model(Path(tmp) / "init", args)
        save_char_tokenizer(init)
        out = Path(args.model_dir)
        if out.exists():
            shutil.rmtree(out)
        summary = run_sft(SFTConfig(
            model_path=str(init), out_dir=str(out), train_files=[str(train)], val_files=[str(val)],
            steps=args.sft_steps, batch_size=args.sft_batch_size, micro_batch_size=args.sft_batch_size,
            lr=args.sft_lr, eval_every=args.eval_every, target_accuracy=args.target_accuracy, seed=args.seed,
            response_key="demonstration",
        ))
    summary["script_args"] = vars(args)
    summary["wall_time_s"] = round(time.time() - t0, 1)
    (out / "sft_summary.json").write_text(json.dumps(summary, indent=1, default=str))
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {out} ({size / 1e6:.2f} MB): SFT steps {summary['steps']}, "
          f"held-out greedy accuracy {summary['final_val_accuracy']:.3f}, {summary['wall_time_s']} s")


if __name__ == "__main__":
    main()
