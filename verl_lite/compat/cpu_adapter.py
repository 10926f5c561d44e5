"""The one process-level CPU adapter that lets megatron-core 0.16.1 run on a CPU-only torch. ``install()`` does
nothing when ``torch.cuda.is_available()``; on a CPU-only torch it changes exactly three things, for the whole
process, idempotently (nothing inside megatron is edited):

1. ``torch.cuda.current_device`` returns cpu (megatron's DDP grad buffers, p2p receive buffers, TP all-gather
   outputs and RoPE frequencies: ``param_and_grad_buffer.py:806``, ``p2p_communication.py:313``, ``mappings.py:91``,
   ``rotary_pos_embedding.py:162``).
2. ``torch.cuda.synchronize`` is a no-op (``p2p_communication.py:242``, ``filesystem_async.py:230``).
3. One globally entered ``TorchFunctionMode`` rewrites ``device="cuda" | "cuda:N" | N`` to cpu in factory
   functions and ``Tensor.to``, makes ``Tensor.cuda()`` / ``pin_memory()`` identities and ``pin_memory=True`` off
   (literals no config reaches: ``schedules.py:596``, ``language_module.py:244``, ``rope_utils.py:63``), and answers
   a CPU tensor's ``Tensor.type()`` with ``'torch.cuda.<X>Tensor'`` (asserted by ``optimizer.py:671``,
   ``clip_grads.py:167``). It costs one Python call per torch op: the engine runs the forward in ``suspended()``.
"""

from __future__ import annotations

import contextlib
import threading

import torch
from torch.overrides import TorchFunctionMode

from verl_lite.compat import require
from verl_lite.compat.torch_internals import torch_function_disabled

require("megatron-core", "verl_lite.compat.cpu_adapter")
require("torch", "verl_lite.compat.cpu_adapter")

_INSTALLED_MODE: "_CudaToCpuMode | None" = None
_INSTALLED_IN_THREAD: int | None = None  # torch-function modes are per thread: the one whose stack holds it
_CPU = torch.device("cpu")


def _is_cuda_device(d) -> bool:
    if isinstance(d, str):
        return d == "cuda" or d.startswith("cuda:")
    if isinstance(d, torch.device):
        return d.type == "cuda"
    return isinstance(d, int) and not isinstance(d, bool)  # a bare device index means a CUDA device


class _CudaToCpuMode(TorchFunctionMode):
    """Maps CUDA device requests to cpu; see the module docstring for the exact rules."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs) if kwargs else {}
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            if args[0].device.type == "cpu" and name.startswith("torch.") and not name.startswith("torch.cuda."):
                return "torch.cuda." + name[len("torch.") :]
            return name
        if func is torch.Tensor.cuda or func is torch.Tensor.pin_memory:
            return args[0]
        if "device" in kwargs and _is_cuda_device(kwargs["device"]):
            kwargs["device"] = _CPU
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


def suspended():
    """A context in which no torch-function mode runs, for code that creates no tensor on a literal "cuda" device
    (a model's forward). A no-op on GPU."""
    if _INSTALLED_MODE is None:
        return contextlib.nullcontext()
    return torch_function_disabled()


def in_this_thread():
    """A context in which the adapter's mode is active in the calling thread too (an engine called from a thread
    other than the installing one, e.g. an agent loop's). A no-op on GPU and in the installing thread."""
    if _INSTALLED_MODE is None or threading.get_ident() == _INSTALLED_IN_THREAD:
        return contextlib.nullcontext()
    return _CudaToCpuMode()


def is_installed() -> bool:
    return _INSTALLED_MODE is not None


def install() -> bool:
    """Install the adapter if CUDA is absent. Returns True when it is active. Idempotent."""
    global _INSTALLED_MODE, _INSTALLED_IN_THREAD
    if torch.cuda.is_available():
        return False
    if _INSTALLED_MODE is None:
        torch.cuda.current_device = lambda: _CPU
        torch.cuda.synchronize = lambda device=None: None
        mode = _CudaToCpuMode()
        mode.__enter__()  # stays entered for the life of the process
        _INSTALLED_MODE, _INSTALLED_IN_THREAD = mode, threading.get_ident()
    return True
