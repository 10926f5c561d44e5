"""TRL's GRPOTrainer arguments that PPOTrainer takes with TRL's meaning, or refuses before start with the reason:
``peft_config`` (a real ``peft.LoraConfig``) into the engine's LoRA keys, ``eval_dataset`` as the held-out set,
``rollout_func`` / ``environment_factory`` refused naming what to use. Pre-flight only: no worker starts."""

from __future__ import annotations

import pytest

from verl_lite.config import load_config
from verl_lite.errors import ConfigError
from verl_lite.trainer.ppo_trainer import PPOTrainer


def test_peft_config_becomes_the_lora_section():
    from peft import LoraConfig

    cfg = load_config([])
    PPOTrainer(cfg, peft_config=LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))
    lora = cfg.actor_rollout_ref.model.lora
    assert (lora.rank, lora.alpha, lora.dropout, lora.target_modules) == (8, 16.0, 0.0, ["q_proj", "v_proj"])
    cfg = load_config([])
    PPOTrainer(cfg, peft_config=LoraConfig(r=4, lora_alpha=8))  # PEFT's own default targets for the model type
    assert cfg.actor_rollout_ref.model.lora.target_modules == ["q_proj", "v_proj"]


def test_peft_features_the_engine_does_not_build_are_refused():
    from peft import LoraConfig

    with pytest.raises(ConfigError) as err:
        PPOTrainer(load_config([]), peft_config=LoraConfig(r=8, lora_alpha=16, use_dora=True, bias="all"))
    text = str(err.value)
    assert "peft_config.use_dora=True" in text and "peft_config.bias='all'" in text


def test_eval_dataset_is_the_held_out_set():
    rows = [{"prompt": [{"role": "user", "content": "1+2="}], "reward_model": {"ground_truth": "3"},
             "data_source": "synthetic/addition"}] * 4
    trainer = PPOTrainer(load_config([]), eval_dataset=rows)
    assert len(trainer.val_dataset) == 4
    with pytest.raises(ValueError, match="not both"):
        PPOTrainer(load_config([]), eval_dataset=rows, val_dataset=rows)


@pytest.mark.parametrize("name, words", [("rollout_func", "agent loop"), ("environment_factory", "interaction")])
def test_trl_arguments_not_built_are_refused_with_what_to_use(name, words):
    with pytest.raises(ConfigError) as err:
        PPOTrainer(load_config([]), **{name: lambda *a, **k: None})
    assert f"{name}=" in str(err.value) and words in str(err.value)
