"""Multi-turn end to end on the shipped tiny model, through the Python API (``PPOTrainer(interactions=...)``):
an interaction asks two follow-up questions, so every trajectory has three model segments with two
environment segments between them. The rollout's log-probs equal the trainer's recomputed ones on every
model token (fp32, 1e-5); the environment tokens are exactly the chat template's rendering of the user turns,
carry mask 0 and no log-prob, and an RL step (the loss over the mask with holes) runs with the agent metrics."""

from __future__ import annotations

import math

import torch

from tests.e2e.conftest import OUTPUT_DIR, shared_ray  # noqa: F401  (fixture)
from verl_lite.agent import ChatGlue, Interaction, InteractionTurn

FOLLOW_UPS = ["11+22=", "40+5="]


class TwoMoreQuestions(Interaction):
    def start(self, row):
        return {"asked": 0}

    def respond(self, state, messages):
        if state["asked"] == len(FOLLOW_UPS):
            return InteractionTurn("", reward=0.0, done=True)
        state["asked"] += 1
        return InteractionTurn(FOLLOW_UPS[state["asked"] - 1], reward=0.0)


def _segments(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) runs of the mask."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((mask[start], start, i))
            start = i
    return out


def test_three_turn_trajectories_are_exact_end_to_end(shared_ray):  # noqa: F811
    from verl_lite.config import load_config
    from verl_lite.trainer.ppo_trainer import PPOTrainer

    cfg = load_config(["data.max_response_length=40", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2",
                       "actor_rollout_ref.actor.ppo_mini_batch_size=2", "trainer.total_training_steps=1",
                       "trainer.val_before_train=false", "trainer.test_freq=-1", f"trainer.output_dir={OUTPUT_DIR}",
                       "trainer.n_gpus_per_node=1"])
    trainer = PPOTrainer(cfg, interactions={"tutor": TwoMoreQuestions()})
    assert cfg.actor_rollout_ref.rollout.multi_turn.enable
    glue = ChatGlue(trainer.tokenizer)
    expected_env = [glue.ids([{"role": "user", "content": q}]) for q in FOLLOW_UPS]
    rows = [trainer.train_dataset[i] for i in range(2)]
    sampling = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=-1, max_new_tokens=40)
    try:
        trainer.start()
        batch = trainer.rollouts.generate(rows, 2, sampling, seed=1234, step=0)
        old = trainer.updates.compute_old_log_probs(batch)["log_probs"]
        mask, responses, rollout_lp = batch["response_mask"], batch["responses"], batch["rollout_log_probs"]
        for i in range(len(batch)):
            stats = batch["agent_stats"][i]
            assert (stats["assistant_turns"], stats["stop_reason"]) == (3, "interaction_done"), stats
            n = stats["model_tokens"] + stats["env_tokens"]
            row_mask = mask[i, :n].long().tolist()
            segs = _segments(row_mask)
            assert [v for v, _, _ in segs] == [1, 0, 1, 0, 1], segs
            for (_, s, e), want in zip([seg for seg in segs if seg[0] == 0], expected_env):
                assert responses[i, s:e].tolist() == want  # the template's user turn, tokenized once
                assert torch.all(rollout_lp[i, s:e] == 0)
            for _, s, e in (seg for seg in segs if seg[0] == 1):
                assert int(responses[i, e - 1]) == trainer.tokenizer.eos_token_id  # each model turn ended itself
            assert torch.all(mask[i, n:] == 0)
        on_model = mask != 0
        gap = (rollout_lp.double() - old.double()).abs()[on_model]
        assert gap.numel() > 0 and float(gap.max()) < 1e-5, float(gap.max())
        m = trainer.step(iter([rows]))  # an RL step over the masks with holes
    finally:
        trainer.close()
    assert m["agent/turns_mean"] == 3.0 and m["agent/turns_max"] == 3.0 and m["agent/env_tokens_mean"] > 0
    assert m["agent/tool_calls_mean"] == 0.0 and m["agent/stop/interaction_done"] == 1.0
    assert math.isfinite(m["actor/pg_loss"]) if "actor/pg_loss" in m else math.isfinite(m["actor/loss"])
