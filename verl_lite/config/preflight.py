"""Pre-flight checks that need the files the config names (model, data, reward), run before Ray starts.

`validate_config` checks the config's keys against each other; these checks read what the keys
point at. Both raise `ConfigError` (exit 2), every problem naming the key and the fix.

    check_model_files(cfg)                  # before the tokenizer is loaded: config.json parses, has the fields,
                                            # and the weights' vocabulary rows match its vocab_size
    preflight(cfg, train_dataset, val_dataset, tokenizer, reward_manager)   # after the datasets are built

The weights are checked from the safetensors headers only (tensor names and shapes; no tensor is read).
"""

from __future__ import annotations

import json
from pathlib import Path

from verl_lite.config.loader import ConfigError

MODEL_KEY = "actor_rollout_ref.model.path"
CRITIC_MODEL_KEY = "critic.model.path"
VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")  # [vocab_size, hidden] in an HF causal LM
SAFETENSORS_MAX_HEADER = 100_000_000  # bytes; safetensors' own limit


def model_config_problems(model_path: str | None) -> list[str]:
    """Problems with ``<model_path>/config.json``: unreadable, not JSON, not an object, no architecture fields."""
    if not model_path:
        return []
    file = Path(model_path) / "config.json"
    if not file.is_file():
        return []  # validate_config reports the missing directory / file
    try:
        cfg = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError) as e:
        return [f"{MODEL_KEY}={model_path!r}: {file} cannot be read ({e}); fix its permissions or re-export the model"]
    except ValueError as e:
        return [f"{MODEL_KEY}={model_path!r}: {file} is not valid JSON ({e}); fix the file or re-export the model"]
    if not isinstance(cfg, dict):
        return [f"{MODEL_KEY}={model_path!r}: {file} holds a {type(cfg).__name__}, not a JSON object; re-export the model"]
    missing = [k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size") if k not in cfg]
    if missing:
        return [f"{MODEL_KEY}={model_path!r}: {file} lacks {missing}; give a complete HF causal-LM config.json"]
    return []


def safetensors_header(file: Path) -> dict:
    """The JSON header of a ``.safetensors`` file: tensor name -> {dtype, shape, data_offsets}. Reads the
    8-byte header length and the header, never a tensor; ValueError / OSError when it is not one."""
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{len(head)} bytes, shorter than the 8-byte header length")
        size = int.from_bytes(head, "little")
        if not 0 < size <= SAFETENSORS_MAX_HEADER:
            raise ValueError(f"header length {size} is not a safetensors header")
        raw = f.read(size)
    if len(raw) < size:
        raise ValueError(f"the header is truncated ({len(raw)} of {size} bytes)")
    header = json.loads(raw)
    if not isinstance(header, dict):
        raise ValueError("the header is not a JSON object")
    return header


def _weight_files(model_dir: Path) -> list[Path]:
    """The model's safetensors files: those the index names, else every ``*.safetensors``."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        return sorted({model_dir / name for name in weight_map.values()})
    return sorted(model_dir.glob("*.safetensors"))


def _vocab_size(model_path: str | None) -> int | None:
    try:
        value = json.loads((Path(model_path) / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def model_weight_problems(key: str, model_path: str | None) -> list[str]:
    """The vocabulary tensors (embed_tokens, lm_head) of ``<model_path>/*.safetensors`` must have
    config.json's ``vocab_size`` rows (the engine shards them by it); a header that does not read
    as safetensors is named too. A model dir without safetensors is left to the loader."""
    vocab = _vocab_size(model_path)
    if vocab is None:
        return []  # model_config_problems reports a broken config.json
    try:
        files = _weight_files(Path(model_path))
    except (OSError, ValueError, AttributeError) as e:
        return [f"{key}={model_path!r}: model.safetensors.index.json cannot be read ({e}); re-export the model"]
    problems = []
    for file in files:
        try:
            header = safetensors_header(file)
        except (OSError, ValueError) as e:
            problems.append(f"{key}={model_path!r}: {file} cannot be read as safetensors ({e}); re-export the model")
            continue
        for name in VOCAB_TENSORS:
            shape = header.get(name, {}).get("shape") if isinstance(header.get(name), dict) else None
            if shape and shape[0] != vocab:
                problems.append(
                    f"{key}={model_path!r}: {file} holds {name} of shape {list(shape)} but config.json's "
                    f"vocab_size is {vocab}; set vocab_size to {shape[0]} in {Path(model_path) / 'config.json'} "
                    f"(or re-export the model)")
    return problems


def _model_dirs(cfg) -> list[tuple[str, str]]:
    """(key, path) of every model the run loads: the actor's, and a critic's own when the estimator needs one."""
    from verl_lite.config.validate import _estimator_needs

    actor = cfg.actor_rollout_ref.model.path
    dirs = [(MODEL_KEY, actor)]
    critic = cfg.critic.model.path
    if critic and critic != actor and "critic" in _estimator_needs(cfg.algorithm.adv_estimator):
        dirs.append((CRITIC_MODEL_KEY, critic))
    return dirs


def model_file_problems(cfg) -> list[str]:
    """config.json of the actor's model, then the vocabulary rows of every model's weights."""
    problems = model_config_problems(cfg.actor_rollout_ref.model.path)
    if not problems:
        problems = [p for key, path in _model_dirs(cfg) for p in model_weight_problems(key, path)]
    return problems


def check_model_files(cfg) -> None:
    """Raise ConfigError when a model's config.json is broken or its weights do not match it (before
    anything reads the model)."""
    problems = model_file_problems(cfg)
    if problems:
        raise ConfigError(problems)


def tokenizer_vocab_problems(cfg, tokenizer) -> list[str]:
    """Every id the tokenizer can produce (its vocabulary and added tokens) must have an embedding row
    in every model of the run (``vocab_size`` of its config.json)."""
    if tokenizer is None or not hasattr(tokenizer, "get_vocab"):
        return []
    ids = list(tokenizer.get_vocab().values())
    if not ids:
        return []
    top = max(ids)
    m = cfg.actor_rollout_ref.model
    tok_key, tok_path = ("actor_rollout_ref.model.tokenizer_path", m.tokenizer_path) \
        if m.tokenizer_path and m.tokenizer_path != m.path else (MODEL_KEY, m.path)
    problems = []
    for key, path in _model_dirs(cfg):
        vocab = _vocab_size(path)
        if vocab is not None and top >= vocab:
            model = "the model's config.json" if (key, path) == (tok_key, tok_path) else f"{key}={path!r}"
            problems.append(
                f"{tok_key}={tok_path!r}: the tokenizer produces ids up to {top} ({len(ids)} tokens) but {model} "
                f"has vocab_size {vocab}: ids >= {vocab} have no embedding row; give the tokenizer the model was trained "
                f"with (actor_rollout_ref.model.tokenizer_path), or a model with at least {top + 1} vocabulary rows")
    return problems


def _max_positions(model_path: str | None) -> int | None:
    try:
        value = json.loads((Path(model_path) / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    return value if isinstance(value, int) and value > 0 else None


def preflight(cfg, train_dataset, val_dataset, tokenizer=None, reward_manager=None) -> None:
    """Checks that need the built datasets and the model: raise one ConfigError listing every problem.

    - the model files (``check_model_files``: the Python API has not run it);
    - every id the tokenizer produces must be below the model's ``vocab_size``;
    - ``data.train_batch_size`` prompts per step must exist in the train set (after the overlong filter);
    - the longest sequence ``data.max_prompt_length + data.max_response_length`` (or the longest
      prompt actually kept, if shorter) plus the response must fit the model's ``max_position_embeddings``;
    - the reward function must accept ``reward_kwargs`` (the manager checked its signature when it
      loaded the function; its finding is reported here with the rest).
    """
    d = cfg.data
    p: list[str] = model_file_problems(cfg) + tokenizer_vocab_problems(cfg, tokenizer)
    timeout = getattr(cfg.reward, "timeout_s", None)
    if timeout is not None and not timeout > 0:
        p.append(f"reward.timeout_s={timeout} must be > 0 seconds (the bound on one batch call of the reward)")
    n_train = len(train_dataset)
    if isinstance(d.train_batch_size, int) and d.train_batch_size > n_train:
        dropped = getattr(train_dataset, "num_filtered", 0)
        note = f" ({dropped} longer than data.max_prompt_length were dropped)" if dropped else ""
        p.append(
            f"data.train_batch_size={d.train_batch_size} exceeds the {n_train} prompts in data.train_files{note}; "
            f"set data.train_batch_size <= {n_train} or add data"
        )
    limit = _max_positions(cfg.actor_rollout_ref.model.path)
    if limit is not None:
        longest_prompt = max((len(it["prompt_ids"]) for ds in (train_dataset, val_dataset) for it in ds.items),
                             default=0) if hasattr(train_dataset, "items") else d.max_prompt_length
        longest_prompt = min(longest_prompt, d.max_prompt_length)
        if longest_prompt + d.max_response_length > limit:
            p.append(
                f"data.max_response_length={d.max_response_length} + the longest prompt ({longest_prompt} tokens, "
                f"data.max_prompt_length={d.max_prompt_length}) = {longest_prompt + d.max_response_length} exceeds "
                f"the model's max_position_embeddings={limit} ({MODEL_KEY}/config.json); set "
                f"data.max_response_length <= {limit - longest_prompt} or lower data.max_prompt_length"
            )
    if p:
        raise ConfigError(p)
