"""TRL's reward models in ``reward_funcs``: a directory, hub id or transformers model object is the reward-model
role (a one-logit classifier: the discriminative RM; a causal LM: the generative judge), its tokenizer from
``reward_processing_classes``; the step's reward is TRL's weighted sum. What the role cannot express is refused at
construction, naming the argument."""

from __future__ import annotations

import math

import pytest

from tests.e2e.conftest import shared_ray, tiny_assets, tiny_overrides  # noqa: F401
from verl_lite.config import ConfigError, load_config
from verl_lite.config.loader import ASSETS_DIR
from verl_lite.trainer.ppo_trainer import PPOTrainer

RM_DIR = str(ASSETS_DIR / "tiny-addition-rm")
POLICY_DIR = str(ASSETS_DIR / "tiny-addition")


def one(completions, **kwargs):
    return [1.0 for _ in completions]


def test_a_reward_model_path_beside_a_function_is_the_rm_plus_the_weighted_functions():
    cfg = load_config([])
    trainer = PPOTrainer(cfg, reward_funcs=[RM_DIR, one], reward_weights=[1.0, 0.5])
    rm = cfg.reward_model
    assert (rm.enable, rm.model.path, rm.model.tokenizer_path, rm.generative, rm.rule_reward_weight) == \
        (True, RM_DIR, RM_DIR, False, 1.0)
    assert trainer.reward_manager.funcs == [one] and trainer.reward_manager.weights == [0.5]


def test_a_model_object_and_its_tokenizer_are_saved_and_used_from_the_run_dir(tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    cfg = load_config([f"trainer.output_dir={tmp_path}"])
    model = AutoModelForSequenceClassification.from_pretrained(RM_DIR)
    PPOTrainer(cfg, reward_funcs=model, reward_processing_classes=AutoTokenizer.from_pretrained(RM_DIR))
    rm = cfg.reward_model
    assert rm.enable and rm.model.path.startswith(str(tmp_path)) and rm.model.tokenizer_path.startswith(str(tmp_path))
    assert rm.rule_reward_weight == 0.0  # the model alone, as TRL's reward_funcs=[model]


def test_a_causal_lm_in_reward_funcs_is_the_generative_judge():
    cfg = load_config(["reward_model.judge.prompt_template='{question}{response}'",
                       "reward_model.rollout.prompt_length=64", "reward_model.rollout.response_length=16"])
    PPOTrainer(cfg, reward_funcs=[POLICY_DIR])
    assert cfg.reward_model.enable and cfg.reward_model.generative


@pytest.mark.parametrize("kwargs, says", [
    (dict(reward_funcs=[RM_DIR, RM_DIR]), "reward_funcs holds 2 models"),
    (dict(reward_funcs=[RM_DIR, one], reward_weights=[0.5, 1.0]), "reward_weights gives the reward model weight"),
])
def test_what_the_role_cannot_express_is_refused_at_construction(kwargs, says):
    with pytest.raises(ConfigError, match=says):
        PPOTrainer(load_config([]), **kwargs)
    with pytest.raises(ConfigError, match="give the reward model once"):
        PPOTrainer(load_config(["reward_model.enable=true", f"reward_model.model.path={RM_DIR}"]),
                   reward_funcs=[RM_DIR])


def test_a_two_step_run_scores_the_rm_plus_the_function(tiny_assets, shared_ray, tmp_path):  # noqa: F811
    overrides = tiny_overrides(tiny_assets, **{"trainer.logger": "[jsonl]", "trainer.output_dir": str(tmp_path),
                                               "trainer.test_freq": 0, "trainer.val_before_train": "false"})
    overrides = [o for o in overrides if not o.startswith("reward.custom_reward_function.path")]
    trainer = PPOTrainer(load_config(overrides), reward_funcs=[RM_DIR, one], reward_weights=[1.0, 2.0])
    history = trainer.fit()
    assert len(history) == 2
    for record in history:
        rm_mean = record["reward/model_score/mean"]
        assert math.isfinite(rm_mean)
        assert abs(record["reward/mean"] - (rm_mean + 2.0)) < 1e-5, record  # TRL's sum: RM x 1 + one x 2
