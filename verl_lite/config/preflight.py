"""Pre-flight checks that need the files the config names (model, data), run before Ray starts.

`validate_config` checks the config's keys against each other; these checks read what the keys
point at. Both raise `ConfigError` (exit 2), every problem naming the key and the fix.

    check_model_files(cfg)                  # before the tokenizer is loaded: config.json parses, has the fields,
                                            # and the weights' vocabulary rows match its vocab_size
    preflight(cfg, train_dataset, val_dataset, tokenizer)   # after the datasets are built

The weights are checked from the safetensors headers only (tensor names and shapes; no tensor is read).
"""

from __future__ import annotations

from verl_lite.config.loader import ConfigError
from verl_lite.engine.model_files import config_int, model_config_problems, model_weight_problems, tokenizer_id_problems

MODEL_KEY = "actor_rollout_ref.model.path"


def _model_dirs(cfg) -> list[tuple[str, str]]:
    """(key, path) of every model the run loads: the actor's, and a critic's own when the estimator needs one."""
    from verl_lite.algorithms.rules import needs

    actor, critic = cfg.actor_rollout_ref.model.path, cfg.critic.model.path
    own_critic = critic and critic != actor and "critic" in needs(cfg.algorithm.adv_estimator)
    return [(MODEL_KEY, actor)] + ([("critic.model.path", critic)] if own_critic else [])


def check_model_files(cfg) -> None:
    """Raise ConfigError when the actor's config.json is broken, or a model's weights do not match its
    config.json (before anything reads the model)."""
    problems = model_config_problems(MODEL_KEY, cfg.actor_rollout_ref.model.path)
    problems = problems or [p for key, path in _model_dirs(cfg) for p in model_weight_problems(key, path)]
    if problems:
        raise ConfigError(problems)


def preflight(cfg, train_dataset, val_dataset, tokenizer=None) -> None:
    """Checks that need the built datasets and the model (after ``check_model_files``): raise one ConfigError
    listing every problem.

    - every id the tokenizer produces must be below every model's ``vocab_size``;
    - ``data.train_batch_size`` prompts per step must exist in the train set (after the overlong filter);
    - the longest sequence ``data.max_prompt_length + data.max_response_length`` (or the longest
      prompt actually kept, if shorter) plus the response must fit the model's ``max_position_embeddings``.
    """
    d, m = cfg.data, cfg.actor_rollout_ref.model
    tok = ("actor_rollout_ref.model.tokenizer_path", m.tokenizer_path) if m.tokenizer_path and \
        m.tokenizer_path != m.path else (MODEL_KEY, m.path)
    p = tokenizer_id_problems(tok, tokenizer, _model_dirs(cfg))
    n_train = len(train_dataset)
    if isinstance(d.train_batch_size, int) and d.train_batch_size > n_train:
        dropped = getattr(train_dataset, "num_filtered", 0)
        note = f" ({dropped} longer than data.max_prompt_length were dropped)" if dropped else ""
        p.append(
            f"data.train_batch_size={d.train_batch_size} exceeds the {n_train} prompts in data.train_files{note}; "
            f"set data.train_batch_size <= {n_train} or add data"
        )
    limit = config_int(m.path, "max_position_embeddings")
    if limit is not None:
        longest_prompt = max((len(it["prompt_ids"]) for ds in (train_dataset, val_dataset) if ds is not None
                              for it in ds.items),
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
