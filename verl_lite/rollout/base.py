"""The base class of every generation backend (``HFRollout``, ``VLLMRollout``): the contract and the rules they share.

The worker builds one rollout per process with ``make_rollout(name, model_path, tokenizer, **kwargs)``, calls
``generate`` for every RL step and validation pass, and after every actor update pushes the new weights with
``load_weights(actor.export_hf())``. Nothing else of a backend is used: a backend implements ``_generate`` and
``load_weights``.
"""

from __future__ import annotations

from typing import Iterable

import torch


class Rollout:
    eos_token_id: int
    # ``generate(..., interrupt=f)`` returns early once ``f()`` is true, the responses still running marked
    # ``"interrupted": True`` (a partial rollout continues them on new weights: ``agent.loop.VersionedRollout``)
    interruptible: bool = False

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
        **shaping,
    ) -> list[dict]:
        """n responses per prompt, prompt-major (prompt0 x n, prompt1 x n, ...).

        Each item: ``response_ids`` (list[int], the stopping EOS included) and ``log_probs``
        (fp32 tensor [len]): log p_T(token_t | prompt, response[:t]) with
        p_T = softmax(logits / T) over the FULL vocabulary at the rollout temperature T
        (``rollout_temperature``); top-k / top-p only restrict which tokens can be drawn (the log-probs are not
        renormalised over the kept set: verl's convention). ``seeds`` (one per prompt) or ``seed`` (one per call)
        make the call reproducible (``sample_keys``); greedy (do_sample=False) picks the argmax and needs neither.
        ``shaping``: the backend's further ``generation_kwargs`` (the keywords of its ``_generate``).
        """
        check_generate_args(prompt_ids, n, do_sample, temperature, max_new_tokens, seed, seeds)
        if not prompt_ids:
            return []
        keys = sample_keys(len(prompt_ids), n, seed, seeds)
        return self._generate(prompt_ids, n, do_sample, temperature, top_p, top_k, max_new_tokens, keys, **shaping)

    def _generate(self, prompt_ids: list[list[int]], n: int, do_sample: bool, temperature: float, top_p: float,
                  top_k: int, max_new_tokens: int, keys: list[tuple[int, int]], **shaping) -> list[dict]:
        """``generate`` of checked arguments, with each row's ``sample_keys`` key."""
        raise NotImplementedError

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy (hf_name, tensor) pairs, e.g. from ``MegatronEngine.export_hf()``, into the running
        model in place (no restart, no disk). Returns the number of tensors loaded; an unknown
        name or a shape mismatch raises ValueError."""
        raise NotImplementedError


def rollout_temperature(temperature: float) -> float:
    """T of the reported log-probs: ``temperature`` if > 0, else 1 (greedy at temperature 0)."""
    return float(temperature) if temperature and temperature > 0 else 1.0


def check_generate_args(prompt_ids, n: int, do_sample: bool, temperature: float, max_new_tokens: int,
                        seed: int | None, seeds: list[int] | None) -> None:
    """Raise ValueError, naming the argument, for a ``generate`` call that no backend runs."""
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


def sample_keys(num_prompts: int, n: int, seed: int | None, seeds: list[int] | None) -> list[tuple[int, int]]:
    """The (seed, sample id) pair that keys each row's random draws: sample k of prompt p is (seeds[p], k); with
    one ``seed`` per call (None = 0), row i of the call is (seed, i). A row's draws depend on its key only, not on
    the batch or the worker layout."""
    if seeds is not None:
        return [(int(s), k) for s in seeds for k in range(n)]
    return [(0 if seed is None else int(seed), i) for i in range(num_prompts * n)]
