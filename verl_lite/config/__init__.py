"""Structured config (the dataclasses of schema.py, the only copy of the defaults), Hydra loading and pre-flight validation.

    cfg = load_config(["data.train_batch_size=16", ...])   # PPOConfig
    layout = validate_config(cfg)                           # raises ConfigError listing all problems
"""

from verl_lite.config.loader import (CONFIG_DIR, ConfigError, config_from_hydra, config_to_dict,  # noqa: F401
                                     default_data_files, default_model_path, load_config, register_configs,
                                     schema_keys)
from verl_lite.config.schema import PPOConfig  # noqa: F401
from verl_lite.config.validate import Layout, validate_config  # noqa: F401
