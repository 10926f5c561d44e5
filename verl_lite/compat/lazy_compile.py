"""Import libraries that prepare ``torch.compile`` at import time, without paying for it: megatron-core wraps its
fused kernels in ``torch.compile`` and imports ``wandb``; tensordict registers helpers with
``torch.compiler.allow_in_graph`` / ``assume_constant_result``; each imports ``torch._dynamo`` / ``torch._inductor``
or wandb at import, although verl_lite never compiles and its workers never log to W&B.

Inside :func:`compile_decorators_deferred`: ``torch.compile(fn)`` of a plain function compiles at its FIRST call
(anything else goes to the real ``torch.compile``); ``assume_constant_result(fn)`` sets dynamo's own marker;
``allow_in_graph(fn)`` is queued for the first deferred compile; ``import wandb`` / ``torch.utils.tensorboard``
raise ImportError (megatron takes them as absent; no failed import is cached). Everything is restored when the
block ends. Numerics are untouched.
"""

from __future__ import annotations

import functools
import importlib.abc
import inspect
import sys
from contextlib import contextmanager

from verl_lite.compat import require

require("megatron-core", "verl_lite.compat.lazy_compile")
require("torch", "verl_lite.compat.lazy_compile")  # the marker dynamo sets, torch.compile's arguments

HIDDEN_MODULES = frozenset({"wandb", "torch.utils.tensorboard"})
_pending_allow_in_graph: list = []


class _HiddenFinder(importlib.abc.MetaPathFinder):
    """Makes ``import`` of a module in ``HIDDEN_MODULES`` fail as if it were not installed."""

    def find_spec(self, name, path, target=None):
        if name in HIDDEN_MODULES and name not in sys.modules:
            raise ModuleNotFoundError(f"{name} is hidden while a library imports (verl_lite.compat.lazy_compile)",
                                      name=name)
        return None


@contextmanager
def compile_decorators_deferred():
    """Within the block, import-time ``torch.compile`` preparations are deferred, wandb and TensorBoard hidden (module doc)."""
    import torch
    import torch.compiler

    real = (torch.compile, torch.compiler.assume_constant_result, torch.compiler.allow_in_graph)

    def deferred_compile(model=None, **kwargs):
        if model is None:  # @torch.compile(**kwargs)
            return lambda fn: deferred_compile(fn, **kwargs)
        if not inspect.isfunction(model):
            return real[0](model, **kwargs)
        compiled = None

        @functools.wraps(model)
        def call(*args, **kw):
            nonlocal compiled
            if compiled is None:
                while _pending_allow_in_graph:  # the registrations queued so far, in order
                    real[2](_pending_allow_in_graph.pop(0))
                compiled = real[0](model, **kwargs)
            return compiled(*args, **kw)

        return call

    def mark_constant(fn):
        fn._dynamo_marked_constant = True  # exactly what torch._dynamo.assume_constant_result does
        return fn

    def queue_allow_in_graph(fn):
        _pending_allow_in_graph.append(fn)
        return fn

    finder = _HiddenFinder()
    sys.meta_path.insert(0, finder)
    torch.compile, torch.compiler.assume_constant_result, torch.compiler.allow_in_graph = (
        deferred_compile, mark_constant, queue_allow_in_graph)
    try:
        yield
    finally:
        torch.compile, torch.compiler.assume_constant_result, torch.compiler.allow_in_graph = real
        sys.meta_path.remove(finder)
