"""The one process-level CPU adapter that lets megatron-core 0.16.1 run on a CPU-only torch.

``install()`` does nothing when ``torch.cuda.is_available()``: on GPUs megatron runs untouched.
On a CPU-only torch it changes exactly three things, for the whole process, idempotently:

1. ``torch.cuda.current_device`` returns ``torch.device("cpu")``. Megatron allocates buffers on
   ``torch.cuda.current_device()``: DDP grad buffers (``distributed/param_and_grad_buffer.py:806``),
   pipeline p2p receive buffers (``pipeline_parallel/p2p_communication.py:313/321``), TP all-gather
   outputs (``tensor_parallel/mappings.py:91``), RoPE frequencies
   (``models/common/embeddings/rotary_pos_embedding.py:162``).
2. ``torch.cuda.synchronize`` is a no-op (``p2p_communication.py:242/398``,
   ``dist_checkpointing/strategies/filesystem_async.py:230``).
3. One globally entered ``TorchFunctionMode`` (``_CudaToCpuMode``) that
   - rewrites ``device="cuda" | "cuda:N" | N`` to cpu in factory functions and ``Tensor.to``, and turns
     ``Tensor.cuda()`` into identity: hard-coded literals no config reaches, e.g.
     ``torch.zeros([], device="cuda")`` in every schedule (``pipeline_parallel/schedules.py:596/983/2138``),
     ``weight.data.cuda()`` when tying embeddings across PP (``language_module.py:244``);
   - turns ``pin_memory=True`` off and ``Tensor.pin_memory()`` into identity (``rope_utils.py:63``);
   - answers the no-argument ``Tensor.type()`` of a CPU tensor with ``'torch.cuda.<X>Tensor'``,
     because the optimizers assert on that string (``optimizer/optimizer.py:671/690``,
     ``optimizer/distrib_optimizer.py:361/420``, ``optimizer/clip_grads.py:167``).

Nothing inside megatron is edited or monkeypatched. Cost: one Python call per torch op (it shows
on small models and vanishes in the matmuls of large ones; docs/performance.md); the engine runs the
model's forward inside ``suspended()``, where no torch-function mode runs, so the cost is left
to the schedules, the loss path and the optimizer.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

from verl_lite.compat import require
from verl_lite.compat.torch_internals import torch_function_disabled

require("megatron-core", "verl_lite.compat.cpu_adapter")
require("torch", "verl_lite.compat.cpu_adapter")

_INSTALLED_MODE: "_CudaToCpuMode | None" = None
_CPU = torch.device("cpu")


def _is_cuda_device(d) -> bool:
    if isinstance(d, bool):
        return False
    if isinstance(d, int):
        return True  # a bare device index means a CUDA device
    if isinstance(d, str):
        return d == "cuda" or d.startswith("cuda:")
    if isinstance(d, torch.device):
        return d.type == "cuda"
    return False


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


def _current_device() -> torch.device:
    return _CPU


def _synchronize(device=None) -> None:
    return None


def suspended():
    """A context in which no torch-function mode runs (so neither does the adapter's per-call hop).

    For code that creates no tensor on a literal "cuda" device, e.g. a model's forward (its device
    lookups go through the patched ``torch.cuda.current_device``), so its many small ops skip the
    per-call hop. A no-op context when the adapter is not installed (GPU)."""
    if _INSTALLED_MODE is None:
        return contextlib.nullcontext()
    return torch_function_disabled()


def is_installed() -> bool:
    return _INSTALLED_MODE is not None


def install() -> bool:
    """Install the adapter if CUDA is absent. Returns True when it is active. Idempotent."""
    global _INSTALLED_MODE
    if torch.cuda.is_available():
        return False
    if _INSTALLED_MODE is None:
        torch.cuda.current_device = _current_device
        torch.cuda.synchronize = _synchronize
        mode = _CudaToCpuMode()
        mode.__enter__()  # stays entered for the life of the process
        _INSTALLED_MODE = mode
    return True
