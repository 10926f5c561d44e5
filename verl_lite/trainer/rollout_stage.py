"""Rollouts and their scores, the first stage of an RL step: ``Rollouts`` generates and scores (reward functions,
a reward model or judge, DAPO's overlong shaping and dynamic sampling, remax's greedy baseline). Where a step's
rollouts come from (colocated, a pipeline, a stream) is its rollout source: ``trainer.rollout_sources``."""

from __future__ import annotations

from typing import Callable

import torch

from verl_lite.agent.loop import agent_rows
from verl_lite.algorithms import groups_with_signal, overlong_penalty
from verl_lite.controller import RoleGroup
from verl_lite.engine.moe import UNKNOWN_EXPERT
from verl_lite.errors import RunFailure
from verl_lite.protocol import ROUTED_EXPERTS_KEY, Batch, response_lengths
from verl_lite.reward import RewardError
from verl_lite.reward.model_reward import combine_scores
from verl_lite.trainer import metrics as M
from verl_lite.utils.seeds import dynamic_sampling_seed, rollout_seed



def routing_column(outs: list[dict]) -> dict[str, torch.Tensor]:
    """The samples' MoE routing (``ROUTED_EXPERTS_KEY``: uint8 [prompt + response, layers, k] each) as one column
    ``[n, longest, layers, k]``, ``UNKNOWN_EXPERT`` past each sequence."""
    rows = [o[ROUTED_EXPERTS_KEY] for o in outs]
    column = torch.full((len(rows), max(r.shape[0] for r in rows), *rows[0].shape[1:]), UNKNOWN_EXPERT,
                        dtype=torch.uint8)
    for i, r in enumerate(rows):
        column[i, : r.shape[0]] = r
    return {ROUTED_EXPERTS_KEY: column}

class DynamicSamplingError(RunFailure):
    """DAPO's dynamic sampling hit ``algorithm.filter_groups.max_num_gen_batches``."""


def round_uid_prefix(round_index: int) -> str:
    """The uid prefix of a step's generation round: none for the first, ``r<k>-`` for DAPO's further ones."""
    return f"r{round_index}-" if round_index else ""


def correct(scores: torch.Tensor, extra: dict) -> torch.Tensor:
    """Per-sample correctness: the reward's own ``acc`` field when it returns one, else the full score 1.0
    (so shaped rewards with partial credit do not count as correct)."""
    if extra.get("acc") is not None and all(a is not None for a in extra["acc"]):
        return torch.as_tensor([bool(a) for a in extra["acc"]])
    return scores >= 1.0


