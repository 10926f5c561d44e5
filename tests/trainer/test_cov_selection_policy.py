"""clip_cov / kl_cov select tokens as verl does: from the CURRENT policy's log-probs of each whole
mini-batch (the parameters its optimizer step starts from), not the rollout-time ones."""

from __future__ import annotations

import torch

from tests.e2e.conftest import shared_ray, tiny_assets, tiny_overrides  # noqa: F401  (fixtures)


def test_later_mini_batches_select_from_the_moved_policy(tiny_assets, shared_ray, monkeypatch):
    import verl_lite.trainer.ppo_trainer as ppo_trainer
    import verl_lite.trainer.update_stage as update_stage
    from verl_lite.config import load_config

    calls = []
    real = update_stage.select_cov_tokens

    def spy(name, advantages, old_log_probs, response_mask, cfg, seed=0, log_probs=None):
        calls.append((old_log_probs.clone(), log_probs.clone(), response_mask.clone()))
        return real(name, advantages, old_log_probs, response_mask, cfg, seed=seed, log_probs=log_probs)

    monkeypatch.setattr(update_stage, "select_cov_tokens", spy)
    cfg = load_config(tiny_overrides(tiny_assets, **{
        "data.train_batch_size": 4, "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
        "data.max_response_length": 4, "trainer.total_training_steps": 1, "trainer.test_freq": 0,
        "trainer.val_before_train": "false", "trainer.logger": "[jsonl]",
        "actor_rollout_ref.actor.policy_loss.loss_mode": "kl_cov", "actor_rollout_ref.actor.optim.lr": 1e-2}))
    trainer = ppo_trainer.PPOTrainer(cfg)
    trainer.start()
    try:
        batches = trainer._train_batches()
        record = trainer.step(batches)
    finally:
        trainer.close()
    assert record["actor/num_updates"] == 2 and len(calls) == 2
    (old0, cur0, _), (old1, cur1, mask1) = calls
    assert torch.equal(cur0, old0)  # the first mini-batch is on-policy
    valid = mask1 != 0
    assert cur1.shape == old1.shape
    assert not torch.allclose(cur1[valid], old1[valid])  # after one optimizer step the policy has moved
