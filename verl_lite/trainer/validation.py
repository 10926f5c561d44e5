"""Validation: held-out prompts, decoded per ``rollout.val_kwargs`` (greedy by default), scored by the reward
function (never the reward model)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from verl_lite.agent.metrics import tool_call_rate
from verl_lite.protocol import Batch, response_lengths
from verl_lite.trainer.rollout_stage import Rollouts, correct
from verl_lite.utils.seeds import validation_seed


def validate(rollouts: Rollouts, val_dataset, step: int, run_dir: Path | None) -> dict[str, float]:
    """Mean score and accuracy over ``val_dataset`` after ``step`` RL steps (multi-turn: the tool-call rate
    too); ``run_dir``: where ``trainer.log_val_generations`` writes."""
    cfg = rollouts.cfg
    vk = cfg.actor_rollout_ref.rollout.val_kwargs
    rows = [val_dataset[i] for i in range(len(val_dataset))]
    size = cfg.data.val_batch_size or len(rows)
    sampling = rollouts.sampling(vk.do_sample, vk.temperature, vk.top_p, vk.top_k)
    all_scores, all_correct, agent_stats = [], [], []
    for k in range(0, len(rows), size):
        seed = validation_seed(cfg.trainer.seed, k) if vk.do_sample else None
        batch = rollouts.generate(rows[k:k + size], vk.n, sampling, seed, step)
        scores, extra = rollouts.score(batch)
        if k == 0:
            _log_val_generations(rollouts, batch, scores, step, run_dir)
        all_scores.append(scores)
        all_correct.append(correct(scores, extra))
        agent_stats += batch["agent_stats"] if "agent_stats" in batch else []
    scores, hits = torch.cat(all_scores), torch.cat(all_correct)
    out = {"val/reward_mean": float(scores.mean()), "val/accuracy": float(hits.float().mean())}
    if agent_stats:  # multi-turn: how often the policy calls a tool on held-out prompts
        out["val/tool_call_rate"] = tool_call_rate(agent_stats)
    return out


def _log_val_generations(rollouts: Rollouts, batch: Batch, scores: torch.Tensor, step: int,
                         run_dir: Path | None) -> None:
    """``trainer.log_val_generations`` = N > 0: the first N validation samples (prompt, response, score)
    of this validation, appended to ``<run dir>/val_generations.jsonl`` (verl logs the same table)."""
    n = min(rollouts.cfg.trainer.log_val_generations, len(batch))
    if n <= 0 or run_dir is None:
        return
    decode = rollouts.tokenizer.decode
    lengths = response_lengths(batch["response_mask"]).tolist()
    with open(Path(run_dir) / "val_generations.jsonl", "a") as f:
        for i in range(n):
            f.write(json.dumps({"step": step, "prompt": decode(list(batch["prompt_ids"][i])),
                                "response": decode(batch["responses"][i, : int(lengths[i])].tolist()),
                                "score": float(scores[i])}) + "\n")
