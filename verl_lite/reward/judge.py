"""Scores from a generative reward model, an LLM judge (``reward_model.generative=true``), in ONE worker process
of its own. Per step (``JudgeReward.score``): the judge prompts (``render_prompt``, placeholders filled in one pass),
ONE generate call bounded by ``reward_model.judge.timeout_s`` (past it: :class:`JudgeTimeout`), then each
judgement's score (``parse_score``; unparsable: ``judge.unparsable_score``) (docs/reward_models.md, "The judge").
"""

from __future__ import annotations

import math
import re
from typing import Any, Sequence

from verl_lite.errors import RunFailure

PLACEHOLDERS = ("question", "response", "reference")
_PLACEHOLDER = re.compile(r"\{(" + "|".join(PLACEHOLDERS) + r")\}")
_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"  # always parses as a float
_PARSERS = {"tag": re.compile(r"<score>\s*(" + _NUMBER + r")\s*</score>", re.IGNORECASE),
            "last_number": re.compile(_NUMBER)}
SCORE_PARSERS = tuple(_PARSERS)


class JudgeTimeout(RunFailure):
    """The judge's generate call of a step did not finish within ``reward_model.judge.timeout_s``."""


class JudgeInputTooLong(RunFailure):
    """A rendered judge prompt is longer than ``reward_model.rollout.prompt_length``."""


def template_placeholders(template: str) -> set[str]:
    """The placeholders ``template`` uses (a subset of ``PLACEHOLDERS``)."""
    return set(_PLACEHOLDER.findall(template))


def render_prompt(template: str, question: str, response: str, reference: Any = None) -> str:
    """``template`` with ``{question}``, ``{response}``, ``{reference}`` filled in ONE pass: text in a value that
    looks like a placeholder is never replaced."""
    values = {"question": question, "response": response, "reference": "" if reference is None else str(reference)}
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], template)


def parse_score(text: str, parser: str = "tag", score_min: float | None = None,
                score_max: float | None = None) -> float | None:
    """The score in a judgement (``tag``: the number in the LAST ``<score>x</score>``; ``last_number``: the last
    number), or None (unparsable) when there is none, it is not finite or it is outside [``score_min``,
    ``score_max``]."""
    if parser not in _PARSERS:
        raise ValueError(f"unknown score parser {parser!r}; choose one of {list(SCORE_PARSERS)}")
    found = _PARSERS[parser].findall(text)
    value = float(found[-1]) if found else math.nan
    if not math.isfinite(value) or (score_min is not None and value < score_min) or (
            score_max is not None and value > score_max):
        return None
    return value


def judgement_scores(texts: Sequence[str], judge_cfg) -> tuple[list[float], list[bool]]:
    """(scores, parsed?) of the judgements ``texts`` under ``reward_model.judge`` (unparsable: ``unparsable_score``)."""
    parsed = [parse_score(t, judge_cfg.score_parser, judge_cfg.score_min, judge_cfg.score_max) for t in texts]
    return ([judge_cfg.unparsable_score if s is None else s for s in parsed], [s is not None for s in parsed])


def question_text(messages: Any, prompt_ids: Sequence[int], policy_tokenizer) -> str:
    """The question of a row: its last user message (or the plain-text prompt); without messages, the prompt's
    tokens decoded (special tokens skipped)."""
    if isinstance(messages, str):
        return messages
    if messages:
        users = [m.get("content", "") for m in messages if m.get("role") == "user"]
        if users:
            return str(users[-1])
    return policy_tokenizer.decode(list(prompt_ids), skip_special_tokens=True)


def judge_prompt_ids(text: str, judge_tokenizer, apply_chat_template: bool) -> list[int]:
    """The judge's input ids of a rendered prompt (one user turn of its chat template when asked and present)."""
    if apply_chat_template and getattr(judge_tokenizer, "chat_template", None):
        text = judge_tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                   add_generation_prompt=True)
    return list(judge_tokenizer(text, add_special_tokens=False)["input_ids"])


