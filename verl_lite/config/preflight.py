"""Pre-flight checks that need the files the config names (model, data, reward), run before Ray starts.

`validate_config` checks the config's keys against each other; these checks read what the keys
point at. Both raise `ConfigError` (exit 2), every problem naming the key and the fix.

    check_model_files(cfg)                  # before the tokenizer is loaded: config.json parses, has the fields
    preflight(cfg, train_dataset, val_dataset, tokenizer, reward_manager)   # after the datasets are built
"""

from __future__ import annotations

import json
from pathlib import Path

from verl_lite.config.loader import ConfigError

MODEL_KEY = "actor_rollout_ref.model.path"


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


def check_model_files(cfg) -> None:
    """Raise ConfigError when the model's config.json is broken (before anything reads the model)."""
    problems = model_config_problems(cfg.actor_rollout_ref.model.path)
    if problems:
        raise ConfigError(problems)


def _max_positions(model_path: str | None) -> int | None:
    try:
        value = json.loads((Path(model_path) / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError, TypeError, AttributeError):
        return None
    return value if isinstance(value, int) and value > 0 else None


def preflight(cfg, train_dataset, val_dataset, tokenizer=None, reward_manager=None) -> None:
    """Checks that need the built datasets and the model: raise one ConfigError listing every problem.

    - ``data.train_batch_size`` prompts per step must exist in the train set (after the overlong filter);
    - the longest sequence ``data.max_prompt_length + data.max_response_length`` (or the longest
      prompt actually kept, if shorter) plus the response must fit the model's ``max_position_embeddings``;
    - the reward function must accept ``reward_kwargs`` (the manager checked its signature when it
      loaded the function; its finding is reported here with the rest).
    """
    d = cfg.data
    p: list[str] = []
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
