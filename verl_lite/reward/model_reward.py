"""Scores from a discriminative reward model (``reward_model.*``), the driver's side of the reward-model role
(``workers/reward_model.py``): the RM's input (``rm_inputs``: the policy's tokens, or re-rendered with the RM's
template), score_i = w . h_i[last token], and the training score (``combine_scores``): RM + ``rule_reward_weight``
x rule (docs/reward_models.md, "What is computed").
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from verl_lite.protocol import Batch, response_lengths

RM_METHOD = "compute_rm_score"


def renders_alike(policy_tokenizer, rm_tokenizer) -> bool:
    """Whether the RM reads the policy's token ids as they are: the same vocabulary and chat template."""
    return (policy_tokenizer.get_vocab() == rm_tokenizer.get_vocab()
            and getattr(policy_tokenizer, "chat_template", None) == getattr(rm_tokenizer, "chat_template", None))


def rerendered(messages, response_text: str, rm_tokenizer) -> list[int]:
    """The conversation ``messages`` + the response as the assistant turn, in the RM's chat template and tokens."""
    chat = [{"role": "user", "content": messages}] if isinstance(messages, str) else [dict(m) for m in messages]
    text = rm_tokenizer.apply_chat_template(chat + [{"role": "assistant", "content": response_text}], tokenize=False)
    return list(rm_tokenizer(text, add_special_tokens=False)["input_ids"])


def rm_inputs(prompt_ids: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], messages: Sequence[Any] | None,
              policy_tokenizer, rm_tokenizer, rerender: bool) -> list[list[int]]:
    """The RM's input ids of every trajectory (docs/reward_models.md, "The input"). ``responses``: the valid tokens."""
    if not rerender:
        return [list(p) + list(r) for p, r in zip(prompt_ids, responses)]
    if messages is None or any(m is None for m in messages):
        raise ValueError("the reward model's tokenizer/chat template differs from the policy's, so each response is "
                         "rendered again in the RM's template from the prompt's chat messages; these rows carry none")
    return [rerendered(m, policy_tokenizer.decode(list(r), skip_special_tokens=True), rm_tokenizer)
            for m, r in zip(messages, responses)]


def rm_batch(inputs: Sequence[Sequence[int]]) -> Batch:
    """The rows the role reads: ``prompt_ids`` = the RM input, one placeholder response token (0) after it
    (its value-head output is the score at the input's last token; workers/reward_model.py)."""
    n = len(inputs)
    return Batch.from_dict({"responses": torch.zeros((n, 1), dtype=torch.long), "response_mask": torch.ones(n, 1)},
                           {"prompt_ids": [list(x) for x in inputs]})


def combine_scores(rm_scores: torch.Tensor, rule_scores: torch.Tensor | None, rule_reward_weight: float) -> torch.Tensor:
    """Training score = RM score + rule_reward_weight x rule score (None / weight 0: the RM alone)."""
    if rule_scores is None or rule_reward_weight == 0:
        return rm_scores
    return rm_scores + rule_reward_weight * rule_scores.to(rm_scores.dtype)


class ModelReward:
    """Scores [n] of a rollout batch from the reward-model role (``RoleGroup`` of ``RewardModelWorker``)."""

    def __init__(self, group, policy_tokenizer, rm_tokenizer, sizing):
        self.group, self.sizing = group, sizing
        self.policy_tokenizer, self.rm_tokenizer = policy_tokenizer, rm_tokenizer
        self.rerender = not renders_alike(policy_tokenizer, rm_tokenizer)

    def inputs(self, batch: Batch) -> list[list[int]]:
        lengths = response_lengths(batch["response_mask"]).tolist()
        responses = [batch["responses"][i, :k].tolist() for i, k in enumerate(lengths)]
        messages = batch["messages"] if "messages" in batch.non_tensors else None
        return rm_inputs(batch["prompt_ids"], responses, messages, self.policy_tokenizer, self.rm_tokenizer,
                         self.rerender)

    def __call__(self, batch: Batch) -> torch.Tensor:
        return self.group.infer(RM_METHOD, rm_batch(self.inputs(batch)), self.sizing)["rm_scores"].float()

    def score(self, batch: Batch, seed: int | None = None) -> tuple[torch.Tensor, dict]:
        """(scores, metrics) as ``reward.judge.JudgeReward.score`` gives them (``seed``: unused, a forward draws nothing)."""
        return self(batch), {}
