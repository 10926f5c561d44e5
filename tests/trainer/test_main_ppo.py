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


def test_verls_config_head_is_passed_over_and_a_config_of_ones_own_is_its_first_recipe(tmp_path):
    """verl's launch scripts start with ``--config-path=config --config-name='ppo_megatron_trainer.yaml'``: that names
    the one config verl_lite has, so the command line runs unchanged. A config of the user's own (verl's multi-turn
    examples: a YAML with Hydra's ``hydra`` / ``defaults`` head and verl keys) is read first, as Hydra composes it,
    under the command line; its problems and the command line's come in one pass."""
    verl_head = ["--config-path=config", "--config-name='ppo_megatron_trainer.yaml'", "--config-path", "./config",
                 "--config-name", "ppo_trainer", "data.train_batch_size=8"]
    assert expand_recipes(verl_head) == ["data.train_batch_size=8"]
    own = tmp_path / "config" / "my_multiturn_grpo.yaml"
    own.parent.mkdir()
    own.write_text("hydra:\n  searchpath:\n    - file://verl/trainer/config\n"
                   "defaults:\n  - ppo_megatron_trainer\n  - _self_\n"
                   "data:\n  max_prompt_length: 64\n  train_batch_size: 8\n  return_raw_chat: True\n"
                   "actor_rollout_ref:\n  hybrid_engine: True\n  rollout:\n    multi_turn:\n      enable: True\n"
                   "      max_user_turns: 5\n")
    items = expand_recipes([f"--config-path={own.parent}", "--config-name", "my_multiturn_grpo",
                            "data.train_batch_size=16"])
    assert items == [f"--recipe={own}", "data.train_batch_size=16"]
    cfg = load_config(items)
    assert (cfg.data.max_prompt_length, cfg.data.train_batch_size) == (64, 16)  # the command line over the file
    assert cfg.actor_rollout_ref.rollout.multi_turn.enable
    own.write_text("defaults:\n  - ppo_trainer\n  - my_rollout\n  - _self_\ndata:\n  max_prompt_lenght: 64\n")
    with pytest.raises(ConfigError) as err:
        load_config(expand_recipes([f"--config-path={own.parent}", "--config-name=my_multiturn_grpo",
                                    "data.train_batch_sze=4"]))
    assert len(err.value.problems) == 3, err.value.problems  # the file's two and the command line's, together
    text = str(err.value)
    assert "'my_rollout'" in text and "data.max_prompt_length" in text and "data.train_batch_size" in text
    with pytest.raises(ConfigError, match="my_grpo.yaml: cannot be read as YAML"):
        load_config(expand_recipes(["--config-name=my_grpo"]))


def test_an_override_without_a_value_says_what_an_override_is():
    with pytest.raises(ConfigError, match=r"could not parse the override 'data\.train_batch_size'.*an override is "
                                          r"key=value \(e\.g\. data\.train_batch_size=16\)"):
        load_config(["data.train_batch_size"])
