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
