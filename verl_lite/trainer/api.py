"""The Python API's translation, run by ``PPOTrainer.__init__`` before anything starts: TRL's constructor
arguments into the config, the tokenizer, the reward and the datasets (see ``PPOTrainer``'s docstring). Each
function raises ConfigError listing every problem it found, so the pre-flight reports them together."""

from __future__ import annotations

import os
import time
from pathlib import Path

from verl_lite.config.loader import ConfigError, names_follow, use_train_data
from verl_lite.data import RLDataset
from verl_lite.data.dataset import IN_MEMORY
from verl_lite.engine.model_files import read_config, resolve_model_dir
from verl_lite.reward import RewardManager
from verl_lite.reward.config import judge_input_problems, reward_input_problems
from verl_lite.reward.functions import RewardFunctions
from verl_lite.rollout.config import CONFIG_SAMPLING_KWARGS, generation_kwargs_problems
from verl_lite.trainer.trl_args import PEFT_MODEL_REFUSED, TRL_FIELDS, is_peft_model, refused_argument


def use_api_arguments(cfg, model, processing_class, generation_kwargs: dict, push_to_hub: bool,
                      peft_config=None, reward_funcs=None, reward_weights=None, reward_processing_classes=None,
                      **not_built) -> dict:
    """TRL's constructor arguments into ``cfg``; returns the generation_kwargs the backend receives."""
    if p := use_reward_models(cfg, reward_funcs, reward_weights, reward_processing_classes):
        raise ConfigError(p)
    r = cfg.actor_rollout_ref.rollout
    p = generation_kwargs_problems(r.name, generation_kwargs)
    if push_to_hub:
        p.append(f"push_to_hub=True: {TRL_FIELDS['push_to_hub'].text}")
    p += [refused_argument(name) for name, value in not_built.items() if value is not None]
    if p:
        raise ConfigError(p)
    for key in CONFIG_SAMPLING_KWARGS:
        if key in generation_kwargs:
            setattr(r, key, generation_kwargs.pop(key))
    if model is not None or processing_class is not None:
        use_model(cfg, model, processing_class)
    if peft_config is not None and (p := use_peft_config(cfg, peft_config)):
        raise ConfigError(p)
    return generation_kwargs


def use_peft_config(cfg, peft_config) -> list[str]:
    """TRL's ``peft_config=`` (a ``peft.LoraConfig``) into ``actor_rollout_ref.model.lora``: r -> rank,
    lora_alpha -> alpha, lora_dropout -> dropout, target_modules (None: PEFT's default for the model type) and
    exclude_modules as given. What the engine's LoRA does not build is returned as problems (nothing is dropped)."""
    lora, problems = cfg.actor_rollout_ref.model.lora, []
    for name, default, why in (("use_dora", False, "DoRA"), ("use_rslora", False, "rank-stabilized scaling"),
                               ("bias", "none", "trainable biases"), ("modules_to_save", None, "extra trained modules"),
                               ("layers_to_transform", None, "a subset of layers")):
        value = getattr(peft_config, name, default)
        if value not in (default, [], ()):
            problems.append(f"peft_config.{name}={value!r}: {why} is not built in the engine's LoRA (docs/lora.md)")
    targets = getattr(peft_config, "target_modules", None)
    if targets is None:
        from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as defaults

        model_type = (read_config(cfg.actor_rollout_ref.model.path) or {}).get("model_type")
        targets = defaults.get(model_type)
        if targets is None:
            problems.append(f"peft_config.target_modules=None: PEFT has no default for model type {model_type!r}; "
                            f"name the modules")
    lora.rank, lora.alpha, lora.dropout = int(peft_config.r), float(peft_config.lora_alpha), \
        float(getattr(peft_config, "lora_dropout", 0.0))
    if targets is not None:
        lora.target_modules = "all-linear" if targets == "all-linear" else sorted(targets)
    lora.exclude_modules = sorted(getattr(peft_config, "exclude_modules", None) or [])
    return problems


def is_reward_model(entry) -> bool:
    """A ``reward_funcs`` entry that is a model (TRL's meaning): a directory or hub id, or a transformers model."""
    return isinstance(entry, (str, os.PathLike)) or hasattr(entry, "save_pretrained")


