"""Loading the config: the structured schema with the overrides applied as Hydra applies them, unknown keys rejected.

    cfg = load_config(sys.argv[1:])   # PPOConfig; then validate_config(cfg) before any worker starts

Under ``@hydra.main(config_path=CONFIG_DIR, config_name="ppo_trainer")`` call ``register_configs()`` at import time
and ``config_from_hydra(dict_cfg)`` in the main function. Only free-form dict fields take new keys; verl's keys that
are not schema keys go through ``verl_keys`` (in ``load_config`` only: under ``@hydra.main`` Hydra composes first).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import os
import re
import typing
from operator import attrgetter
from pathlib import Path
from typing import Any

from verl_lite.config.schema import PPOConfig
from verl_lite.config.verl_keys import decide, render
from verl_lite.controller.config import resolve_placement
from verl_lite.engine.model_files import resolve_model_dir
from verl_lite.errors import ConfigError, Problems  # noqa: F401 (the config's error and pre-flight's collector)

CONFIG_DIR = str(Path(__file__).resolve().parent)
ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"
DEFAULT_MODEL_DIR = ASSETS_DIR / "tiny-addition"
DEFAULT_DATA_DIR = ASSETS_DIR / "synthetic-addition"
PACKAGE_DIR = ASSETS_DIR.parent
PACKAGE_RESOLVER = "verl_lite"  # ${verl_lite:assets/tiny-addition}: a path inside the installed package


def package_path(relative: str) -> str:
    """``${verl_lite:RELATIVE}``: the absolute path of ``RELATIVE`` inside the installed verl_lite package."""
    return str(PACKAGE_DIR / relative)


def _register_resolver() -> None:
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver(PACKAGE_RESOLVER):
        OmegaConf.register_new_resolver(PACKAGE_RESOLVER, package_path)


def default_model_path() -> str:
    """The shipped tiny model (HF format, tokenizer included)."""
    return str(DEFAULT_MODEL_DIR)


def default_data_files() -> tuple[list[str], list[str]]:
    """The shipped synthetic-addition parquet files: ([train], [val])."""
    return [str(DEFAULT_DATA_DIR / "train.parquet")], [str(DEFAULT_DATA_DIR / "val.parquet")]


def register_configs() -> None:
    """Register the schema in Hydra's ConfigStore as `ppo_trainer` (no YAML restates it)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="ppo_trainer", node=PPOConfig)


# ---------------------------------------------------------------- the key space of the schema


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


@functools.cache
def schema_keys(cls: type = PPOConfig, prefix: str = "") -> dict[str, str]:
    """All dotted keys of the schema -> 'section' | 'leaf' | 'dict' (a free-form dict that takes any sub-key)."""
    keys: dict[str, str] = {}
    for name, tp in _field_types(cls).items():
        if dataclasses.is_dataclass(tp):
            keys[prefix + name] = "section"
            keys.update(schema_keys(tp, f"{prefix}{name}."))
        else:
            keys[prefix + name] = "dict" if typing.get_origin(tp) is dict else "leaf"
    return keys


