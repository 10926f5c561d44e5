"""vLLM generation backend (GPU only; `pip install verl-lite[gpu]`). Imported lazily.

`VLLMRollout` has HFRollout's interface (`generate`, `load_weights`). vllm is imported in
the constructor, so importing this module never fails on a CPU-only install.
Log-probs: we ask vLLM for the sampled token's log-prob (`logprobs=0`) in its
`processed_logprobs` mode, i.e. after temperature scaling, to match HFRollout's log p_T. Whether
vLLM applies top-k/top-p before that point depends on its version; the engine's recomputed
old log-probs are what the loss uses, and the trainer reports the difference as a metric.
NOT tested in this repository's CI (no GPU); treat it as a starting point.
"""

from __future__ import annotations

from typing import Iterable

import torch


class VLLMRollout:
    def __init__(self, model_path: str, tokenizer, dtype: torch.dtype = torch.bfloat16, gpu_memory_utilization: float = 0.4,
                 max_model_len: int | None = None):
        try:
            from vllm import LLM
        except ImportError as e:  # pragma: no cover - only without vllm
            raise ImportError("rollout.name=vllm needs the vllm package (pip install 'verl-lite[gpu]')") from e
        if not torch.cuda.is_available():  # pragma: no cover
            raise RuntimeError("rollout.name=vllm needs a CUDA GPU; use rollout.name=hf on CPU")
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.llm = LLM(model=model_path, dtype=str(dtype).replace("torch.", ""), gpu_memory_utilization=gpu_memory_utilization,
                       max_model_len=max_model_len, enforce_eager=True, logprobs_mode="processed_logprobs")

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:  # pragma: no cover - GPU only
        """Push (hf_name, tensor) pairs into the vLLM model runner."""
        tensors = list(named_tensors)
        model = self.llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        model.load_weights(tensors)
        return len(tensors)

    def generate(self, prompt_ids, n=1, *, do_sample=True, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=16,
                 seed=None):  # pragma: no cover - GPU only
        from vllm import SamplingParams, TokensPrompt

        params = SamplingParams(n=1, temperature=temperature if do_sample else 0.0, top_p=top_p, top_k=top_k,
                                max_tokens=max_new_tokens, logprobs=0, seed=seed, stop_token_ids=[self.eos_token_id])
        prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in prompt_ids for _ in range(n)]
        results = []
        for out in self.llm.generate(prompts, params, use_tqdm=False):
            c = out.outputs[0]
            ids = list(c.token_ids)
            lps = [lp[t].logprob for t, lp in zip(ids, c.logprobs)]
            results.append({"response_ids": ids, "log_probs": torch.tensor(lps, dtype=torch.float32)})
        return results
