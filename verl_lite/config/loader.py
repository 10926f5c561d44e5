"""Loading the config: Hydra compose over the structured schema, unknown keys rejected.

    cfg = load_config(sys.argv[1:])   # PPOConfig; then validate_config(cfg) before any worker starts

Under ``@hydra.main(config_path=CONFIG_DIR, config_name="ppo_trainer")`` call ``register_configs()`` at
import time and ``config_from_hydra(dict_cfg)`` in the main function. Both reject keys the schema does
not have, Hydra's ``+key=value`` additions included, naming the key and a close key of the same section.
Only free-form dict fields (``reward.custom_reward_function.reward_kwargs``,
``*.megatron.override_transformer_config``) take new keys. verl's command-line keys that are not schema
keys go through ``verl_keys`` in ``load_config`` only (under ``@hydra.main`` Hydra composes first).
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from pathlib import Path
from typing import Any

from verl_lite.config.schema import PPOConfig

CONFIG_DIR = str(Path(__file__).resolve().parent)
CONFIG_NAME = "ppo_trainer"
ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"
DEFAULT_MODEL_DIR = ASSETS_DIR / "tiny-addition"
DEFAULT_DATA_DIR = ASSETS_DIR / "synthetic-addition"


class ConfigError(ValueError):
    """A bad config. `problems` lists every problem found, each naming the key and the fix."""

    exit_code = 2  # verl_lite.errors.describe

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid config ({len(self.problems)} problem(s)):\n{lines}")


def default_model_path() -> str:
    """The shipped tiny model (HF format, tokenizer included)."""
    return str(DEFAULT_MODEL_DIR)


def default_data_files() -> tuple[list[str], list[str]]:
    """The shipped synthetic-addition parquet files: ([train], [val])."""
    return [str(DEFAULT_DATA_DIR / "train.parquet")], [str(DEFAULT_DATA_DIR / "val.parquet")]


def register_configs() -> None:
    """Register the schema in Hydra's ConfigStore as `ppo_trainer` (the config Hydra composes; no YAML restates it)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=CONFIG_NAME, node=PPOConfig)


# ---------------------------------------------------------------- the key space of the schema


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _is_free_dict(tp: Any) -> bool:
    return typing.get_origin(tp) in (dict, typing.Dict)


def schema_keys(cls: type = PPOConfig, prefix: str = "") -> dict[str, str]:
    """All dotted keys of the schema -> 'section' | 'leaf' | 'dict' (a free-form dict that takes any sub-key)."""
    keys: dict[str, str] = {}
    for name, tp in _field_types(cls).items():
        key = f"{prefix}{name}"
        if _is_dataclass_type(tp):
            keys[key] = "section"
            keys.update(schema_keys(tp, key + "."))
        else:
            keys[key] = "dict" if _is_free_dict(tp) else "leaf"
    return keys


def _free_dict_parent(key: str, keys: dict[str, str]) -> str | None:
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        parent = ".".join(parts[:i])
        if keys.get(parent) == "dict":
            return parent
    return None


def unknown_key_message(key: str, keys: dict[str, str] | None = None) -> str:
    """'unknown config key X; did you mean Y?' naming Y only when it is close and in the same section.

    Y is a key of X's deepest existing section whose last part is close to X's last part, or the
    one valid key that X is the dotted tail of (a key given without its prefix). Otherwise no hint."""
    keys = keys if keys is not None else schema_keys()
    parts = key.split(".")
    parent = ""
    for i in range(len(parts) - 1, 0, -1):
        cand = ".".join(parts[:i])
        if keys.get(cand) == "section":
            parent = cand
            break
    close: list[str] = []
    if parent or len(parts) == 1:
        prefix = parent + "." if parent else ""
        siblings = {k[len(prefix):]: k for k in keys if k.startswith(prefix) and "." not in k[len(prefix):]}
        wanted = key[len(prefix):]
        close = [siblings[m] for m in difflib.get_close_matches(wanted, list(siblings), n=1, cutoff=0.75)]
    if not close:
        tails = [k for k in keys if k.endswith("." + key)]
        close = tails if len(tails) == 1 else []
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return f"unknown config key '{key}'{hint} (see docs/config.md for the full list)"


def _classify(key: str, keys: dict[str, str]) -> str | None:
    """'schema' (a leaf/section/dict key), 'free' (under a free-form dict) or None (not in the schema)."""
    if keys.get(key) in ("leaf", "dict", "section"):
        return "schema"
    if _free_dict_parent(key, keys) is not None:
        return "free"
    return None