class Rollouts:
    """Sampling and scoring over the placement's roles (``placement.actor`` samples unless a role is given;
    ``placement.reward_model`` scores with ``reward_model.enable``). ``step``: the RL step (0-based) the
    rollouts are for; it names their prompt groups (uid) and seeds the reward model's sampling."""

    def __init__(self, cfg, tokenizer, reward_manager, agent, generation_kwargs: dict, placement):
        self.cfg, self.tokenizer, self.reward_manager, self.agent = cfg, tokenizer, reward_manager, agent
        self.generation_kwargs, self.placement = generation_kwargs, placement

    def generate(self, rows: list[dict], n: int, sampling: dict, seed: int | None, step: int, uid_prefix: str = "",
                 role: RoleGroup | None = None) -> Batch:
        """n responses per prompt, prompts split over all workers of ``role`` (default: the actor's; each holds
        a full rollout model). With a seed, prompt p is sampled with its own seed ``seed + p``, so the rollouts
        do not depend on the layout. Trajectory p * n + k is sample k of prompt p. Multi-turn: the workers'
        agent loops (``verl_lite.agent.loop``) on the same role."""
        prompts = [list(r["prompt_ids"]) for r in rows]
        seeds = None if seed is None else [seed + p for p in range(len(prompts))]
        agent = self.agent is not None
        outs = (role or self.placement.actor).generate(agent_rows(rows) if agent else prompts, seeds, dict(sampling, n=n),
                                                       method="generate_agent" if agent else "generate")
        return self.batch_of(rows, outs, n, step, uid_prefix)

    def batch_of(self, rows: list[dict], outs: list[dict], n: int, step: int, uid_prefix: str = "") -> Batch:
        """The rollout batch of ``rows`` and their samples ``outs`` (prompt-major, ``n`` per row): responses
        right-padded, the response mask (holes at environment tokens), the behaviour log-probs, the rows' fields
        per trajectory, a uid per prompt group; multi-turn outputs add their stats and per-turn rewards."""
        prompts = [list(r["prompt_ids"]) for r in rows]
        width = max(len(o["response_ids"]) for o in outs)
        num = len(outs)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        responses = torch.full((num, width), pad, dtype=torch.long)
        mask = torch.zeros((num, width), dtype=torch.float32)
        rollout_lp = torch.zeros((num, width), dtype=torch.float32)
        for i, o in enumerate(outs):
            k = len(o["response_ids"])
            responses[i, :k] = torch.as_tensor(o["response_ids"], dtype=torch.long)
            mask[i, :k] = torch.as_tensor(o["response_mask"], dtype=torch.float32) if "response_mask" in o else 1.0
            rollout_lp[i, :k] = torch.as_tensor(o["log_probs"], dtype=torch.float32)

        def repeat(values):
            return [v for v in values for _ in range(n)]

        agent_columns = {k: [o[k] for o in outs] for k in ("agent_stats", "turn_scores")} if self.agent else {}
        routing = routing_column(outs) if ROUTED_EXPERTS_KEY in outs[0] else {}
        return Batch.from_dict(
            {"responses": responses, "response_mask": mask, "rollout_log_probs": rollout_lp, **routing},
            {
                "prompt_ids": repeat(prompts),
                "uid": repeat([f"{step}-{uid_prefix}{p}" for p in range(len(rows))]),
                "data_source": repeat([r["data_source"] for r in rows]),
                "ground_truth": repeat([r["ground_truth"] for r in rows]),
                "extra_info": repeat([r.get("extra_info") for r in rows]),
                "messages": repeat([r.get("messages") for r in rows]),  # the prompt as chat (a reward model re-renders it)
                **agent_columns,  # multi-turn: per-trajectory stats and the interactions' per-turn rewards
            },
        )

    def score(self, batch: Batch) -> tuple[torch.Tensor, dict]:
        """Scores [n] of the responses (the reward manager decodes them and names the function and
        the sample in any RewardError: a raise, a non-number, NaN/inf, or a wrong count)."""
        lengths = response_lengths(batch["response_mask"]).tolist()
        responses = [batch["responses"][i, :k].tolist() for i, k in enumerate(lengths)]
        kwargs = {"prompts": batch["prompt_ids"]} if hasattr(self.reward_manager, "names") else {}
        scores, extra = self.reward_manager(responses, batch["data_source"], batch["ground_truth"],
                                            batch["extra_info"], **kwargs)
        if "turn_scores" in batch:  # multi-turn: the interactions' per-turn rewards add to the score
            scores = scores + torch.tensor([float(sum(t)) for t in batch["turn_scores"]], dtype=scores.dtype)
        if scores.numel() != len(batch):  # the manager checks this too; never train on misaligned rewards
            raise RewardError(f"reward returned {scores.numel()} scores for {len(batch)} responses")
        return scores.float(), extra

    def training_scores(self, batch: Batch, m: dict, step: int) -> tuple[torch.Tensor, dict]:
        """The reward function's scores, or with ``reward_model.enable`` the RM's (or the judge's) score
        (+ rule_reward_weight x the function's; weight 0: the function is not called). Validation always uses
        :meth:`score`."""
        reward_model = self.placement.reward_model
        if reward_model is None:
            return self.score(batch)
        rm_scores, rm_metrics = reward_model.score(batch, rollout_seed(self.cfg.trainer.seed, step))
        m.update(rm_metrics)
        m.update(M.stats("reward/model_score", rm_scores))
        weight = self.cfg.reward_model.rule_reward_weight
        rule, extra = self.score(batch) if weight != 0 else (None, {})
        return combine_scores(rm_scores, rule, weight), extra

    def shaped_scores(self, batch: Batch, m: dict, step: int) -> tuple[torch.Tensor, dict]:
        """Training scores plus DAPO's overlong penalty when ``reward.overlong_buffer.enable``."""
        scores, extra = self.training_scores(batch, m, step)
        for name in getattr(self.reward_manager, "names", ()):  # each reward function of the Python API, if called
            if name in extra:  # over the samples it scored (a function returns None where it does not apply)
                m[f"reward/{name}/mean"] = float(torch.tensor(extra[name], dtype=torch.float64).nanmean())
        ob = self.cfg.reward.overlong_buffer
        if ob.enable:
            penalty = overlong_penalty(response_lengths(batch["response_mask"]), self.cfg.data.max_response_length,
                                       ob.len, ob.penalty_factor).float()
            scores = scores + penalty
            m["reward/overlong_penalty_mean"] = float(penalty.mean())
            m["reward/overlong_fraction"] = float((penalty < 0).float().mean())
        return scores, extra

    def generate_and_score(self, rows: list[dict], more_rows: Callable[[], list[dict]], m: dict,
                           step: int) -> tuple[Batch, torch.Tensor, dict]:
        """Rollouts and scores of one step from ``rows`` (DAPO's further rounds: ``more_rows()``, a
        ``data.train_batch_size`` batch of prompts per round, as verl generates them)."""
        n, sampling = self.cfg.actor_rollout_ref.rollout.n, self.training_sampling()
        base_seed = rollout_seed(self.cfg.trainer.seed, step)

        def generation_round(round_index: int, groups_needed: int) -> Batch:
            if round_index == 0:
                return self.generate(rows, n, sampling, base_seed, step)
            return self.generate(more_rows(), n, sampling, dynamic_sampling_seed(base_seed, round_index), step,
                                 uid_prefix=round_uid_prefix(round_index))

        return self.scored_rounds(generation_round, m, step)

    def scored_rounds(self, generation_round: Callable[[int, int], Batch], m: dict,
                      step: int) -> tuple[Batch, torch.Tensor, dict]:
        """The step's batch and its scores from ``generation_round(round_index, groups_needed)`` (a batch of
        prompt groups; its uids distinct across rounds). One round; with ``algorithm.filter_groups.enable``
        (DAPO dynamic sampling) groups without spread in their metric are dropped and rounds go on until
        ``data.train_batch_size`` groups remain (at most ``filter_groups.max_num_gen_batches`` rounds)."""
        cfg, n = self.cfg, self.cfg.actor_rollout_ref.rollout.n
        fg, wanted = cfg.algorithm.filter_groups, cfg.data.train_batch_size
        if not fg.enable:
            batch = generation_round(0, wanted)
            return (batch, *self.shaped_scores(batch, m, step))
        kept: list[tuple[Batch, torch.Tensor, dict]] = []
        num_groups = dropped = 0
        for round_index in range(fg.max_num_gen_batches):
            batch = generation_round(round_index, wanted - num_groups)
            scores, extra = self.shaped_scores(batch, m, step)
            metric = correct(scores, extra).float() if fg.metric == "acc" else scores
            keep_uids = set(groups_with_signal(metric.tolist(), batch["uid"]))
            dropped += len(batch) // n - len(keep_uids)
            keep = [i for i, uid in enumerate(batch["uid"]) if uid in keep_uids]
            if keep:
                kept.append((batch.select(keep), scores[keep], {k: [v[i] for i in keep] for k, v in extra.items()}))
            num_groups += len(keep_uids)
            if num_groups >= wanted:
                break
        else:
            raise DynamicSamplingError(
                f"dynamic sampling (algorithm.filter_groups) found only {num_groups} of {wanted} "
                f"prompt groups with a non-constant {fg.metric!r} in {fg.max_num_gen_batches} generation rounds at "
                f"step {step + 1}; raise algorithm.filter_groups.max_num_gen_batches, or check the "
                f"reward (every sample of most prompts scores the same)")
        batch = Batch.concat([b for b, _, _ in kept]).select(range(wanted * n))
        scores = torch.cat([s for _, s, _ in kept])[: len(batch)]
        extra = {k: [v for _, _, e in kept for v in e[k]][: len(batch)] for k in kept[0][2]}
        m["dynamic_sampling/groups_dropped"] = dropped
        m["dynamic_sampling/generation_rounds"] = round_index + 1
        return batch, scores, extra

    def sampling(self, do_sample: bool, temperature: float, top_p: float, top_k: int) -> dict:
        """The backend's sampling arguments (responses up to ``data.max_response_length``, the API's
        generation_kwargs)."""
        return dict(do_sample=do_sample, temperature=temperature, top_p=top_p, top_k=top_k,
                    max_new_tokens=self.cfg.data.max_response_length, **self.generation_kwargs)

    def training_sampling(self) -> dict:
        r = self.cfg.actor_rollout_ref.rollout
        return self.sampling(True, r.temperature, r.top_p, r.top_k)

    def greedy_baseline(self, batch: Batch, step: int) -> torch.Tensor:
        """remax: the score of one greedy response per prompt of ``batch``, repeated for its n samples."""
        r, keys = self.cfg.actor_rollout_ref.rollout, ("prompt_ids", "data_source", "ground_truth", "extra_info", "messages")
        rows = [{k: batch[k][i] for k in keys} for i in range(0, len(batch), r.n)]  # trajectory p * n: prompt p's first
        greedy = self.generate(rows, 1, self.sampling(False, r.temperature, 1.0, -1), None, step, uid_prefix="greedy-")
        scores, _ = self.shaped_scores(greedy, {}, step)
        return scores.repeat_interleave(r.n)
