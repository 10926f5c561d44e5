"""The contract every generation backend (``HFRollout``, ``VLLMRollout``) implements.

The worker builds one rollout per process with ``make_rollout(name, model_path, tokenizer,
**kwargs)``, calls ``generate`` for every RL step and validation pass, and after every actor
update pushes the new weights with ``load_weights(actor.export_hf())``. Nothing else of a
backend is used, so a new backend only has to satisfy this protocol.
"""

from __future__ import annotations

from typing import Iterable, Protocol, runtime_checkable

import torch


@runtime_checkable
class Rollout(Protocol):
    eos_token_id: int

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
    ) -> list[dict]:
        """n responses per prompt, prompt-major (prompt0 x n, prompt1 x n, ...).

        Each item: ``response_ids`` (list[int], the stopping EOS included) and ``log_probs``
        (fp32 tensor [len]): log p_T(token_t | prompt, response[:t]) with
        p_T = softmax(logits / T) over the FULL vocabulary at the rollout temperature T
        (T = temperature if > 0 else 1); top-k / top-p only restrict which tokens can be drawn.
        ``seeds`` (one per prompt) or ``seed`` (one per call) make the call reproducible;
        greedy (do_sample=False) needs neither.
        """
        ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy (hf_name, tensor) pairs, e.g. from ``MegatronEngine.export_hf()``, into the running
        model in place (no restart, no disk). Returns the number of tensors loaded; an unknown
        name or a shape mismatch raises ValueError."""
        ...