def translate_overrides(overrides: list[str]) -> tuple[list[str], list[tuple[str, object, str]]]:
    """Parse Hydra overrides; map verl's vocabulary (``verl_keys``); raise ConfigError for keys that are
    rejected or unknown. Returns (overrides to compose, equality checks ``(key, value, message)``
    to run on the composed config).

    `key=value` under a free-form dict field is rewritten to `++key=value` (add or replace).
    `hydra.*` overrides pass through untouched.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from verl_lite.config.verl_keys import decide, render

    keys = schema_keys()
    problems, out, equal = [], [], []
    try:
        parsed = OverridesParser.create().parse_overrides(overrides=list(overrides))
    except Exception as e:  # hydra's grammar errors
        raise ConfigError([f"could not parse overrides {list(overrides)}: {e}"]) from e
    for raw, ov in zip(overrides, parsed):
        key = ov.key_or_group
        if key.startswith("hydra.") or key == "hydra":
            out.append(raw)
            continue
        if ov.is_delete():
            problems.append(f"'~{key}': deleting schema keys is not supported; set the key to a value instead")
            continue
        kind = _classify(key, keys)
        if kind == "schema":
            # A '+' addition of an existing key is what Hydra calls an error; accept it as a plain override.
            out.append(raw.lstrip("+") if ov.is_add() else raw)
            continue
        if kind == "free":
            out.append("++" + raw.lstrip("+"))
            continue
        try:
            value = ov.value()
        except Exception:  # interpolations and sweeps: keep the text
            value = raw.split("=", 1)[1] if "=" in raw else None
        decision = decide(key, value)
        if decision is None:
            problems.append(unknown_key_message(key, keys))
        elif decision.kind == "alias":
            target_kind = _classify(decision.target, keys)
            if target_kind is None:
                problems.append(unknown_key_message(decision.target, keys) + f" (from verl's '{key}')")
            else:
                out.append(("++" if target_kind == "free" else "") + f"{decision.target}={render(decision.value)}")
        elif decision.kind == "equal":
            equal.append((decision.target, decision.value, decision.message))
        elif decision.kind == "rejected":
            problems.append(decision.message)
    if problems:
        raise ConfigError(problems)
    return out, equal


def _get_dotted(cfg, key: str):
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    return node


def check_equal(cfg, equal: list[tuple[str, object, str]]) -> None:
    """verl keys accepted only when equal to verl_lite's key (e.g. ref layout = actor layout)."""
    problems = []
    for target, value, message in equal:
        actual = _get_dotted(cfg, target)
        same = actual == value or (value is None and actual is None)
        if not same and isinstance(actual, (int, float)) and isinstance(value, str):
            try:
                same = type(actual)(value) == actual
            except ValueError:
                same = False
        if not same:
            problems.append(f"{message} (it is {actual!r})")
    if problems:
        raise ConfigError(problems)


# ---------------------------------------------------------------- compose and convert


# (section path, key, source path): a null `key` of `section` takes the value at `source` (verl's
# `${oc.select:...}` defaults). In order: a source may itself be inherited above it.
INHERITED = (
    ("actor_rollout_ref.model", "tokenizer_path", "actor_rollout_ref.model.path"),
    ("actor_rollout_ref.actor", "clip_ratio_low", "actor_rollout_ref.actor.clip_ratio"),
    ("actor_rollout_ref.actor", "clip_ratio_high", "actor_rollout_ref.actor.clip_ratio"),
    ("actor_rollout_ref.actor", "loss_scale_factor", "data.max_response_length"),
    *((section, f"log_prob_{key}", f"actor_rollout_ref.actor.{source}")
      for section in ("actor_rollout_ref.ref", "actor_rollout_ref.rollout")
      for key, source in (("micro_batch_size_per_gpu", "ppo_micro_batch_size_per_gpu"),
                          ("use_dynamic_bsz", "use_dynamic_bsz"),
                          ("max_token_len_per_gpu", "ppo_max_token_len_per_gpu"))),
    ("critic.model", "path", "actor_rollout_ref.model.path"),
    ("critic.model", "tokenizer_path", "critic.model.path"),
    *(("critic", key, f"actor_rollout_ref.actor.{key}")
      for key in ("ppo_mini_batch_size", "ppo_micro_batch_size_per_gpu", "ppo_epochs", "loss_agg_mode",
                  "use_dynamic_bsz", "shuffle")),
    ("critic", "forward_micro_batch_size_per_gpu", "critic.ppo_micro_batch_size_per_gpu"),
    ("critic", "forward_max_token_len_per_gpu", "critic.ppo_max_token_len_per_gpu"),
)


def resolve_inherited(cfg: PPOConfig) -> PPOConfig:
    """Every "null = another key's value" of the schema (``INHERITED``), resolved in place, so the
    loaded config (and a run's config.json) holds the values that run; idempotent."""
    for section, key, source in INHERITED:
        node = _get_dotted(cfg, section)
        if getattr(node, key) is None:
            setattr(node, key, _get_dotted(cfg, source))
    return cfg