class JudgeReward:
    """Scores [n] of a rollout batch from the judge worker (a one-rank ``RoleGroup`` of ``RolloutWorker``);
    ``rm_cfg``: the ``reward_model`` section."""

    def __init__(self, group, policy_tokenizer, judge_tokenizer, rm_cfg):
        self.group, self.policy_tokenizer, self.judge_tokenizer = group, policy_tokenizer, judge_tokenizer
        self.rollout, self.judge = rm_cfg.rollout, rm_cfg.judge
        self.needs_reference = "reference" in template_placeholders(self.judge.prompt_template)

    def prompts(self, batch) -> list[str]:
        """The rendered judge prompt (text) of every trajectory."""
        from verl_lite.protocol import response_lengths  # tensordict: on use

        lengths = response_lengths(batch["response_mask"]).tolist()
        messages = batch["messages"] if "messages" in batch.non_tensors else [None] * len(batch)
        refs = batch["ground_truth"] if "ground_truth" in batch.non_tensors else [None] * len(batch)
        out = []
        for i, k in enumerate(lengths):
            if self.needs_reference and refs[i] is None:
                raise ValueError(f"reward_model.judge.prompt_template names {{reference}} but row {i} of the batch "
                                 f"has no ground truth; give every row one or drop {{reference}} from the template")
            response = self.policy_tokenizer.decode(batch["responses"][i, :k].tolist(), skip_special_tokens=True)
            question = question_text(messages[i], batch["prompt_ids"][i], self.policy_tokenizer)
            out.append(render_prompt(self.judge.prompt_template, question, response, refs[i]))
        return out

    def inputs(self, batch) -> list[list[int]]:
        """The judge's input ids of every trajectory; one longer than ``reward_model.rollout.prompt_length`` stops
        the step with the fix (it would be cut, and a cut judgement reads another question)."""
        ids = [judge_prompt_ids(t, self.judge_tokenizer, self.judge.apply_chat_template) for t in self.prompts(batch)]
        longest = max(map(len, ids), default=0)
        if longest > self.rollout.prompt_length:
            raise JudgeInputTooLong(
                f"a judge prompt has {longest} tokens, over reward_model.rollout.prompt_length="
                f"{self.rollout.prompt_length}", "raise reward_model.rollout.prompt_length (within the judge model's "
                "max_position_embeddings, with reward_model.rollout.response_length) or shorten the template")
        return ids

    def sampling(self) -> dict:
        r = self.rollout
        return dict(n=1, do_sample=r.do_sample, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                    max_new_tokens=r.response_length)

    def generate(self, inputs: list[list[int]], seed: int | None) -> list[dict]:
        """ONE generate call for every input, bounded by ``reward_model.judge.timeout_s``."""
        from verl_lite.controller.worker_group import WorkerTimeout  # Ray: on use

        base = int(seed or 0) * 31 + 17  # not the policy's own per-prompt seeds: the judge's draws are its own
        seeds = [(base + i) % (2**31 - 1) for i in range(len(inputs))] if self.rollout.do_sample else None
        try:
            return self.group.generate(inputs, seeds, self.sampling(), timeout_s=self.judge.timeout_s)
        except WorkerTimeout:
            raise JudgeTimeout(
                f"the judge did not finish its {len(inputs)} judgements within reward_model.judge.timeout_s="
                f"{self.judge.timeout_s:g}s (backend {self.rollout.name}, up to {self.rollout.response_length} new "
                f"tokens each); its worker was stopped and the step failed",
                "raise reward_model.judge.timeout_s, lower reward_model.rollout.response_length, or give the judge "
                "a faster backend (reward_model.rollout.name=vllm on a GPU)") from None

    def score(self, batch, seed: int | None = None):
        """(scores [n] float32, metrics) of a rollout batch: one judge call for the whole batch."""
        import torch

        outs = self.generate(self.inputs(batch), seed)
        texts = [self.judge_tokenizer.decode(o["response_ids"], skip_special_tokens=True) for o in outs]
        scores, parsed = judgement_scores(texts, self.judge)
        eos, n, unparsable = self.judge_tokenizer.eos_token_id, max(1, len(outs)), sum(not p for p in parsed)
        truncated = sum(not (o["response_ids"] and o["response_ids"][-1] == eos) for o in outs)
        metrics = {"reward_model/judge_unparsable_rate": unparsable / n,
                   "reward_model/judge_unparsable": float(unparsable),
                   "reward_model/judge_response_length/mean": sum(len(o["response_ids"]) for o in outs) / n,
                   "reward_model/judge_truncated_rate": truncated / n}
        return torch.tensor(scores, dtype=torch.float32), metrics
