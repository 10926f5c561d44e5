"""Export any checkpoint's policy as an HF model directory, after the fact, in one process:

    python -m verl_lite.trainer.export <checkpoint> [--out DIR]

``<checkpoint>``: a ``global_step_K`` directory, or a ``trainer.default_local_dir`` (its newest complete one). The
shards (any layout) are resharded into one CPU process and written as safetensors + config + tokenizer (default
``<checkpoint>/huggingface``); only the model weights are read, after ``checkpointing.verify_checkpoint``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
from pathlib import Path

from verl_lite.errors import UserError
from verl_lite.utils import safe_files
from verl_lite.utils.net import free_port


def resolve_checkpoint(path: str | Path) -> Path:
    """A global_step_K directory (complete) from a checkpoint or a checkpoint root."""
    from verl_lite.trainer.checkpointing import is_complete, latest_checkpoint  # checkpointing imports torch: on use

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
    from verl_lite.trainer.checkpointing import fresh_dir_beside, publish_dir, verify_checkpoint

    ckpt = resolve_checkpoint(checkpoint)
    role_dir = ckpt / role
    if not (role_dir / "dist").is_dir():
        raise ValueError(f"{ckpt} holds no {role} state ({role_dir / 'dist'} is missing)")
    fix = "export another checkpoint (its global_step_K directory), or restore this one from a copy"
    verify_checkpoint(ckpt, fix, under=role)  # before megatron or transformers read any of it

    import torch
    from transformers import AutoConfig

    from verl_lite.engine.checkpoint import load_model_only, save_hf_pretrained
    from verl_lite.engine.config import MegatronConfig
    from verl_lite.engine.distributed import destroy_distributed, init_distributed
    from verl_lite.engine.model import build_model_chunks, transformer_config_from_hf

    final = Path(os.path.abspath(Path(out).expanduser())) if out is not None else ckpt / "huggingface"
    final.parent.mkdir(parents=True, exist_ok=True)
    config_dir = role_dir / "hf_config"
    hf_config = AutoConfig.from_pretrained(str(config_dir))
    parallel = MegatronConfig()
    init_distributed(0, 1, "127.0.0.1", free_port(), parallel)
    out = fresh_dir_beside(final)  # written here, then put in place: never through what is at `final`
    try:
        tf_config = transformer_config_from_hf(hf_config, parallel, params_dtype=torch.float32)
        chunks = build_model_chunks(hf_config, tf_config)
        lora = _checkpoint_lora(role_dir)
        if lora is not None:  # a LoRA run: rebuild its adapters, export the merged model and the PEFT adapter
            from verl_lite.engine.lora import add_adapters, export_adapter_state, merge_into

            add_adapters(chunks, hf_config, lora, seed=0)
        load_model_only(chunks, role_dir / "dist")
        if lora is None:
            save_hf_pretrained(chunks, hf_config, out, tokenizer_path=str(config_dir))
        else:
            from verl_lite.engine.checkpoint import LORA_ADAPTER_DIR, save_lora_adapter
            from verl_lite.engine.hf_bridge import export_hf

            merged = dict(merge_into(export_hf(chunks, hf_config), export_adapter_state(chunks), lora.scaling))
            save_hf_pretrained(merged, hf_config, out, tokenizer_path=str(config_dir))
            save_lora_adapter(chunks, lora, out / LORA_ADAPTER_DIR, base_model_path=_base_model_path(ckpt, role))
        publish_dir(out, final)
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    finally:
        destroy_distributed()
    return final


def _base_model_path(ckpt: Path, role: str) -> str | None:
    """The model a role's adapter applies to (PEFT's ``base_model_name_or_path``, which
    ``AutoPeftModelForCausalLM`` loads): the run's ``actor_rollout_ref.model.path`` from the checkpoint's
    fingerprint for the actor; None for a critic or a checkpoint saved without one."""
    from verl_lite.trainer import fingerprint

    if role != "actor" or not (ckpt / fingerprint.FILE).is_file():
        return None
    saved = safe_files.read_json(ckpt, fingerprint.FILE)
    model = saved.get("model") if isinstance(saved, dict) else None
    path = model.get("path") if isinstance(model, dict) else None
    return path if isinstance(path, str) else None


def _checkpoint_lora(role_dir: Path):
    """The engine's ``LoraConfig`` a LoRA run saved with its checkpoint (``lora.json``), or None."""
    from verl_lite.engine.checkpoint import LORA_FILE  # megatron's dist_checkpointing: on use

    if not (role_dir / LORA_FILE).is_file():
        return None
    from verl_lite.engine.config import LoraConfig

    fields = safe_files.read_json(role_dir, LORA_FILE)
    if not isinstance(fields, dict) or set(fields) - {f.name for f in dataclasses.fields(LoraConfig)}:
        raise ValueError(f"{role_dir / LORA_FILE}: not the LoRA settings of a verl_lite checkpoint")
    fields.update(adapter_path=None)  # the checkpoint holds the trained factors
    return LoraConfig(**fields)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m verl_lite.trainer.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a global_step_K directory or a trainer.default_local_dir")
    parser.add_argument("--out", default=None, help="output directory (default: <checkpoint>/huggingface)")
    args = parser.parse_args(argv)

    try:
        ckpt = resolve_checkpoint(args.checkpoint)
        out = export_checkpoint(ckpt, args.out)
    except (ValueError, UserError) as e:
        print(f"verl_lite export: {e}", file=sys.stderr)
        return 2
    print(export_line(ckpt, out))
    return 0


def saved_layout(role_dir: Path) -> str:
    """The parallel layout a role's shards were saved at (``<role>/dist/verl_lite_engine.json``), e.g. 'tp=2 pp=1 dp=2'."""
    from verl_lite.engine.checkpoint import read_engine_description  # megatron's dist_checkpointing: on use

    try:
        layout = read_engine_description(role_dir / "dist")["layout"]
        return " ".join(f"{k}={v}" for k, v in layout.items() if v is not None)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return "unknown (no readable layout record)"


def export_line(ckpt: Path, out: Path, role: str = "actor") -> str:
    """What was exported: the step, the layout its shards were saved at, and the HF files written."""
    from verl_lite.trainer.checkpointing import step_of  # checkpointing imports torch: on use

    files = ", ".join(sorted(p.name for p in Path(out).iterdir() if p.is_file()))
    return (f"exported step {step_of(ckpt)} ({ckpt}, {role} saved at {saved_layout(ckpt / role)}) as one HF model "
            f"directory (unsharded): {out}\n  files: {files}")


if __name__ == "__main__":
    sys.exit(main())
