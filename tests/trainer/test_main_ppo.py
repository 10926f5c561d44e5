"""CLI helpers: --recipe YAML files become Hydra overrides that the config loader accepts."""

from pathlib import Path

import pytest

from verl_lite.config import ConfigError, load_config
from verl_lite.trainer.main_ppo import expand_recipes


def test_recipe_expands_to_overrides_before_cli_ones(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("actor_rollout_ref:\n  actor:\n    optim:\n      lr: 3.0e-4\n      betas: [0.8, 0.9]\n"
                      "    policy_loss:\n      loss_mode: gspo\ndata:\n  val_batch_size: null\n")
    args = expand_recipes(["--recipe", str(recipe), "actor_rollout_ref.actor.optim.lr=5e-5"])
    cfg = load_config(args)
    assert cfg.actor_rollout_ref.actor.optim.lr == 5e-5  # the command line wins
    assert list(cfg.actor_rollout_ref.actor.optim.betas) == [0.8, 0.9]
    assert cfg.actor_rollout_ref.actor.policy_loss.loss_mode == "gspo" and cfg.data.val_batch_size is None


def test_shipped_recipes_load():
    recipes = Path(__file__).resolve().parents[2] / "recipes"
    for name in sorted(p.stem for p in recipes.glob("*.yaml")):
        load_config(expand_recipes([f"--recipe={recipes / name}.yaml"]))


def test_missing_recipe_is_a_config_error():
    with pytest.raises(ConfigError, match="no such file"):
        expand_recipes(["--recipe", "nope.yaml"])


def test_verls_config_head_is_passed_over_and_a_config_of_ones_own_is_refused():
    """verl's launch scripts start with ``--config-path=config --config-name='ppo_megatron_trainer.yaml'``: that names
    the one config verl_lite has, so the command line runs unchanged; another config name is refused with the fix."""
    verl_head = ["--config-path=config", "--config-name='ppo_megatron_trainer.yaml'", "--config-path", "./config",
                 "--config-name", "ppo_trainer", "data.train_batch_size=8"]
    assert expand_recipes(verl_head) == ["data.train_batch_size=8"]
    with pytest.raises(ConfigError, match=r"--config-name=my_grpo: verl_lite has one config.*--recipe FILE\.yaml"):
        expand_recipes(["--config-name=my_grpo"])


def test_an_override_without_a_value_says_what_an_override_is():
    with pytest.raises(ConfigError, match=r"could not parse the override 'data\.train_batch_size'.*an override is "
                                          r"key=value \(e\.g\. data\.train_batch_size=16\)"):
        load_config(["data.train_batch_size"])
