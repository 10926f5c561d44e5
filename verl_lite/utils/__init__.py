"""Small helpers shared by tests, examples and benchmarks (no RL, no parallelism)."""

from verl_lite.utils.tiny_model import make_tiny_hf_model

__all__ = ["make_tiny_hf_model"]