def _fill_builtin_defaults(cfg: PPOConfig) -> PPOConfig:
    """None model path / data files -> the shipped assets; a single file path -> a one-element list;
    then every inherited null resolved (``resolve_inherited``)."""
    model = cfg.actor_rollout_ref.model
    if model.path is None:
        model.path = default_model_path()
    train, val = default_data_files()
    if cfg.data.train_files is None:
        cfg.data.train_files = train
    if cfg.data.val_files is None:
        cfg.data.val_files = val
    for name in ("train_files", "val_files"):
        files = getattr(cfg.data, name)
        if isinstance(files, str):
            setattr(cfg.data, name, [files])
        elif not isinstance(files, list):
            setattr(cfg.data, name, list(files))
    return resolve_inherited(cfg)


def to_dataclass(dict_cfg) -> PPOConfig:
    """An OmegaConf DictConfig (already composed against the schema) -> PPOConfig with built-in defaults filled."""
    from omegaconf import OmegaConf

    return _fill_builtin_defaults(OmegaConf.to_object(dict_cfg))


RECIPE = "--recipe="  # an item of load_config's overrides naming a recipe file (main_ppo.expand_recipes writes them)


def _recipe_leaves(node: dict, keys: dict[str, str], prefix: str = "") -> list[str]:
    """The dotted keys a recipe sets (a free-form dict counts as one key)."""
    out = []
    for name, value in node.items():
        key = f"{prefix}{name}"
        nested = isinstance(value, dict) and value and keys.get(key) == "section"
        out += _recipe_leaves(value, keys, key + ".") if nested else [key]
    return out


def merge_recipe(node, path: str):
    """``node`` (the config composed so far) with the recipe file at ``path`` (nested schema keys) merged over
    it by OmegaConf.merge; ConfigError names a recipe's unknown key (with the close one) or a file that does
    not load."""
    from omegaconf import OmegaConf

    keys = schema_keys()
    try:
        recipe = OmegaConf.load(path)
    except Exception as e:  # noqa: BLE001 - unreadable file, YAML syntax
        raise ConfigError([f"--recipe {path}: cannot be read as YAML ({e})"]) from e
    unknown = [k for k in _recipe_leaves(OmegaConf.to_container(recipe), keys) if _classify(k, keys) is None]
    if unknown:
        raise ConfigError([f"--recipe {path}: {unknown_key_message(k, keys)}" for k in unknown])
    return OmegaConf.merge(node, recipe)


def _compose(node, overrides: list[str]):
    """Hydra's compose of ``node`` (stored as ConfigStore ``ppo_trainer``) with ``overrides``."""
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.core.global_hydra import GlobalHydra

    ConfigStore.instance().store(name=CONFIG_NAME, node=node)
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
        return compose(config_name=CONFIG_NAME, overrides=overrides)


def load_config(overrides: list[str] | None = None) -> PPOConfig:
    """Compose the structured schema (ConfigStore `ppo_trainer`) with Hydra, apply `overrides`, return a PPOConfig.

    An item ``--recipe=FILE`` merges that YAML file of nested schema keys over what the items before it
    built (``merge_recipe``, OmegaConf.merge); the items after it override it.

    Raises ConfigError naming any unknown key (plain or `+key`) and the closest valid key; a value of
    the wrong type raises ConfigError naming the key too. Does not validate cross-key rules: call
    `validate_config` for that.
    """
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    node, pending, equal = OmegaConf.structured(PPOConfig), [], []
    try:
        for item in [*(overrides or []), None]:
            if item is not None and not item.startswith(RECIPE):
                pending.append(item)
                continue
            if pending or item is None:
                composed, checks = translate_overrides(pending)
                node, pending, equal = _compose(node, composed), [], equal + checks
            if item is not None:
                node = merge_recipe(node, item[len(RECIPE):])
    except (HydraException, OmegaConfBaseException) as e:
        cause = f" ({e.__cause__})" if e.__cause__ is not None else ""
        raise ConfigError([f"{e}{cause}"]) from e
    finally:
        register_configs()  # the bare schema again, for the next compose
    cfg = to_dataclass(node)
    check_equal(cfg, equal)
    return cfg


def config_from_hydra(dict_cfg) -> PPOConfig:
    """For an `@hydra.main` entry: re-check the command-line overrides against the schema, then convert."""
    try:
        from hydra.core.hydra_config import HydraConfig

        task_overrides = list(HydraConfig.get().overrides.task)
    except Exception:  # not running under hydra.main
        task_overrides = []
    _, equal = translate_overrides(task_overrides)
    cfg = to_dataclass(dict_cfg)
    check_equal(cfg, equal)
    return cfg


def config_to_dict(cfg: PPOConfig) -> dict:
    """A plain nested dict (for logging, metrics headers and Ray transport)."""
    return dataclasses.asdict(cfg)
