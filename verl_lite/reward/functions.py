"""Reward functions of the Python API: TRL-style, batched, keyword arguments, optionally async
(docs/python_api.md, "Reward functions").

Each function is called ONCE per batch with the keyword arguments its signature names (a
``**kwargs`` parameter receives all of them), each a list with one entry per sample:

    prompts       the decoded prompt (chat template applied), as the model saw it
    completions   the decoded response (special tokens skipped)
    ground_truth  the row's ground truth (None where a row has none)
    data_source   the row's data source
    extra_info    the row's extra_info dict, and each of its keys as a keyword of its own: every
                  dataset column other than the prompt, data_source and reward_model arrives there,
                  so TRL-style rows' ``answer`` column is the keyword ``answer``

It returns one number per sample, or a dict with ``"score"`` (None: the sample is not scored by it). Async
functions of a batch run concurrently. The step's score is sum_k weight_k * f_k (``reward/<name>/mean`` per
function). The batch call is bounded by ``reward.timeout_s``; a raise, a timeout, a wrong count or a non-finite
score is a ``RewardError`` naming the function.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import math
import sys
from typing import Callable, Sequence

import torch

from verl_lite.reward.manager import RewardError, _as_score, as_score_list
from verl_lite.reward.sandbox import call_bounded

FIXED_KWARGS = ("prompts", "completions", "ground_truth", "data_source", "extra_info")


def _name(fn: Callable) -> str:
    return getattr(fn, "__name__", None) or type(fn).__name__


def _required(fn: Callable) -> list[str]:
    """The keyword arguments ``fn`` cannot be called without (its parameters without a default)."""
    return [n for n, p in inspect.signature(fn).parameters.items()
            if p.default is inspect.Parameter.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def _accepted(fn: Callable, available: dict[str, list]) -> dict[str, list]:
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return available
    missing = [n for n in _required(fn) if n not in available]
    if missing:
        raise RewardError(f"reward function {_name(fn)} needs {missing}, which no sample provides; it can take "
                          f"{sorted(available)}")
    return {k: v for k, v in available.items() if k in params}


class RewardFunctions:
    """Weighted batched reward functions, called like ``RewardManager`` (plus ``prompts``)."""

    builtin = False

    def __init__(self, funcs: Callable | Sequence[Callable], tokenizer, weights: Sequence[float] | None = None,
                 timeout_s: float | None = None):
        self.funcs = [funcs] if callable(funcs) else list(funcs)
        if not self.funcs or not all(callable(f) for f in self.funcs):
            raise ValueError("reward_funcs must be a callable or a non-empty list of callables")
        self.weights = [1.0] * len(self.funcs) if weights is None else [float(w) for w in weights]
        if len(self.weights) != len(self.funcs):
            raise ValueError(f"reward_weights has {len(self.weights)} entries for {len(self.funcs)} reward_funcs")
        names = [_name(f) for f in self.funcs]
        self.names = [n if names.count(n) == 1 else f"{n}_{k}" for k, n in enumerate(names)]
        self.fn_name = " + ".join(self.names)
        self.tokenizer, self.timeout_s = tokenizer, timeout_s
        self.warned_unscored = False

    def close(self) -> None:
        pass

    def required_inputs(self) -> dict[str, list[str]]:
        """Per function, the keyword arguments it cannot run without, checked against the dataset's columns
        before the run starts."""
        return {name: _required(fn) for name, fn in zip(self.names, self.funcs)}

    def _kwargs(self, responses, data_sources, ground_truths, extra_infos, prompts) -> dict[str, list]:
        extra_infos = [e or {} for e in extra_infos]
        out = {"completions": [self.tokenizer.decode(list(r), skip_special_tokens=True) for r in responses],
               "ground_truth": list(ground_truths), "data_source": list(data_sources), "extra_info": extra_infos}
        if prompts is not None:
            out["prompts"] = [self.tokenizer.decode(list(p), skip_special_tokens=False) for p in prompts]
        for key in sorted({k for e in extra_infos for k in e} - set(FIXED_KWARGS)):
            out[key] = [e.get(key) for e in extra_infos]
        return out

    async def _call_all(self, kwargs: dict[str, list]) -> list:
        async def one(fn):
            result = fn(**_accepted(fn, kwargs))
            return await result if inspect.isawaitable(result) else result

        return await asyncio.gather(*(one(f) for f in self.funcs))

    def __call__(self, responses, data_sources, ground_truths, extra_infos=None, prompts=None):
        n = len(responses)
        extra_infos = list(extra_infos) if extra_infos is not None else [None] * n
        kwargs = self._kwargs(responses, data_sources, ground_truths, extra_infos, prompts)
        try:
            future = call_bounded(lambda: asyncio.run(self._call_all(kwargs)), self.timeout_s, "verl_lite-reward-funcs")
        except concurrent.futures.TimeoutError:
            raise RewardError(f"reward functions {self.fn_name} did not return within reward.timeout_s="
                              f"{self.timeout_s}s on a batch of {n} samples; make them faster or raise reward.timeout_s"
                              ) from None
        e = future.exception()
        if isinstance(e, RewardError):
            raise e
        if e is not None:
            raise RewardError(f"reward functions {self.fn_name} raised {type(e).__name__}: {e} on a batch of {n} "
                              f"samples") from e
        total = torch.zeros(n, dtype=torch.float64)
        scored = torch.zeros(n, dtype=torch.bool)
        extra: dict[str, list] = {}
        for name, weight, results in zip(self.names, self.weights, future.result()):
            results = as_score_list(results, n, f"reward function {name}")
            scores = [None if r is None else _as_score(r, f"reward function {name} on sample {i}")
                      for i, r in enumerate(results)]
            extra[name] = [math.nan if x is None else x for x in scores]
            total += weight * torch.tensor([0.0 if x is None else x for x in scores], dtype=torch.float64)
            scored |= torch.tensor([x is not None for x in scores])
            if all(isinstance(r, dict) and "acc" in r for r in results) and len(self.funcs) == 1:
                extra["acc"] = [r["acc"] for r in results]
        if not bool(scored.all()) and not self.warned_unscored:
            self.warned_unscored = True
            print(f"verl_lite: warning: every reward function returned None for {int((~scored).sum())} of {n} samples; "
                  f"their reward is 0 (as TRL sums what the functions return); said once", file=sys.stderr, flush=True)
        return total.float(), extra
