"""verl's keys keep verl's meaning: the FSDP-style ``lora_rank`` brings verl's FSDP default ``lora_alpha`` 16 (the
megatron-style ``lora.rank`` keeps verl's megatron default 32), and two keys for one setting that disagree on the
command line are refused (verl reads them as two settings; here they are one), naming both."""

from __future__ import annotations

import pytest

from verl_lite.config import ConfigError, load_config

M = "actor_rollout_ref.model"


@pytest.mark.parametrize("overrides, alpha", [
    ([f"{M}.lora_rank=8"], 16.0),  # verl FSDP: lora_alpha defaults to 16
    ([f"{M}.lora.rank=8"], 32.0),  # verl megatron: lora.alpha defaults to 32
    ([f"{M}.lora_rank=8", f"{M}.lora_alpha=64"], 64.0),
    ([f"{M}.lora_rank=8", f"{M}.lora.alpha=4"], 4.0),  # an alpha given under either name wins
    ([f"{M}.lora.alpha=4", f"{M}.lora_rank=8"], 4.0),
])
def test_the_lora_alpha_that_comes_with_the_rank_key(overrides, alpha):
    lora = load_config(overrides).actor_rollout_ref.model.lora
    assert (lora.rank, lora.alpha) == (8, alpha)


def test_the_critic_lora_rank_brings_its_own_alpha():
    cfg = load_config(["critic.model.lora_rank=4"])
    assert (cfg.critic.model.lora.rank, cfg.critic.model.lora.alpha) == (4, 16.0)
    assert cfg.actor_rollout_ref.model.lora.alpha == 32.0  # the actor's untouched


def test_two_keys_for_one_setting_that_disagree_are_refused_naming_both():
    with pytest.raises(ConfigError) as err:
        load_config([f"{M}.lora_rank=8", f"{M}.lora.rank=16", f"{M}.lora_alpha=16", f"{M}.lora.alpha=32"])
    assert len(err.value.problems) == 2, err.value.problems
    assert f"{M}.lora_rank=8 and {M}.lora.rank=16" in err.value.problems[0]
    assert f"{M}.lora_alpha=16 and {M}.lora.alpha=32" in err.value.problems[1]
    cfg = load_config([f"{M}.lora_rank=8", f"{M}.lora.rank=8"])  # agreeing: one setting, said twice
    assert cfg.actor_rollout_ref.model.lora.rank == 8
    cfg = load_config([f"{M}.lora.rank=8", f"{M}.lora.rank=16"])  # one key twice: the last wins (Hydra's rule)
    assert cfg.actor_rollout_ref.model.lora.rank == 16


def test_a_warm_up_longer_than_the_run_is_refused_before_start_in_rl_steps():
    """The LR schedule counts RL steps (verl's rule; the engine test proves the lrs): a decaying schedule whose warm-up
    does not end before the run's last step is refused at construction, not when the workers build the optimizer."""
    from verl_lite.trainer.ppo_trainer import PPOTrainer

    A = "actor_rollout_ref.actor.optim"
    with pytest.raises(ConfigError) as err:
        PPOTrainer(load_config([f"{A}.lr_warmup_steps=3", f"{A}.lr_decay_style=cosine",
                                "trainer.total_training_steps=3"]))
    assert err.value.problems == [f"{A}.lr_warmup_steps=3 must be < the run's RL steps=3 for lr_decay_style='cosine'"]
    PPOTrainer(load_config([f"{A}.lr_warmup_steps=2", f"{A}.lr_decay_style=cosine", "trainer.total_training_steps=3"]))
