"""The rollout section's rules: backend name, vLLM settings, dtype, sampling parameters.

``rollout_problems`` returns one line per problem, naming the key and the fix; ``verl_lite.config.validate``
collects them with the rest of the run config before any worker starts.
"""

from __future__ import annotations

from verl_lite.rollout import ROLLOUT_NAMES, VLLM_ENGINE_KEYS, vllm_unavailable_reason

ROLLOUT_DTYPES = ("float32", "bfloat16", "float16")


def rollout_problems(R: str, rollout, longest: int, max_pos: int | None, cuda: bool) -> list[str]:
    """``rollout`` = the config's rollout section named ``R``; ``longest`` = prompt + response tokens at most;
    ``max_pos`` = the model's max_position_embeddings (None: unknown); ``cuda``: a GPU is visible."""
    out: list[str] = []
    if rollout.name not in ROLLOUT_NAMES:
        out.append(f"{R}.name={rollout.name!r} is unknown; choose one of {list(ROLLOUT_NAMES)}")
    elif rollout.name == "vllm":
        if (why := vllm_unavailable_reason()) is not None:
            out.append(f"{R}.name=vllm cannot run here: {why}; or use {R}.name=hf")
        if rollout.free_cache_engine and not cuda:
            out.append(f"{R}.free_cache_engine=true needs vLLM's sleep mode, which needs a CUDA GPU; set it false on CPU")
        if max_pos and longest > max_pos:
            out.append(f"{R}.name=vllm: data.max_prompt_length + data.max_response_length = {longest} exceeds the "
                       f"model's max_position_embeddings {max_pos} (vLLM's max_model_len); shorten them")
    for name in VLLM_ENGINE_KEYS:
        value = getattr(rollout, name)
        if value is not None and rollout.name != "vllm":
            out.append(f"{R}.{name}={value} is a vLLM engine setting and {R}.name={rollout.name!r} has no such setting; "
                     f"set {R}.name=vllm or drop it")
        elif isinstance(value, int) and not isinstance(value, bool) and value < 1:
            out.append(f"{R}.{name}={value} must be >= 1 (or null for vLLM's default)")
    if rollout.dtype not in ROLLOUT_DTYPES:
        out.append(f"{R}.dtype={rollout.dtype!r} is unknown; choose one of {list(ROLLOUT_DTYPES)}")
    if rollout.tensor_model_parallel_size != 1:
        out.append(f"{R}.tensor_model_parallel_size={rollout.tensor_model_parallel_size}: only 1 is built "
                 "(every worker holds a full rollout model); set it to 1")
    if not 0.0 < rollout.gpu_memory_utilization <= 1.0:
        out.append(f"{R}.gpu_memory_utilization={rollout.gpu_memory_utilization} must lie in (0, 1]")
    for key, temp, top_p, top_k, sampling in (
        (R, rollout.temperature, rollout.top_p, rollout.top_k, True),
        (f"{R}.val_kwargs", rollout.val_kwargs.temperature, rollout.val_kwargs.top_p, rollout.val_kwargs.top_k,
         rollout.val_kwargs.do_sample),
    ):
        if sampling and not temp > 0:
            out.append(f"{key}.temperature={temp} must be > 0 when sampling (use val_kwargs.do_sample=false for greedy)")
        if not 0.0 < top_p <= 1.0:
            out.append(f"{key}.top_p={top_p} must lie in (0, 1]")
        if top_k < -1:
            out.append(f"{key}.top_k={top_k} must be -1/0 (disabled) or a positive count")
    if rollout.val_kwargs.n < 1:
        out.append(f"{R}.val_kwargs.n={rollout.val_kwargs.n} must be >= 1")
    if rollout.val_kwargs.n > 1 and not rollout.val_kwargs.do_sample:
        out.append(f"{R}.val_kwargs.n={rollout.val_kwargs.n} > 1 needs val_kwargs.do_sample=true (greedy samples repeat)")
    return out