def unknown_key_message(key: str, keys: dict[str, str] | None = None) -> str:
    """'unknown config key X; did you mean Y?': Y is a key of X's deepest existing section whose last part is close
    to X's, or the one valid key that X is the dotted tail of (a key given without its prefix); else no hint."""
    keys = keys if keys is not None else schema_keys()
    parts = key.split(".")
    heads = (".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1))
    parent = next((head for head in heads if keys.get(head) == "section"), "")
    close: list[str] = []
    if parent or len(parts) == 1:
        prefix = parent + "." if parent else ""
        siblings = {k[len(prefix):]: k for k in keys if k.startswith(prefix) and "." not in k[len(prefix):]}
        close = [siblings[m] for m in difflib.get_close_matches(key[len(prefix):], list(siblings), n=1, cutoff=0.75)]
    if not close and not parent and len(parts) > 1:  # an unknown section: the close section, same rest
        sections = [k for k, kind in keys.items() if kind == "section" and "." not in k]
        close = [f"{m}.{'.'.join(parts[1:])}" for m in difflib.get_close_matches(parts[0], sections, n=1, cutoff=0.75)]
        close = [c for c in close if c in keys]
    if not close:
        tails = [k for k in keys if k.endswith("." + key)]
        close = tails if len(tails) == 1 else []
    hint = f"; did you mean '{close[0]}'?" if close else ""
    return f"unknown config key '{key}'{hint} (see docs/config.md for the full list)"


def _classify(key: str, keys: dict[str, str]) -> str | None:
    """'schema' (a leaf/section/dict key), 'free' (under a free-form dict) or None (not in the schema)."""
    if key in keys:
        return "schema"
    parts = key.split(".")
    return "free" if any(keys.get(".".join(parts[:i])) == "dict" for i in range(1, len(parts))) else None


@dataclasses.dataclass
class Routed:
    """What overrides and recipes set, as ``_route`` sorts it."""

    assignments: list = dataclasses.field(default_factory=list)  # (key, value, value as given, free-form): _apply's
    equal: list = dataclasses.field(default_factory=list)  # (key, value, message): verl keys held to another key
    aliases: dict = dataclasses.field(default_factory=dict)  # verl_lite key -> the verl key that set it
    implied: dict = dataclasses.field(default_factory=dict)  # key -> verl's default that comes with a verl key given
    given: dict = dataclasses.field(default_factory=dict)  # key -> {the key as given (a verl key or itself): value}

    def absorb(self, other: "Routed", given: bool) -> None:
        """``other``'s findings into this one (``given``: also the keys as given, for ``disagreements``)."""
        self.assignments += other.assignments
        self.equal += other.equal
        self.aliases.update(other.aliases)
        self.implied.update(other.implied)
        for key, sources in other.given.items() if given else ():
            self.given.setdefault(key, {}).update(sources)

    def disagreements(self) -> list[str]:
        """Two keys for one setting (verl's name and verl_lite's, or two of verl's) with different values."""
        return [f"{' and '.join(f'{name}={render(value)}' for name, value in sources.items())} set one setting "
                f"({key}) to different values; give one of them"
                for key, sources in self.given.items() if len({render(v) for v in sources.values()}) > 1]


def translate_overrides(overrides: list[str], problems: list[str], routed: Routed | None = None) -> Routed:
    """Parse Hydra overrides and route each (``_route``) into ``routed``; a line in ``problems`` for each that does
    not parse. ``hydra.*`` overrides (Hydra's own settings) are passed over."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser, routed = OverridesParser.create(), routed if routed is not None else Routed()
    for raw in overrides:
        try:
            ov = parser.parse_overrides(overrides=[raw])[0]
        except Exception as e:  # noqa: BLE001 - hydra's grammar errors
            hint = "" if "=" in raw else "; an override is key=value (e.g. data.train_batch_size=16)"
            problems.append(f"could not parse the override {raw!r}: {str(e).splitlines()[0]}{hint}")
            continue
        key, text = ov.key_or_group, raw.split("=", 1)[1] if "=" in raw else ""
        if key.startswith("hydra.") or key == "hydra":
            continue
        if ov.is_delete():
            problems.append(f"'~{key}': deleting schema keys is not supported; set the key to a value instead")
            continue
        try:
            value = ov.value()
        except Exception:  # noqa: BLE001 - interpolations and sweeps: keep the text
            value = text
        _route(key, value, text, problems, routed)
    return routed


def _route(key: str, value: Any, text: str, problems: list[str], routed: Routed) -> None:
    """One ``key = value`` (a command-line override or a recipe's leaf) into ``routed``, with verl's vocabulary
    mapped (``verl_keys``): an alias to its target (and the defaults it implies), a key accepted only at another
    key's value into ``equal``; a rejected or unknown key is a line in ``problems``."""
    keys, source = schema_keys(), key
    kind = _classify(key, keys)
    if kind is None:
        decision = decide(key, value)
        if decision is None:
            problems.append(unknown_key_message(key, keys))
        elif decision.kind == "equal":
            routed.equal.append((decision.target, decision.value, decision.message))
        elif decision.kind == "rejected":
            problems.append(decision.message)
        if decision is None or decision.kind != "alias":
            return
        kind = _classify(decision.target, keys)
        if kind is None:
            problems.append(unknown_key_message(decision.target, keys) + f" (from verl's '{key}')")
            return
        routed.aliases[decision.target] = key
        routed.implied.update(decision.implies or {})
        key, value = decision.target, decision.value
    routed.assignments.append((key, value, text, kind == "free"))  # a '+' on a schema key is a plain override
    routed.given.setdefault(key, {})[source] = value


def check_equal(cfg, equal: list[tuple[str, object, str]]) -> list[str]:
    """The problems of verl keys accepted only when equal to verl_lite's key (e.g. ref layout = actor layout)."""
    problems = []
    for target, value, message in equal:
        actual = attrgetter(target)(cfg)
        same = actual == value
        if not same and isinstance(actual, (int, float)) and isinstance(value, str):
            with contextlib.suppress(ValueError):
                same = type(actual)(value) == actual
        if not same:
            problems.append(f"{message} (it is {actual!r})")
    return problems


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
    ("reward_model.model", "tokenizer_path", "reward_model.model.path"),
    ("reward_model", "micro_batch_size_per_gpu", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu"),
)


def resolve_inherited(cfg: PPOConfig) -> PPOConfig:
    """Every "null = another key's value" of the schema (``INHERITED``), resolved in place (idempotent)."""
    for section, key, source in INHERITED:
        node = attrgetter(section)(cfg)
        if getattr(node, key) is None:
            setattr(node, key, attrgetter(source)(cfg))
    return cfg


SPLIT_STEMS = ("train", "training", "val", "valid", "validation", "test", "data")  # stems that name no task


def _name_part(path: str, model: bool = False) -> str:
    """A file's stem (with its directory's name when the stem only names a split: gsm8k-train), or a model
    directory's name (an HF-cache snapshot's repository name), safe for a path."""
    p = Path(str(path).rstrip("/"))
    if model:
        cache = p.parent.parent.name  # <HF cache>/models--Org--Name/snapshots/<revision>
        name = cache.split("--")[-1] if p.parent.name == "snapshots" and cache.startswith("models--") else p.name
    else:
        name = f"{p.parent.name}-{p.stem}" if p.stem.lower() in SPLIT_STEMS and p.parent.name else p.stem
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "data"


def default_experiment_name(cfg) -> str:
    """trainer.experiment_name=null: ``<estimator>_<first train file>_<model>``."""
    files = cfg.data.train_files
    first = files if isinstance(files, str) else (list(files) or ["data"])[0]
    return (f"{cfg.algorithm.adv_estimator}_{_name_part(first)}_"
            f"{_name_part(cfg.actor_rollout_ref.model.path, model=True)}")


def default_checkpoint_dir(tr) -> str:
    """trainer.default_local_dir=null: ``<working directory>/checkpoints/<project_name>/<experiment_name>``."""
    return os.path.abspath(os.path.join("checkpoints", tr.project_name, tr.experiment_name))


@contextlib.contextmanager
def names_follow(cfg):
    """A derived run name and checkpoint dir follow a change of the data or the model made inside the block."""
    tr = cfg.trainer
    named, placed = tr.experiment_name == default_experiment_name(cfg), tr.default_local_dir == default_checkpoint_dir(tr)
    yield
    tr.experiment_name = default_experiment_name(cfg) if named else tr.experiment_name
    tr.default_local_dir = default_checkpoint_dir(tr) if placed else tr.default_local_dir


def use_train_data(cfg, name: str) -> None:
    """``data.train_files`` becomes ``name`` (the Python API's train_dataset); the derived names follow, and the
    shipped val split goes with the shipped train split."""
    with names_follow(cfg):
        if list(cfg.data.train_files) == default_data_files()[0] and cfg.data.val_files == default_data_files()[1]:
            cfg.data.val_files = []
        cfg.data.train_files = name


def _fill_builtin_defaults(cfg: PPOConfig) -> PPOConfig:
    """None model path / data files -> the shipped assets (the shipped val split only with the shipped train
    split); a file path -> a one-element list; derived run name and checkpoint dir; HF hub ids -> their HF-cache
    snapshot (``resolve_model_dir``); the placement and every inherited null resolved."""
    model, default_job = cfg.actor_rollout_ref.model, cfg.data.train_files is None
    if model.path is None:
        model.path = default_model_path()
    train, val = default_data_files()
    if cfg.data.train_files is None:
        cfg.data.train_files = train
    if cfg.data.val_files is None:
        cfg.data.val_files = val if default_job else []
    for name in ("train_files", "val_files"):
        files = getattr(cfg.data, name)
        setattr(cfg.data, name, [files] if isinstance(files, str) else list(files))
    tr = cfg.trainer
    tr.experiment_name = tr.experiment_name or default_experiment_name(cfg)
    tr.default_local_dir = tr.default_local_dir or default_checkpoint_dir(tr)
    for section in (model, cfg.critic.model):
        for key in ("path", "tokenizer_path"):
            if getattr(section, key):
                setattr(section, key, resolve_model_dir(getattr(section, key)))
    resolve_placement(cfg)
    return resolve_inherited(cfg)


def to_dataclass(dict_cfg) -> PPOConfig:
    """A DictConfig composed against the schema -> PPOConfig with built-in defaults filled."""
    from omegaconf import OmegaConf

    _register_resolver()  # ${verl_lite:...} values resolve here
    return _fill_builtin_defaults(OmegaConf.to_object(dict_cfg))


RECIPE = "--recipe="  # an item of load_config's overrides naming a recipe file (main_ppo.expand_recipes writes them)
VERL_TRAINER_CONFIGS = ("ppo_megatron_trainer", "ppo_trainer")  # verl's config names the schema stands for


def _recipe_leaves(node: dict, keys: dict[str, str], prefix: str = "") -> list[tuple[str, Any]]:
    """The dotted ``(key, value)`` pairs a recipe sets (a schema leaf or free-form dict is one pair)."""
    out = []
    for name, value in node.items():
        key = f"{prefix}{name}"
        walk = isinstance(value, dict) and value and keys.get(key) not in ("leaf", "dict")
        out += _recipe_leaves(value, keys, key + ".") if walk else [(key, value)]
    return out


def _defaults_problems(defaults: Any) -> list[str]:
    """A verl YAML's Hydra ``defaults`` may name verl's trainer config, ``_self_`` and Hydra's own groups (the one
    composition verl_lite builds); any other entry would bring in settings that are not read: one line each."""
    problems = []
    for entry in defaults if isinstance(defaults, list) else [defaults]:
        name = entry if isinstance(entry, str) else next(iter(entry), "") if isinstance(entry, dict) else ""
        name = str(name).removeprefix("override ").strip()
        if name in ("_self_", *VERL_TRAINER_CONFIGS) or name == "hydra" or name.startswith("hydra/"):
            continue
        problems.append(f"defaults entry {entry!r}: verl_lite composes one config, verl's trainer config "
                        f"({' / '.join(VERL_TRAINER_CONFIGS)}), with this file over it; put the settings of "
                        f"{name!r} in this file or on the command line")
    return problems


def recipe_assignments(path: str, problems: list[str], routed: Routed) -> None:
    """The YAML file at ``path`` (a recipe, or a verl config named by ``--config-name``) into ``routed``, each leaf
    routed as a command-line override is; Hydra's ``hydra`` settings passed over, ``defaults`` checked."""
    from omegaconf import OmegaConf

    try:
        recipe = OmegaConf.to_container(OmegaConf.load(path))
        if not isinstance(recipe, dict):
            raise ValueError("the file is not a mapping of keys")
    except Exception as e:  # noqa: BLE001 - missing or unreadable file, YAML syntax, a list at the top
        problems.append(f"cannot be read as YAML ({e})")
        return
    recipe.pop("hydra", None)
    problems += _defaults_problems(recipe.pop("defaults", []))
    for key, value in _recipe_leaves(recipe, schema_keys()):
        _route(key, value, render(value).replace(", ", ","), problems, routed)


def _schema_type(key: str) -> tuple[Any, bool, Any]:
    """(a dotted schema key's type without Optional (a generic's origin), whether it is nullable, its default)."""
    tp, default = PPOConfig, PPOConfig()
    for part in key.split("."):
        tp = (_field_types(tp) if dataclasses.is_dataclass(tp) else {}).get(part, Any)
        default = getattr(default, part, None)
    nullable = type(None) in typing.get_args(tp)
    base = next(t for t in typing.get_args(tp) if t is not type(None)) if nullable else tp
    return typing.get_origin(base) or base, nullable, default


def _type_problem(key: str, text: str) -> str:
    """The line for an override whose value does not fit the schema's type: key, type, an example (the default)."""
    base, nullable, default = _schema_type(key)
    words, example = {int: ("an integer", 16), float: ("a number", 0.5), bool: ("true or false", True),
                      str: ("a string", "..."), list: ("a list", ["a", "b"]), tuple: ("a list", ["a", "b"]),
                      dict: ("a mapping", {"k": "v"})}.get(base, (getattr(base, "__name__", str(base)), "..."))
    if default is not None:
        example = dataclasses.asdict(default) if dataclasses.is_dataclass(default) else default
    return f"{key}={text}: expects {words}{' (or null)' if nullable else ''}, e.g. {key}={render(example).replace(', ', ',')}"


def _apply(node, assignments: list[tuple[str, Any, str, bool]], problems: list[str]) -> None:
    """Each ``(key, value, text, free)`` onto ``node`` as Hydra's compose applies an override (merging; added under
    a free-form dict); a value of the wrong type is a line in ``problems`` (the others still apply)."""
    from omegaconf import OmegaConf

    for key, value, text, free in assignments:
        if isinstance(value, str) and not free and _schema_type(key)[0] is list:
            value = [value]  # one name for a list of names (trainer.logger=console), as verl's readers take it
        try:
            OmegaConf.update(node, key, value, merge=True, force_add=free)
        except Exception:  # noqa: BLE001 - OmegaConf's validation errors: the type does not fit
            problems.append(_type_problem(key, text))


def load_config(overrides: list[str] | None = None, problems: Problems | None = None) -> PPOConfig:
    """The schema with ``overrides`` applied in order as Hydra's compose applies them (an item ``--recipe=FILE``
    applies that YAML file there), as a PPOConfig with the built-in defaults and inherited nulls filled in.

    Raises ConfigError naming every unknown key (with the closest valid key) and every value of the wrong type;
    with a ``Problems`` collector adds those lines (and the verl aliases and recipe files that set each key)
    there instead and returns the config of the items that are fine. Cross-key rules: `validate_config`.
    """
    from omegaconf import OmegaConf

    collected, routed, origins = [], Routed(), {}
    node = OmegaConf.structured(PPOConfig)
    for item in overrides or []:
        recipe, found, part = item[len(RECIPE):] if item.startswith(RECIPE) else None, [], Routed()
        if recipe is not None:
            recipe_assignments(recipe, found, part)
        else:
            translate_overrides([item], found, part)
        _apply(node, part.assignments, found)
        for key, *_ in part.assignments:  # the file that set each key (the command line may override it)
            if recipe is not None:
                origins[key] = ("set in", recipe)
            elif key in origins:
                origins[key] = ("also set in", origins[key][1])
        collected += [f"--recipe {recipe}: {line}" for line in found] if recipe is not None else found
        routed.absorb(part, given=recipe is None)  # two keys for one setting: on the command line
    set_keys = {assignment[0] for assignment in routed.assignments}
    _apply(node, [(key, value, render(value), False) for key, value in routed.implied.items() if key not in set_keys],
           collected)
    cfg = to_dataclass(node)
    collected += routed.disagreements() + check_equal(cfg, routed.equal)
    if problems is None and collected:
        raise ConfigError(collected)
    if problems is not None:
        problems.lines += collected
        problems.aliases.update(routed.aliases)
        problems.origins.update(origins)
    return cfg


def config_from_hydra(dict_cfg) -> PPOConfig:
    """For an `@hydra.main` entry: re-check the command-line overrides, then convert."""
    try:
        from hydra.core.hydra_config import HydraConfig

        task_overrides = list(HydraConfig.get().overrides.task)
    except Exception:  # not running under hydra.main
        task_overrides = []
    problems: list[str] = []
    routed = translate_overrides(task_overrides, problems)
    cfg = to_dataclass(dict_cfg)
    problems += routed.disagreements() + check_equal(cfg, routed.equal)
    if problems:
        raise ConfigError(problems)
    return cfg


def config_to_dict(cfg: PPOConfig) -> dict:
    """A plain nested dict (for logging, metrics headers and Ray transport)."""
    return dataclasses.asdict(cfg)
