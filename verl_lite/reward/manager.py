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

Any failure (a raise, a non-finite or non-number score, a wrong count, a call past `reward.timeout_s`, the
reward process dying) raises `RewardError` naming the function and the sample. Set-up problems (the file fails
to import, defines no such function, or cannot take `reward_kwargs`) raise `RewardConfigError` (exit 2) before
anything starts. Call `close()` when done.
"""

from __future__ import annotations

import math
import numbers
from pathlib import Path
from typing import Any, Callable

import torch

from verl_lite.errors import ConfigError
from verl_lite.reward.scorers import default_compute_score

KEY = "reward.custom_reward_function"


class RewardError(RuntimeError):
    """A reward function failed or returned something that is not a finite score."""

    exit_code, describe_prefix = 1, "the run stopped: "  # verl_lite.errors.describe


class RewardConfigError(ConfigError, RewardError):
    """The reward function cannot be set up as configured (found before the run starts)."""


def _as_score(value: Any, where: str) -> float:
    """A finite float from a number (bool, int, float, numpy scalar, 0-d tensor) or a dict's "score"; else
    RewardError."""
    if isinstance(value, dict):
        if "score" not in value:
            raise RewardError(f"{where} returned a dict without 'score' (keys: {sorted(value)}); add 'score'")
        value = value["score"]
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
        from verl_lite.reward.sandbox import InProcessReward, RewardCallFailed, RewardProcess

        self.mode = reward_cfg.reward_manager  # a known one: RewardConfig.problems
        custom = reward_cfg.custom_reward_function
        self.reward_kwargs = dict(custom.reward_kwargs or {})
        self.timeout_s = getattr(reward_cfg, "timeout_s", None)
        self.tokenizer = tokenizer
        if compute_score is not None:
            self.fn_name = getattr(compute_score, "__qualname__", repr(compute_score))
            self.runner = InProcessReward(compute_score)
        elif custom.path:
            self.fn_name = f"{custom.path}:{custom.name}"
            if not Path(custom.path).is_file():
                raise RewardConfigError([f"{KEY}.path={custom.path!r} does not exist; give the path of a python file "
                                         f"defining {custom.name!r}"])
            try:
                self.runner = RewardProcess(custom.path, custom.name, self.mode, list(self.reward_kwargs),
                                            max_memory_gb=getattr(reward_cfg, "max_memory_gb", None))
            except RewardCallFailed as e:
                raise _load_failure(e, custom.path, custom.name, self.fn_name) from None
        else:
            self.fn_name = "verl_lite.reward.default_compute_score"
            self.runner = InProcessReward(default_compute_score)
        self.call_mode = "naive" if self.builtin else self.mode  # the built-in scorer is per sample in both modes
        problem = self.runner.signature_problem(self.call_mode, list(self.reward_kwargs))
        if problem:
            self.close()
            raise RewardConfigError([
                f"{KEY}.reward_kwargs={self.reward_kwargs} do not fit the reward function {self.fn_name} "
                f"(reward.reward_manager={self.mode}): {problem}; add the missing parameters to the function or "
                f"remove the extra keys from {KEY}.reward_kwargs"])

    @property
    def builtin(self) -> bool:
        """True when the built-in scorer (``default_compute_score``) grades the run."""
        return self.fn_name == "verl_lite.reward.default_compute_score"

    def required_inputs(self) -> dict[str, list[str]]:
        """Per function, the row fields it cannot score without: the built-in scorer needs the ground
        truth; a function in verl's signature receives ``ground_truth=None`` where a row has none."""
        return {self.fn_name: ["ground_truth"]} if self.builtin else {}

    def pids(self) -> list[int]:
        """Process ids of the reward process (empty when the reward runs in the driver)."""
        pid = getattr(self.runner, "pid", lambda: None)()
        return [pid] if pid else []

    def close(self) -> None:
        """Stop the reward process (idempotent)."""
        self.runner.close()

    def __call__(self, responses, data_sources, ground_truths, extra_infos=None):
        from verl_lite.reward.sandbox import RewardCallFailed

        n = len(responses)
        extra_infos = list(extra_infos) if extra_infos is not None else [None] * n
        data_sources, ground_truths = list(data_sources), list(ground_truths)
        if not (len(data_sources) == len(ground_truths) == len(extra_infos) == n):
            raise ValueError(f"RewardManager: {n} responses but {len(data_sources)} data_sources, {len(ground_truths)} "
                             f"ground_truths, {len(extra_infos)} extra_infos; pass one of each per response")
        texts = [self.tokenizer.decode(list(r), skip_special_tokens=True) for r in responses]
        label = f"{'batched ' if self.mode == 'batch' else ''}reward function {self.fn_name}"
        try:
            results = self.runner(self.call_mode, texts, data_sources, ground_truths, extra_infos, self.reward_kwargs,
                                  self.timeout_s)
        except RewardCallFailed as e:
            i = e.sample
            at = (f"on sample {i} (data_source={data_sources[i]!r}) of a batch of {n}" if i is not None
                  else f"on a batch of {n} samples (samples 0..{n - 1}, data_sources={sorted(set(map(str, data_sources)))})")
            if e.kind == "timeout":
                raise RewardError(f"{label} did not return within reward.timeout_s={self.timeout_s}s {at}; the call "
                                  f"was abandoned; make the function faster or raise reward.timeout_s") from None
            if e.kind == "died":
                raise RewardError(f"{label}: {e} {at}; a fresh reward process starts on the next call") from None
            if e.kind == "bad_result":
                raise RewardError(f"{label} {e}") from None
            raise RewardError(f"{label} raised {e} {at}") from e.cause
        if self.mode == "batch":
            results = as_score_list(results, n, label)
        return self._collect(results, data_sources)

    def _collect(self, results, data_sources):
        scores: list[float] = []
        extra: dict[str, list] = {}
        for i, r in enumerate(results):
            where = f"reward function {self.fn_name} on sample {i} (data_source={data_sources[i]!r})"
            scores.append(_as_score(r, where))
            for k, v in (r.items() if isinstance(r, dict) else ()):
                if k != "score":
                    extra.setdefault(k, [None] * len(results))[i] = v
        return torch.tensor(scores, dtype=torch.float32), extra


def _load_failure(e, path: str, name: str, fn_name: str) -> RewardError:
    """The error of a reward process that could not load ``path``:``name`` (``e``: its RewardCallFailed)."""
    fix = f"set {KEY}.name to a function of that file"
    problem = {"import": f"{KEY}.path={path!r} fails to import ({e}); fix the file",
               "missing": f"{KEY}.name={name!r}: {path} defines no function {name!r}; {fix}",
               "not_callable": f"{KEY}.name={name!r}: {path} binds {name!r} to a value of type {e}, not a function; "
                               f"{fix}"}.get(e.kind)
    if problem is None:
        return RewardError(f"the reward process for {fn_name} could not start: {e}")
    return RewardConfigError([problem])


def as_score_list(results, n: int, label: str) -> list:
    """A batched reward's result as a list of n entries; else RewardError naming ``label``."""
    try:
        results = list(results)
    except TypeError as e:
        raise RewardError(f"{label} returned {type(results).__name__}, not a list of {n} scores") from e
    if len(results) != n:
        raise RewardError(f"{label} returned {len(results)} scores for {n} samples; return one score per sample")
    return results

