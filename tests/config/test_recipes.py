"""``--recipe`` works from any directory: a shipped recipe by name, a path from the repository root,
or any YAML path; an unknown name lists the shipped recipes."""

from __future__ import annotations

from pathlib import Path

import pytest

from verl_lite.config import ConfigError, load_config
from verl_lite.trainer.main_ppo import RECIPES_DIR, expand_recipes, resolve_recipe

SHIPPED = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def test_every_shipped_recipe_resolves_by_name_from_another_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert {"ppo", "grpo", "gspo", "dapo"} <= set(SHIPPED)
    for name in SHIPPED:
        path = resolve_recipe(name)
        assert path == RECIPES_DIR / f"{name}.yaml"
        assert resolve_recipe(f"{name}.yaml") == path and resolve_recipe(f"recipes/{name}.yaml") == path
        load_config(expand_recipes(["--recipe", name]))  # every key of the recipe is a schema key


def _leaves(node, prefix=""):
    for key, value in node.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


def test_every_file_a_shipped_recipe_names_exists_from_another_directory(tmp_path, monkeypatch):
    """A shipped recipe names its own assets with ``${verl_lite:...}`` (the installed package), so they resolve from
    any working directory, as the recipe itself does."""
    from omegaconf import OmegaConf

    monkeypatch.chdir(tmp_path)
    checked = 0
    for name in SHIPPED:
        cfg = load_config(expand_recipes(["--recipe", name]))
        for key in _leaves(OmegaConf.to_container(OmegaConf.load(RECIPES_DIR / f"{name}.yaml"))):
            if not key.rsplit(".", 1)[-1].endswith(("path", "files")):
                continue
            value = OmegaConf.select(OmegaConf.structured(cfg), key)
            for item in (list(value) if OmegaConf.is_list(value) else [value]):
                if item:
                    assert Path(item).exists(), f"--recipe {name}: {key}={item} does not exist from {tmp_path}"
                    checked += 1
    assert checked >= 6  # ppo_rm's reward model, tool_agent's data, model, tool config and reward file


def test_recipe_by_name_sets_its_keys_and_the_command_line_wins(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = load_config(expand_recipes(["--recipe", "ppo", "algorithm.gamma=0.9"]))
    assert cfg.algorithm.adv_estimator == "gae" and cfg.algorithm.gamma == 0.9
    own = tmp_path / "mine.yaml"
    own.write_text("trainer:\n  experiment_name: mine\n")
    assert load_config(expand_recipes([f"--recipe={own}"])).trainer.experiment_name == "mine"


def test_unknown_recipe_lists_the_shipped_ones(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="gspo") as info:
        resolve_recipe("nope")
    assert "no shipped recipe" in str(info.value)


def test_a_wrong_type_in_a_recipe_file_is_one_line(tmp_path):
    """A recipe value that does not fit the schema's type gets the override's one line (key, type, example),
    prefixed by the file, instead of OmegaConf's traceback."""
    own = tmp_path / "bad.yaml"
    own.write_text("data:\n  train_batch_size: sixteen\n")
    with pytest.raises(ConfigError) as info:
        load_config(expand_recipes([f"--recipe={own}"]))
    assert info.value.problems == [f"--recipe {own}: data.train_batch_size=sixteen: expects an integer, "
                                   "e.g. data.train_batch_size=16"]
