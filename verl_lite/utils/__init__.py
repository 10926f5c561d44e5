"""Small helpers shared by tests, examples and benchmarks (no RL, no parallelism). ``make_tiny_hf_model`` loads
on first use: importing a helper module of this package does not import torch."""

__all__ = ["make_tiny_hf_model"]


def __getattr__(name: str):
    if name == "make_tiny_hf_model":
        from verl_lite.utils.tiny_model import make_tiny_hf_model  # torch and transformers: on first use

        return make_tiny_hf_model
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
