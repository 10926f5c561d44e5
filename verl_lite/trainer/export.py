"""Export any checkpoint's policy as an HF model directory, after the fact, in one process:

    python -m verl_lite.trainer.export <checkpoint> [--out DIR]

``<checkpoint>`` is a ``global_step_K`` directory, or a ``trainer.default_local_dir`` (then its newest
complete checkpoint). ``--out`` defaults to ``<checkpoint>/huggingface``. The checkpoint's shards
are resharded by megatron's dist_checkpointing into one process (whatever TP/PP/VPP/CP/DP wrote
them), then written as ``model.safetensors`` + ``config.json`` + the tokenizer, loadable with
``transformers.AutoModelForCausalLM.from_pretrained(DIR)``. Only the model weights are read (no
optimizer state); nothing is unpickled (see ``verl_lite.engine.checkpoint``). Runs on CPU.

Before anything is read, the role's files are checked against the checkpoint's manifest and its
dist-checkpoint index through the restricted unpickler (``verl_lite.trainer.checkpointing``); a
damaged or unsafe checkpoint is refused naming the file (exit 2).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def resolve_checkpoint(path: str | Path) -> Path:
    """A global_step_K directory (complete) from a checkpoint or a checkpoint root."""
    from verl_lite.trainer.checkpointing import is_complete, latest_checkpoint

    path = Path(path).expanduser().resolve()
    if is_complete(path):
        return path
    if (path / "actor").is_dir():
        raise ValueError(f"{path} has no 'complete' marker: its save did not finish; export an earlier checkpoint")
    latest = latest_checkpoint(path)
    if latest is None:
        raise ValueError(f"{path} is neither a complete global_step_K checkpoint nor a directory holding one")
    return latest


def export_checkpoint(checkpoint: str | Path, out: str | Path | None = None, role: str = "actor") -> Path:
    """Write ``<checkpoint>/<role>`` as an HF directory; returns it. Initialises a 1-process gloo world."""
    from verl_lite.trainer.checkpointing import check_dist_metadata, verify_checkpoint

    ckpt = resolve_checkpoint(checkpoint)
    role_dir = ckpt / role
    if not (role_dir / "dist").is_dir():
        raise ValueError(f"{ckpt} holds no {role} state ({role_dir / 'dist'} is missing)")
    fix = "export another checkpoint (its global_step_K directory), or restore this one from a copy"
    verify_checkpoint(ckpt, fix, under=role)  # before megatron or transformers read any of it
    check_dist_metadata(ckpt, [role], fix)

    import torch
    from transformers import AutoConfig

    from verl_lite.engine.checkpoint import load_model_only, save_hf_pretrained
    from verl_lite.engine.distributed import destroy_distributed, init_distributed
    from verl_lite.workers.from_config import parallel_config
    from verl_lite.engine.model import build_model_chunks, transformer_config_from_hf
    from verl_lite.utils.net import free_port

    out = Path(out).expanduser().resolve() if out is not None else ckpt / "huggingface"
    config_dir = role_dir / "hf_config"
    hf_config = AutoConfig.from_pretrained(str(config_dir))
    parallel = parallel_config()
    init_distributed(0, 1, "127.0.0.1", free_port(), parallel)
    try:
        tf_config = transformer_config_from_hf(hf_config, parallel, params_dtype=torch.float32)
        chunks = build_model_chunks(hf_config, tf_config)
        load_model_only(chunks, role_dir / "dist")
        save_hf_pretrained(chunks, hf_config, out, tokenizer_path=str(config_dir))
    finally:
        destroy_distributed()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verl_lite.trainer.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a global_step_K directory or a trainer.default_local_dir")
    parser.add_argument("--out", default=None, help="output directory (default: <checkpoint>/huggingface)")
    args = parser.parse_args(argv)
    from verl_lite.errors import UserError

    try:
        out = export_checkpoint(args.checkpoint, args.out)
    except (ValueError, UserError) as e:
        print(f"verl_lite export: {e}", file=sys.stderr)
        return 2
    print(f"exported {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