def _entries(value) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _funcs_and_weights(reward_funcs, reward_weights) -> tuple[list, list]:
    """TRL's ``reward_funcs`` (one or a list) and their weights (default 1 each)."""
    entries = _entries(reward_funcs)
    return entries, [1.0] * len(entries) if reward_weights is None else list(reward_weights)


def reward_functions_only(reward_funcs, reward_weights) -> tuple[list | None, list | None]:
    """``reward_funcs`` / ``reward_weights`` without the model entries (``use_reward_models`` placed those): what
    ``RewardFunctions`` calls; (None, None) where only models were given."""
    if reward_funcs is None:
        return None, reward_weights
    entries, weights = _funcs_and_weights(reward_funcs, reward_weights)
    if len(weights) != len(entries):
        return entries, weights  # RewardFunctions names the mismatch
    kept = [(f, w) for f, w in zip(entries, weights) if not is_reward_model(f)]
    return ([f for f, _ in kept], [w for _, w in kept]) if kept else (None, None)


def use_reward_models(cfg, reward_funcs, reward_weights, reward_processing_classes) -> list[str]:
    """TRL's model entries of ``reward_funcs`` into the reward-model role (``reward_model.*``): an
    AutoModelForSequenceClassification with one logit is the discriminative reward model, a causal LM the
    generative judge (``reward_model.generative``; TRL would read it through a fresh classification head).
    ``reward_processing_classes``' entry at the model's index is its tokenizer (default: the model's own).
    The step's reward is TRL's sum_k weight_k x reward_k: the model's score at weight 1 plus the functions'
    weighted sum (``rule_reward_weight`` 1). What this cannot express is returned as problems: two models (the
    role hosts one), a model weight other than 1, a model beside ``reward_model.enable=true``."""
    if reward_funcs is None:
        return []
    entries, weights = _funcs_and_weights(reward_funcs, reward_weights)
    models = [i for i, entry in enumerate(entries) if is_reward_model(entry)]
    if not models:
        return []
    rm, p = cfg.reward_model, []
    if len(models) > 1:
        p.append(f"reward_funcs holds {len(models)} models (entries {models}); the reward-model role hosts one: "
                 f"combine them into one, or score with reward functions")
    if rm.enable:
        p.append("reward_funcs holds a model and reward_model.enable=true names one too; give the reward model once")
    if len(weights) == len(entries) and any(float(weights[i]) != 1.0 for i in models):
        p.append(f"reward_weights gives the reward model weight {[weights[i] for i in models]}; its score enters "
                 f"at weight 1 here: scale the other functions' weights relative to it")
    functions = len(entries) - len(models)
    if functions and rm.rule_reward_weight not in (0, 1):
        p.append(f"reward_model.rule_reward_weight={rm.rule_reward_weight} would scale reward_funcs' functions again "
                 f"(reward_weights weighs them): leave it unset")
    if p:
        return p
    index, entry = models[0], entries[models[0]]
    tokenizers = None if reward_processing_classes is None else _entries(reward_processing_classes)
    tokenizer = tokenizers[index] if tokenizers is not None and index < len(tokenizers) else None
    rm.enable = True
    rm.model.path = _model_dir(cfg, "reward_model", entry)
    if tokenizer is not None:
        rm.model.tokenizer_path = _model_dir(cfg, "reward_tokenizer", tokenizer)
    else:  # a model object's own tokenizer directory, else the model's (the config's inherited default)
        rm.model.tokenizer_path = _tokenizer_source(entry) or rm.model.path
    architectures = (read_config(rm.model.path) or {}).get("architectures") or []
    rm.generative = any(str(a).endswith("ForCausalLM") for a in architectures)
    rm.rule_reward_weight = 1.0 if functions else 0.0
    return []


def _model_dir(cfg, kind: str, given) -> str:
    """The directory of a model or tokenizer given to the API: a path or hub id resolved, an object saved
    (``save_pretrained``) into a fresh ``<trainer.output_dir>/api_<kind>-<time>-<pid>/`` (every worker loads a
    model from a directory)."""
    if not hasattr(given, "save_pretrained"):
        return resolve_model_dir(str(given))
    saved = Path(cfg.trainer.output_dir) / f"api_{kind}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    saved.mkdir(parents=True, exist_ok=True)
    given.save_pretrained(saved)
    return str(saved)


