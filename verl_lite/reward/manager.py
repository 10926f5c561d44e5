"""Reward managers: decode responses, call the scoring function, check what comes back.

    manager = RewardManager(cfg.reward, tokenizer)
    scores, extra = manager(responses, data_sources, ground_truths, extra_infos)
    # scores: FloatTensor [n]; extra: dict[str, list] (one entry per sample, None where a sample lacks the key)

reward_manager = "naive": one call per sample, verl's signature
    compute_score(data_source=, solution_str=, ground_truth=, extra_info=, **reward_kwargs) -> number | dict
reward_manager = "batch": one call per batch
    compute_score(data_sources=, solution_strs=, ground_truths=, extra_infos=, **reward_kwargs) -> list
A dict result needs "score"; its other keys go to `extra`. Responses are decoded with
`skip_special_tokens=True` (the stopping EOS is not part of solution_str).

Any failure raises `RewardError` naming the function (file:name) and the sample (index and
data_source): the function raising (original exception chained), a non-number, NaN or inf,
a dict without "score", or a batched function returning the wrong number of scores.
"""

from __future__ import annotations

import importlib.util
import math
import numbers
from pathlib import Path
from typing import Any, Callable

import torch

from verl_lite.reward.scorers import default_compute_score

REWARD_MANAGERS = ("naive", "batch")


class RewardError(RuntimeError):
    """A reward function failed or returned something that is not a finite score."""


def load_reward_function(path: str, name: str = "compute_score") -> Callable:
    """Import `name` from the python file at `path` (verl's custom_reward_function.{path,name})."""
    file = Path(path)
    if not file.is_file():
        raise RewardError(f"reward function file {path!r} does not exist (reward.custom_reward_function.path)")
    spec = importlib.util.spec_from_file_location(f"verl_lite_user_reward_{abs(hash(str(file.resolve())))}", file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        raise RewardError(f"importing reward function file {path!r} failed: {type(e).__name__}: {e}") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        raise RewardError(f"{path!r} defines no function {name!r} (reward.custom_reward_function.name)")
    return fn


def _as_score(value: Any, where: str) -> float:
    """A finite float from a number (bool, int, float, numpy scalar, 0-d tensor); else RewardError."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise RewardError(f"{where} returned {value!r} of type {type(value).__name__}; a score must be a number")
    score = float(value)
    if not math.isfinite(score):
        raise RewardError(f"{where} returned a non-finite score {score}; return a finite number")
    return score


class RewardManager:
    """Scores decoded responses with the configured function (see module docstring).

    reward_cfg: `cfg.reward` (reward_manager, custom_reward_function.{path,name,reward_kwargs}).
    compute_score: optional callable overriding the config (Python API).
    """

    def __init__(self, reward_cfg, tokenizer, compute_score: Callable | None = None):
        self.mode = reward_cfg.reward_manager
        if self.mode not in REWARD_MANAGERS:
            raise ValueError(f"reward.reward_manager={self.mode!r} is unknown; choose one of {list(REWARD_MANAGERS)}")
        custom = reward_cfg.custom_reward_function
        self.reward_kwargs = dict(custom.reward_kwargs or {})
        if compute_score is not None:
            self.fn, self.fn_name = compute_score, getattr(compute_score, "__qualname__", repr(compute_score))
        elif custom.path:
            self.fn, self.fn_name = load_reward_function(custom.path, custom.name), f"{custom.path}:{custom.name}"
        else:
            self.fn, self.fn_name = default_compute_score, "verl_lite.reward.default_compute_score"
            if self.mode == "batch":
                self.fn = _batched(default_compute_score)
        self.tokenizer = tokenizer

    def decode(self, responses: list[list[int]]) -> list[str]:
        return [self.tokenizer.decode(list(r), skip_special_tokens=True) for r in responses]

    def __call__(self, responses, data_sources, ground_truths, extra_infos=None):
        n = len(responses)
        extra_infos = list(extra_infos) if extra_infos is not None else [None] * n
        data_sources, ground_truths = list(data_sources), list(ground_truths)
        if not (len(data_sources) == len(ground_truths) == len(extra_infos) == n):
            raise ValueError(
                f"RewardManager: {n} responses but {len(data_sources)} data_sources, {len(ground_truths)} "
                f"ground_truths, {len(extra_infos)} extra_infos; pass one of each per response"
            )
        texts = self.decode(responses)
        if self.mode == "naive":
            results = []
            for i, text in enumerate(texts):
                try:
                    results.append(self.fn(data_source=data_sources[i], solution_str=text,
                                           ground_truth=ground_truths[i], extra_info=extra_infos[i], **self.reward_kwargs))
                except Exception as e:
                    raise RewardError(
                        f"reward function {self.fn_name} raised {type(e).__name__}: {e} on sample {i} "
                        f"(data_source={data_sources[i]!r})"
                    ) from e
        else:
            try:
                results = self.fn(data_sources=data_sources, solution_strs=texts, ground_truths=ground_truths,
                                  extra_infos=extra_infos, **self.reward_kwargs)
            except Exception as e:
                raise RewardError(
                    f"batched reward function {self.fn_name} raised {type(e).__name__}: {e} on a batch of {n} "
                    f"samples (data_sources={sorted(set(map(str, data_sources)))})"
                ) from e
            try:
                results = list(results)
            except TypeError as e:
                raise RewardError(f"batched reward function {self.fn_name} returned {type(results).__name__}, "
                                  f"not a list of {n} scores") from e
            if len(results) != n:
                raise RewardError(
                    f"batched reward function {self.fn_name} returned {len(results)} scores for {n} samples; "
                    f"return one score per sample"
                )
        return self._collect(results, data_sources)

    def _collect(self, results, data_sources):
        scores: list[float] = []
        extra: dict[str, list] = {}
        for i, r in enumerate(results):
            where = f"reward function {self.fn_name} on sample {i} (data_source={data_sources[i]!r})"
            if isinstance(r, dict):
                if "score" not in r:
                    raise RewardError(f"{where} returned a dict without 'score' (keys: {sorted(r)}); add 'score'")
                scores.append(_as_score(r["score"], where))
                for k, v in r.items():
                    if k != "score":
                        extra.setdefault(k, [None] * len(results))[i] = v
            else:
                scores.append(_as_score(r, where))
        return torch.tensor(scores, dtype=torch.float32), extra


def _batched(fn: Callable) -> Callable:
    """A per-sample compute_score as a batched one."""

    def batched(data_sources, solution_strs, ground_truths, extra_infos, **kw):
        return [fn(data_source=d, solution_str=s, ground_truth=g, extra_info=e, **kw)
                for d, s, g, e in zip(data_sources, solution_strs, ground_truths, extra_infos)]

    batched.__qualname__ = f"batched({getattr(fn, '__qualname__', fn)})"
    return batched
