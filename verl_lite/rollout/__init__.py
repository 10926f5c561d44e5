"""Generation backends: HF transformers (CPU/GPU, always available) and vLLM (GPU, optional, lazy).

    rollout = make_rollout("hf", model_path, tokenizer)
    outs = rollout.generate(prompt_ids, n=8, do_sample=True, temperature=1.0, max_new_tokens=8, seed=step)
    rollout.load_weights(engine.export_hf())   # weight sync after each update
"""

from __future__ import annotations

import importlib.util

from verl_lite.rollout.hf_rollout import HFRollout


def vllm_available() -> bool:
    """True when vllm is installed and a CUDA GPU is visible."""
    import torch

    return importlib.util.find_spec("vllm") is not None and torch.cuda.is_available()


def make_rollout(name: str, model_path: str, tokenizer, **kwargs):
    """'hf' -> HFRollout, 'vllm' -> VLLMRollout (imported only here)."""
    if name == "hf":
        return HFRollout(model_path, tokenizer, **kwargs)
    if name == "vllm":
        from verl_lite.rollout.vllm_rollout import VLLMRollout

        return VLLMRollout(model_path, tokenizer, **kwargs)
    raise ValueError(f"unknown rollout name {name!r}; choose 'hf' or 'vllm'")


__all__ = ["HFRollout", "make_rollout", "vllm_available"]
