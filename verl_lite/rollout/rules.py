"""The rollout section's rules: backend name, vLLM settings, dtype, sampling parameters.

``rollout_problems`` returns one line per problem, naming the key and the fix; ``verl_lite.config.validate``
collects them with the rest of the run config before any worker starts. ``generation_kwargs_problems``
checks the Python API's ``generation_kwargs`` against what the chosen backend can do.
"""

from __future__ import annotations

from verl_lite.agent.rules import agent_config_problems
from verl_lite.rollout import ROLLOUT_NAMES, VLLM_ENGINE_KEYS, vllm_unavailable_reason

ROLLOUT_DTYPES = ("float32", "bfloat16", "float16")


def generation_problems(R: str, gen, longest: int | None, cuda: bool, what: str = "rollout") -> list[str]:
    """The rules of a generation backend (``schema.GenerationConfig``: the policy's rollout and the judge's):
    its name, vLLM's settings, dtype and memory share. ``R`` = the section's key; ``longest`` = prompt +
    generated tokens at most (None: unknown); ``what`` names the generator in messages."""
    out: list[str] = []
    if gen.name not in ROLLOUT_NAMES:
        out.append(f"{R}.name={gen.name!r} is unknown; choose one of {list(ROLLOUT_NAMES)}")
    elif gen.name == "vllm":
        if (why := vllm_unavailable_reason()) is not None:
            out.append(f"{R}.name=vllm cannot run here: {why}; or use {R}.name=hf")
        if gen.free_cache_engine and not cuda:
            out.append(f"{R}.free_cache_engine=true needs vLLM's sleep mode, which needs a CUDA GPU; set it false on CPU")
        if not cuda and gen.enable_chunked_prefill:
            out.append(f"{R}.enable_chunked_prefill=true: vLLM's CPU sampler cannot resume a seeded request across "
                       f"a split prefill ('CPU Generator does not use offset'), so the CPU {what} runs without it; "
                       f"set it false or drop it")
        budget = gen.max_num_batched_tokens
        if not cuda and longest is not None and isinstance(budget, int) and 1 <= budget < longest:
            out.append(f"{R}.max_num_batched_tokens={budget}: without chunked prefill (off on CPU) vLLM needs at least "
                       f"max_model_len = {longest} tokens (the longest prompt + generation) per step; raise it to "
                       f"{longest} or drop it")
    for name in VLLM_ENGINE_KEYS:
        value = getattr(gen, name)
        if value is not None and gen.name != "vllm":
            out.append(f"{R}.{name}={value} is a vLLM engine setting and {R}.name={gen.name!r} has no such setting; "
                       f"set {R}.name=vllm or drop it")
        elif isinstance(value, int) and not isinstance(value, bool) and value < 1:
            out.append(f"{R}.{name}={value} must be >= 1 (or null for vLLM's default)")
    if gen.dtype not in ROLLOUT_DTYPES:
        out.append(f"{R}.dtype={gen.dtype!r} is unknown; choose one of {list(ROLLOUT_DTYPES)}")
    if not 0.0 < gen.gpu_memory_utilization <= 1.0:
        out.append(f"{R}.gpu_memory_utilization={gen.gpu_memory_utilization} must lie in (0, 1]")
    return out


def rollout_problems(R: str, rollout, longest: int, max_pos: int | None, cuda: bool) -> list[str]:
    """``rollout`` = the config's rollout section named ``R``; ``longest`` = prompt + response tokens at most;
    ``max_pos`` = the model's max_position_embeddings (None: unknown); ``cuda``: a GPU is visible."""
    out = generation_problems(R, rollout, longest, cuda)
    if rollout.name == "vllm" and max_pos and longest > max_pos:
        out.append(f"{R}.name=vllm: data.max_prompt_length + data.max_response_length = {longest} exceeds the "
                   f"model's max_position_embeddings {max_pos} (vLLM's max_model_len); shorten them")
    if rollout.tensor_model_parallel_size != 1:
        out.append(f"{R}.tensor_model_parallel_size={rollout.tensor_model_parallel_size}: only 1 is built "
                 "(every worker holds a full rollout model); set it to 1")
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

    out.extend(agent_config_problems(R, rollout))  # multi_turn.* and agent.*
    return out


