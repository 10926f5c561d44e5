"""verl's v1 trainer keys (``trainer.use_v1``, ``trainer.v1.*``) and the placement rule they share with
``actor_rollout_ref.hybrid_engine`` (``controller.config.resolve_placement``): what a verl script asks for is what runs,
or it is refused before start with the reason. Config only: no worker starts."""

from __future__ import annotations

import pytest

from verl_lite.config import load_config
from verl_lite.config.validate import validate_config
from verl_lite.errors import ConfigError


def placement(*overrides):
    cfg = load_config(list(overrides))
    validate_config(cfg)
    return cfg.actor_rollout_ref.hybrid_engine, cfg.async_training.staleness_threshold


def refusal(*overrides) -> str:
    with pytest.raises(ConfigError) as err:
        validate_config(load_config(list(overrides)))
    return str(err.value)


def test_the_lag_follows_what_the_script_asks_for():
    assert placement() == (True, 0)  # colocated, synchronous
    assert placement("trainer.use_v1=false") == (True, 0)
    # verl's one-step-off recipe: split placement, its lag of one step from its entry point
    assert placement("actor_rollout_ref.hybrid_engine=false") == (False, 1)
    assert placement("actor_rollout_ref.hybrid_engine=false", "async_training.staleness_threshold=0") == (False, 0)
    # verl's v1 separate_async: a rollout pool num_warmup_batches ahead
    assert placement("trainer.v1.trainer_mode=separate_async") == (False, 1)
    assert placement("trainer.v1.trainer_mode=separate_async", "trainer.v1.separate_async.num_warmup_batches=2",
                     "trainer.v1.sampler.max_off_policy_threshold=3", "trainer.v1.sampler.max_off_policy_strategy=wait") \
        == (False, 2)
    # colocate_async: the actor's own workers stream num_warmup_batches ahead
    assert placement("trainer.v1.trainer_mode=colocate_async") == (True, 1)
    assert placement("trainer.v1.trainer_mode=colocate_async", "trainer.v1.colocate_async.num_warmup_batches=0") \
        == (True, 0)
    assert placement("trainer.v1.trainer_mode=colocate_async", "trainer.v1.colocate_async.num_warmup_batches=2",
                     "trainer.v1.separate_async.num_warmup_batches=5") == (True, 2)


def test_the_resolved_lag_is_what_the_run_records():
    from verl_lite.config.loader import config_to_dict

    cfg = load_config(["trainer.v1.trainer_mode=separate_async"])
    assert config_to_dict(cfg)["async_training"]["staleness_threshold"] == 1
    assert config_to_dict(cfg)["actor_rollout_ref"]["hybrid_engine"] is False


@pytest.mark.parametrize("overrides, words", [
    (["trainer.v1.trainer_mode=colocate_async", "actor_rollout_ref.rollout.batch_invariant=true"],
     "colocate_async with actor_rollout_ref.rollout.batch_invariant=true"),
    (["trainer.v1.trainer_mode=colocate_async", "algorithm.adv_estimator=remax"], "remax with trainer.v1.trainer_mode"),
    (["trainer.v1.trainer_mode=colocate_async", "trainer.v1.colocate_async.num_warmup_batches=8"],
     "past trainer.v1.sampler.max_off_policy_threshold=8"),
    (["trainer.v1.trainer_mode=colocate_async", "async_training.partial_rollout=false"], "partial_rollout=false"),
    (["trainer.v1.trainer_mode=fully_async"], "is unknown"),
    (["trainer.v1.trainer_mode=separate_async", "trainer.v1.separate_async.num_warmup_batches=2",
      "trainer.v1.sampler.max_off_policy_threshold=2"], "past trainer.v1.sampler.max_off_policy_threshold=2"),
    (["trainer.v1.trainer_mode=separate_async", "trainer.v1.separate_async.parameter_sync_step=4"],
     "must equal parameter_sync_step x"),
    (["trainer.v1.sampler.max_off_policy_strategy=evict"], "is unknown"),
    (["trainer.v1.sampler.max_off_policy_threshold=0"], "must be an integer > 0"),
])
def test_what_is_not_built_or_inconsistent_is_one_line(overrides, words):
    text = refusal(*overrides)
    lines = [line for line in text.splitlines() if words in line]
    assert len(lines) == 1, text


def test_parameter_sync_step_consistent_with_the_batch_is_accepted():
    assert placement("trainer.v1.trainer_mode=separate_async", "trainer.v1.separate_async.parameter_sync_step=4",
                     "data.train_batch_size=16", "actor_rollout_ref.actor.ppo_mini_batch_size=4") == (False, 1)


@pytest.mark.parametrize("key, value", [
    ("trainer.v1.sampler.custom_sampler.path", "my_sampler.py"),
    ("trainer.v1.sampler.sync_refill_failed_groups", "true"),
    ("trainer.v1.separate_async.hybrid_rollout.enable_switch", "true"),
])
def test_v1_features_not_built_are_refused_by_name(key, value):
    with pytest.raises(ConfigError) as err:
        load_config([f"{key}={value}"])
    assert key in str(err.value) and "not built" in str(err.value)


def test_v1_defaults_of_features_not_built_are_accepted():
    load_config(["trainer.v1.sampler.sync_refill_failed_groups=false",
                 "trainer.v1.separate_async.hybrid_rollout.enable_switch=false"])
