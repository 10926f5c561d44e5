"""verl_lite: RL post-training for causal LMs on megatron-core, exact under every parallel layout."""

__version__ = "0.1.0"