# generation_kwargs (Python API) each backend takes, beyond the rollout config's sampling keys
GENERATION_KWARGS = {
    "hf": ("repetition_penalty", "min_p", "stop", "stop_token_ids"),
    "vllm": ("repetition_penalty", "min_p", "presence_penalty", "frequency_penalty", "stop_token_ids"),
}
CONFIG_SAMPLING_KWARGS = ("temperature", "top_p", "top_k")  # set actor_rollout_ref.rollout.<key> instead
NOT_SUPPORTED_WHY = {
    ("vllm", "stop"): "the vLLM rollout runs token ids in and out (skip_tokenizer_init), so it cannot match "
                      "stop strings; give their token ids as stop_token_ids, or use rollout.name=hf",
}
OTHER_KEYS = {  # what a TRL / HF user may pass that a config key owns
    "max_new_tokens": "data.max_response_length", "max_tokens": "data.max_response_length",
    "n": "actor_rollout_ref.rollout.n", "num_return_sequences": "actor_rollout_ref.rollout.n",
    "do_sample": "actor_rollout_ref.rollout.val_kwargs.do_sample (training always samples)",
    "seed": "trainer.seed", "logprobs": "nothing (the rollout always returns the sampled tokens' log-probs)",
}


def generation_kwargs_problems(name: str, kwargs: dict) -> list[str]:
    """``generation_kwargs`` for the rollout backend ``name``: only the keys that backend takes, with
    values it accepts. ``temperature`` / ``top_p`` / ``top_k`` are allowed (the trainer writes them into
    the rollout config); keys that other config keys own are refused naming that key."""
    supported = GENERATION_KWARGS.get(name, ())
    p = []
    for key, value in kwargs.items():
        where = f"generation_kwargs[{key!r}]"
        if key in CONFIG_SAMPLING_KWARGS:
            continue
        if key in OTHER_KEYS:
            p.append(f"{where}: set {OTHER_KEYS[key]} instead")
        elif (name, key) in NOT_SUPPORTED_WHY:
            p.append(f"{where} is not supported by rollout.name={name}: {NOT_SUPPORTED_WHY[name, key]}")
        elif key not in supported:
            others = [b for b, keys in GENERATION_KWARGS.items() if key in keys and b != name]
            also = f"; rollout.name={others[0]} takes it" if others else ""
            p.append(f"{where} is not supported by rollout.name={name} (it takes {list(supported)} and "
                     f"{list(CONFIG_SAMPLING_KWARGS)}){also}; drop it")
        else:
            p.extend(_generation_value_problems(where, key, value))
    return p


def _generation_value_problems(where: str, key: str, value) -> list[str]:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if key == "repetition_penalty" and not (number and value > 0):
        return [f"{where}={value!r} must be a number > 0 (1.0: no penalty)"]
    if key == "min_p" and not (number and 0.0 <= value <= 1.0):
        return [f"{where}={value!r} must lie in [0, 1]"]
    if key in ("presence_penalty", "frequency_penalty") and not (number and -2.0 <= value <= 2.0):
        return [f"{where}={value!r} must lie in [-2, 2] (vLLM's range)"]
    if key == "stop" and not (isinstance(value, str) and value or isinstance(value, (list, tuple)) and value
                              and all(isinstance(v, str) and v for v in value)):
        return [f"{where}={value!r} must be a non-empty string or a list of them"]
    if key == "stop_token_ids" and not (isinstance(value, (list, tuple))
                                        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value)):
        return [f"{where}={value!r} must be a list of token ids (ints >= 0)"]
    return []
