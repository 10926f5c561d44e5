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
a dict without "score", a batched function returning the wrong number of scores, a call that
does not return within `reward.timeout_s` (per batch call), or the reward process dying.

Where the code runs (`verl_lite.reward.sandbox`): a reward FILE (`custom_reward_function.path`)
is imported once, in its own process, started when the manager is built (before Ray); a hang
is killed there, a crash cannot take the driver down. A Python callable (`compute_score=`) and
the built-in scorer run in a thread of the driver under the same time bound. Set-up problems
(the file fails to import, defines no such function, or cannot take `reward_kwargs`) raise
`RewardConfigError`, a `ConfigError` (exit 2), before anything starts. Call `close()` when done.
"""

from __future__ import annotations

import importlib.util
import math
import numbers
from pathlib import Path
from typing import Any, Callable

import torch

from verl_lite.errors import ConfigError
from verl_lite.reward.config import REWARD_MANAGERS
from verl_lite.reward.scorers import default_compute_score

KEY = "reward.custom_reward_function"


class RewardError(RuntimeError):
    """A reward function failed or returned something that is not a finite score."""

    exit_code, describe_prefix = 1, "the run stopped: "  # verl_lite.errors.describe


class RewardConfigError(ConfigError, RewardError):
    """The reward function cannot be set up as configured (found before the run starts)."""


def load_reward_function(path: str, name: str) -> Callable:
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
        from verl_lite.reward.sandbox import InProcessReward, RewardCallFailed, RewardProcess

        self.mode = reward_cfg.reward_manager
        if self.mode not in REWARD_MANAGERS:
            raise ValueError(f"reward.reward_manager={self.mode!r} is unknown; choose one of {list(REWARD_MANAGERS)}")
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
                if e.kind == "load" and str(e).startswith("not callable: "):
                    raise RewardConfigError([f"{KEY}.name={custom.name!r}: {custom.path} binds {custom.name!r} to a value of type "
                                             f"{str(e).split(': ', 1)[1]}, not a function; set {KEY}.name to a function "
                                             f"of that file"]) from None
                if e.kind == "load" and str(e) == "missing":
                    raise RewardConfigError([f"{KEY}.name={custom.name!r}: {custom.path} defines no function "
                                             f"{custom.name!r}; set {KEY}.name to a function of that file"]) from None
                if e.kind == "load":
                    raise RewardConfigError([f"{KEY}.path={custom.path!r} fails to import ({e}); fix the file"]) from None
                raise RewardError(f"the reward process for {self.fn_name} could not start: {e}") from None
        else:
            self.fn_name = "verl_lite.reward.default_compute_score"
            self.runner = InProcessReward(default_compute_score if self.mode == "naive"
                                          else _batched(default_compute_score))
        problem = self.runner.signature_problem(self.mode, list(self.reward_kwargs))
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

    def decode(self, responses: list[list[int]]) -> list[str]:
        return [self.tokenizer.decode(list(r), skip_special_tokens=True) for r in responses]

    def __call__(self, responses, data_sources, ground_truths, extra_infos=None):
        from verl_lite.reward.sandbox import RewardCallFailed

        n = len(responses)
        extra_infos = list(extra_infos) if extra_infos is not None else [None] * n
        data_sources, ground_truths = list(data_sources), list(ground_truths)
        if not (len(data_sources) == len(ground_truths) == len(extra_infos) == n):
            raise ValueError(
                f"RewardManager: {n} responses but {len(data_sources)} data_sources, {len(ground_truths)} "
                f"ground_truths, {len(extra_infos)} extra_infos; pass one of each per response"
            )
        texts = self.decode(responses)
        batched = self.mode == "batch"
        label = f"batched reward function {self.fn_name}" if batched else f"reward function {self.fn_name}"
        try:
            results = self.runner(self.mode, texts, data_sources, ground_truths, extra_infos, self.reward_kwargs,
                                  self.timeout_s)
        except RewardCallFailed as e:
            i = e.sample
            at = (f"on sample {i} (data_source={data_sources[i]!r}) of a batch of {n}" if i is not None
                  else f"on a batch of {n} samples (samples 0..{n - 1}, data_sources={sorted(set(map(str, data_sources)))})")
            if e.kind == "timeout":
                raise RewardError(
                    f"{label} did not return within reward.timeout_s={self.timeout_s}s {at}; the call was "
                    f"abandoned; make the function faster or raise reward.timeout_s"
                ) from None
            if e.kind == "died":
                raise RewardError(f"{label}: {e} {at}; a fresh reward process starts on the next call") from None
            if e.kind == "bad_result":
                raise RewardError(f"{label} {e}") from None
            raise RewardError(f"{label} raised {e} {at}") from e.cause
        if batched:
            results = as_score_list(results, n, f"batched reward function {self.fn_name}")
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


def as_score_list(results, n: int, label: str) -> list:
    """A batched reward's result as a list of n entries; else RewardError naming ``label``."""
    try:
        results = list(results)
    except TypeError as e:
        raise RewardError(f"{label} returned {type(results).__name__}, not a list of {n} scores") from e
    if len(results) != n:
        raise RewardError(f"{label} returned {len(results)} scores for {n} samples; return one score per sample")
    return results


def _batched(fn: Callable) -> Callable:
    """A per-sample compute_score as a batched one."""

    def batched(data_sources, solution_strs, ground_truths, extra_infos, **kw):
        return [fn(data_source=d, solution_str=s, ground_truth=g, extra_info=e, **kw)
                for d, s, g, e in zip(data_sources, solution_strs, ground_truths, extra_infos)]

    batched.__qualname__ = f"batched({getattr(fn, '__qualname__', fn)})"
    return batched