def _tokenizer_source(model) -> str | None:
    """The directory a model object was loaded from, when its tokenizer files are there."""
    source = getattr(model, "name_or_path", None) if hasattr(model, "save_pretrained") else None
    return source if source and Path(source, "tokenizer_config.json").is_file() else None


def use_model(cfg, model, processing_class) -> None:
    """``model=`` / ``processing_class=`` of the Python API into ``actor_rollout_ref.model.path`` /
    ``tokenizer_path`` (``_model_dir``; and the critic's, where they followed the actor's)."""
    m, critic = cfg.actor_rollout_ref.model, cfg.critic.model
    old = (m.path, m.tokenizer_path)
    if model is not None and is_peft_model(model):
        raise ConfigError([PEFT_MODEL_REFUSED])
    if model is not None:
        with names_follow(cfg):  # a run name derived from the model follows it
            m.path = _model_dir(cfg, "model", model)
        m.tokenizer_path = m.path
        if processing_class is None and hasattr(model, "save_pretrained"):
            if (source := _tokenizer_source(model)) is None:
                raise ConfigError([f"model= is a model object whose tokenizer cannot be found (name_or_path="
                                   f"{getattr(model, 'name_or_path', None)!r}); pass processing_class=<its tokenizer>"])
            m.tokenizer_path = source
    if processing_class is not None:
        m.tokenizer_path = _model_dir(cfg, "model", processing_class)
    if critic.path in old:
        critic.path = m.path
    if critic.tokenizer_path in old:
        critic.tokenizer_path = m.tokenizer_path


def load_tokenizer(cfg):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(cfg.actor_rollout_ref.model.tokenizer_path)


def make_reward(cfg, tokenizer, reward_fn, reward_funcs, reward_weights):
    """TRL-style ``reward_funcs``, or verl's ``reward_fn``, or the configured reward (``tokenizer`` None: set
    once it is loaded)."""
    if reward_funcs is not None and reward_fn is not None:
        raise ValueError("give reward_funcs (TRL-style) or reward_fn (verl's signature), not both")
    rm = cfg.reward_model
    if (reward_funcs is not None or reward_fn is not None) and rm.enable and rm.rule_reward_weight == 0:
        given = "reward_funcs" if reward_funcs is not None else "reward_fn"
        raise ConfigError([f"{given}= with reward_model.enable=true at reward_model.rule_reward_weight=0: the reward "
                           f"model's score is the reward and {given} would never be called; set "
                           f"reward_model.rule_reward_weight (reward = RM score + weight x {given}'s), or drop "
                           f"{given}"])
    if reward_funcs is not None:
        return RewardFunctions(reward_funcs, tokenizer, reward_weights, timeout_s=getattr(cfg.reward, "timeout_s", None))
    return RewardManager(cfg.reward, tokenizer, compute_score=reward_fn)


def make_datasets(cfg, tokenizer, agent, train=None, val=None):
    """(train, val) from the given sources (Python API), else ``data.train_files`` / ``val_files``; a given
    in-memory source is recorded in the config as ``<in-memory dataset>`` (``loader.use_train_data``: the
    names derived from the data follow a given train set). No val files: no validation set (None).
    ``agent`` (an AgentSpec or None): its tool schemas go into the chat template."""
    d = cfg.data
    tools = (agent.tool_schemas or None) if agent is not None else None
    datasets = []
    for key, given in (("train_files", train), ("val_files", val)):
        if given is not None:
            name = str(given) if isinstance(given, (str, os.PathLike)) else IN_MEMORY
            use_train_data(cfg, name) if key == "train_files" else setattr(d, key, name)
        files = given if given is not None else getattr(d, key)
        datasets.append(RLDataset.from_config(d, files, tokenizer, tools) if given is not None or files else None)
    return tuple(datasets)


def check_reward_inputs(cfg, reward_manager, train_dataset, val_dataset) -> None:
    """Every row field the reward needs (``ground_truth``, a column a reward function names) exists."""
    datasets = {"data.train_files": train_dataset, "data.val_files": val_dataset}
    p = reward_input_problems(reward_manager, datasets) + judge_input_problems(cfg.reward_model, datasets)
    if p:
        raise ConfigError(p)
