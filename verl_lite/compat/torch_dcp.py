"""torch.distributed.checkpoint's index (``.metadata``) read without trusting it.

The index is the one pickle in a checkpoint. It is read through :class:`RestrictedUnpickler`, which

- resolves exact ``(module, name)`` pairs of :data:`ALLOWED_GLOBALS` only (the dataclasses and enums of
  ``torch.distributed.checkpoint.metadata`` / ``filesystem`` / ``planner`` an index holds, ``torch.Size``,
  the dtypes and torch's layout-by-name lookup; listed from a real verl_lite checkpoint); a dotted name or
  any other global raises ``pickle.UnpicklingError`` naming it;
- applies a BUILD (set an object's state) only to an object of one of those dataclasses, which the load
  itself has just created: an enum member, a class or any other object that existed before the load
  cannot be changed (a crafted index once set ``WriteItemType.SHARD._value_`` process-wide).

Private parts of torch and CPython used here, for the torch versions of ``compat.TESTED_VERSIONS``:
``pickle._Unpickler`` (the pure-Python unpickler, whose opcode table can be guarded; the C one cannot),
torch's ``filesystem.pickle`` (the module its reader unpickles the index with, swapped while loading)
and ``filesystem._StorageInfo`` (where each tensor's bytes are: file, offset, length).
"""

from __future__ import annotations

import contextlib
import enum
import io
import pickle

import torch
from torch.distributed.checkpoint import filesystem, metadata, planner

from verl_lite.compat import require

require("torch", "verl_lite.compat.torch_dcp")
_DCP = "torch.distributed.checkpoint"

_CLASSES = {
    f"{_DCP}.metadata": ("Metadata", "StorageMeta", "MetadataIndex", "ChunkStorageMetadata", "TensorProperties",
                         "TensorStorageMetadata", "_MEM_FORMAT_ENCODING"),
    f"{_DCP}.filesystem": ("_StorageInfo",),
    f"{_DCP}.planner": ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"),
}
ALLOWED_GLOBALS = frozenset(
    {(module, name) for module, names in _CLASSES.items() for name in names}
    | {("torch", "Size"), ("torch.serialization", "_get_layout")}  # a torch.layout pickles as a lookup by name
    | {("torch", name) for name in dir(torch) if isinstance(getattr(torch, name, None), torch.dtype)})
_MODULES = {f"{_DCP}.metadata": metadata, f"{_DCP}.filesystem": filesystem, f"{_DCP}.planner": planner}
# the types whose fresh instances a BUILD may fill in: the allowed dataclasses (not the enums)
BUILDABLE = frozenset(getattr(_MODULES[module], name) for module, names in _CLASSES.items() for name in names
                      if not issubclass(getattr(_MODULES[module], name), enum.Enum))


class RestrictedUnpickler(pickle._Unpickler):
    """Unpickles a torch.distributed.checkpoint index only (see the module docstring)."""

    dispatch = dict(pickle._Unpickler.dispatch)

    def find_class(self, module: str, name: str):
        if "." in name:
            raise pickle.UnpicklingError(
                f"checkpoint metadata refers to {name!r} in {module}: a dotted name reaches attributes of "
                f"attributes; refusing to unpickle it (the file is not a checkpoint written by verl_lite)")
        if (module, name) not in ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(
                f"checkpoint metadata refers to {module}.{name}, which is not a torch.distributed.checkpoint "
                f"metadata type; refusing to unpickle it (the file is not a checkpoint written by verl_lite)")
        return super().find_class(module, name)

    def load_build(self):
        target = self.stack[-2]  # BUILD pops the state (top), then fills in the object below it
        if type(target) not in BUILDABLE:
            raise pickle.UnpicklingError(
                f"checkpoint metadata sets the state of {type(target).__name__} {target!r}, which is not an index "
                f"record it builds; refusing to unpickle it (the file is not a checkpoint written by verl_lite)")
        super().load_build()

    dispatch[pickle.BUILD[0]] = load_build

    def persistent_load(self, pid):
        raise pickle.UnpicklingError("checkpoint metadata refers to a persistent id; refusing to unpickle it")


def loads_index(data: bytes):
    """Unpickle index bytes through :class:`RestrictedUnpickler`."""
    return RestrictedUnpickler(io.BytesIO(data)).load()


class _RestrictedPickleModule:
    """Stands in for the ``pickle`` module inside torch.distributed.checkpoint.filesystem while loading."""

    def __getattr__(self, name):
        return getattr(pickle, name)

    @staticmethod
    def load(file, **_kw):  # the one unpickling call of torch's filesystem reader
        return RestrictedUnpickler(file).load()


@contextlib.contextmanager
def restricted_metadata_unpickling():
    """While active, torch.distributed.checkpoint reads ``.metadata`` through :class:`RestrictedUnpickler`."""
    original = filesystem.pickle
    filesystem.pickle = _RestrictedPickleModule()
    try:
        yield
    finally:
        filesystem.pickle = original


def storage_entries(index) -> list[tuple[str, int, int]]:
    """``(file name, offset, length)`` of every stored item an index points at (its ``storage_data``);
    ``ValueError`` for an entry that is not a storage record of those types."""
    data = getattr(index, "storage_data", None)
    if not isinstance(data, dict):
        raise ValueError("the index has no storage table")
    out = []
    for key, info in data.items():
        if not (isinstance(info, filesystem._StorageInfo) and isinstance(info.relative_path, str)
                and type(info.offset) is int and type(info.length) is int):
            raise ValueError(f"storage entry {key!r} is not a (file, offset, length) record")
        out.append((info.relative_path, info.offset, info.length))
    return out
