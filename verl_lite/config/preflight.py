"""Pre-flight checks that need the files the config names (model, data, reward), run before Ray starts.

`validate_config` checks the config's keys against each other; these checks read what the keys
point at. Both raise `ConfigError` (exit 2), every problem naming the key and the fix.

    check_model_files(cfg)                  # before the tokenizer is loaded: config.json parses, has the fields,
                                            # and the weights' vocabulary rows match its vocab_size
    preflight(cfg, train_dataset, val_dataset, tokenizer, reward_manager)   # after the datasets are built

The weights are checked from the safetensors headers only (tensor names and shapes; no tensor is read).
"""

from __future__ import annotations

from verl_lite.config.loader import ConfigError
from verl_lite.engine.model_files import config_int, model_config_problems, model_weight_problems, tokenizer_id_problems

MODEL_KEY = "actor_rollout_ref.model.path"
CRITIC_MODEL_KEY = "critic.model.path"


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
    problems = model_config_problems(MODEL_KEY, cfg.actor_rollout_ref.model.path)
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
    """Every id the tokenizer produces must have an embedding row in every model of the run."""
    m = cfg.actor_rollout_ref.model
    tok = ("actor_rollout_ref.model.tokenizer_path", m.tokenizer_path) if m.tokenizer_path and \
        m.tokenizer_path != m.path else (MODEL_KEY, m.path)
    return tokenizer_id_problems(tok, tokenizer, _model_dirs(cfg))


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
    limit = config_int(cfg.actor_rollout_ref.model.path, "max_position_embeddings")
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
