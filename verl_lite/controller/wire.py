"""What the controller sends to (and gets back from) workers, pickled without torch's per-tensor cost (``torch.save``
of each storage, which dominates for a DP piece's many small tensors). Under :func:`wire` every CPU tensor of an
object graph travels as its raw bytes (a numpy array, protocol 5, out-of-band where the outer pickler allows it),
and unpickling gives back the object graph itself::

    ref = ray.put(wire(state_dict))         # the worker's ray.get / argument is a plain dict of tensors

Each tensor arrives with its dtype, shape and values, owning its memory; ``requires_grad`` and non-CPU tensors are
pickled by torch; views of one storage arrive as separate tensors.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import numpy as np
import torch

# dtypes numpy cannot hold: sent as the same-width integer type, viewed back on arrival
_VIEW_AS = {torch.bfloat16: torch.int16}
_NUMPY_DTYPES = {torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16, torch.int8,
                 torch.uint8, torch.bool, torch.complex64, torch.complex128}


def _tensor_from_array(array: np.ndarray, dtype_name: str | None) -> torch.Tensor:
    """A tensor that owns its memory from ``array`` (copied when the array cannot be written)."""
    if not array.flags.writeable:
        array = array.copy()
    t = torch.from_numpy(array)
    return t.view(getattr(torch, dtype_name)) if dtype_name is not None else t


def _tensordict(tensors: dict, batch_size: list[int], device):
    from tensordict import TensorDict

    return TensorDict(tensors, batch_size=batch_size, device=device)


class _WirePickler(pickle.Pickler):
    """Pickles CPU tensors as numpy arrays (protocol 5 buffers) and TensorDicts as their tensors."""

    def reducer_override(self, obj):
        if isinstance(obj, torch.Tensor):
            if type(obj) is not torch.Tensor or obj.requires_grad or obj.device.type != "cpu" or obj.is_sparse:
                return NotImplemented
            view = _VIEW_AS.get(obj.dtype)
            if view is None and obj.dtype not in _NUMPY_DTYPES:
                return NotImplemented
            array = (obj.view(view) if view is not None else obj).numpy()
            return _tensor_from_array, (array, str(obj.dtype).split(".")[-1] if view is not None else None)
        if type(obj).__name__ == "TensorDict" and type(obj).__module__.startswith("tensordict"):
            if obj.device is not None and obj.device.type != "cpu":
                return NotImplemented
            return _tensordict, ({k: obj[k] for k in obj.keys()}, list(obj.batch_size), obj.device)
        return NotImplemented


def _loads(payload: bytes, buffers: list) -> Any:
    return pickle.loads(payload, buffers=buffers)


class Wire:
    """``obj`` as it travels; unpickles to ``obj`` itself (see the module docstring)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any):
        self.obj = obj

    def __reduce_ex__(self, protocol: int):
        out = io.BytesIO()
        buffers: list[pickle.PickleBuffer] = []
        _WirePickler(out, protocol=5, buffer_callback=buffers.append).dump(self.obj)
        if protocol < 5:  # the outer pickler cannot carry PickleBuffers: send them in-band
            return _loads, (out.getvalue(), [bytes(b.raw()) for b in buffers])
        return _loads, (out.getvalue(), buffers)


def wire(obj: Any) -> Wire:
    """``obj`` wrapped to pickle its CPU tensors as raw bytes; see the module docstring."""
    return obj if isinstance(obj, Wire) else Wire(obj)
