"""LoRA's layout rules are checked before any worker starts (they used to surface in ``init_model``, minutes in):
adapters on q/k/v at a TP that does not divide the KV heads, and adapter dropout under TP."""

from __future__ import annotations

import pytest

from verl_lite.config import ConfigError, load_config, validate_config

TP4 = ["trainer.n_gpus_per_node=4", "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4"]


def lines(overrides, words) -> list[str]:
    try:
        validate_config(load_config(overrides))
    except ConfigError as err:
        return [p for p in err.problems if words in p]
    return []


def test_lora_on_qkv_past_the_kv_heads_is_refused_before_start():
    # the shipped model: 4 attention heads, 2 KV heads
    found = lines([*TP4, "actor_rollout_ref.model.lora.rank=8"], "num_key_value_heads=2")
    assert len(found) == 1 and "actor_rollout_ref.model.lora.rank=8" in found[0]
    assert "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=4" in found[0]
    assert not lines([*TP4, "actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.model.lora.target_modules=[o_proj]"],
                     "num_key_value_heads")  # no adapter on q/k/v: nothing to split by KV group
    assert not lines(TP4, "num_key_value_heads")  # no LoRA


def test_lora_dropout_under_tp_is_refused_before_start():
    found = lines([*TP4[:1], "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                   "actor_rollout_ref.model.lora.rank=8", "actor_rollout_ref.model.lora.dropout=0.1"], "dropout=0.1")
    assert len(found) == 1 and "tensor_model_parallel_size=2" in found[0]


@pytest.mark.parametrize("tp", [1, 2])
def test_lora_that_fits_the_layout_is_accepted(tp):
    assert not lines(["trainer.n_gpus_per_node=2", f"actor_rollout_ref.actor.megatron.tensor_model_parallel_size={tp}",
                      "actor_rollout_ref.model.lora.rank=8"], "lora")
