"""verl_lite: RL post-training for causal LMs on megatron-core, exact under every parallel layout."""

__version__ = "0.1.0"

from verl_lite.compat.transformers_imports import install as _serve_transformers_import_table_from_cache

_serve_transformers_import_table_from_cache()  # a cached table instead of a scan in every process (module doc)
