"""A KV cache whose decode steps write in place, built on transformers' cache layers (``TESTED_VERSIONS``).

transformers' ``DynamicLayer`` grows a layer's cache by ``torch.cat`` at every forward (each decode step copies the
whole cache). :class:`ReservedLayer` keeps it in a buffer ``[batch, kv_heads, room, head_dim]`` made at the first
forward with room for ``capacity`` positions (doubling past it); forwards write in place, and ``keys`` / ``values``
are views of the filled part, value for value what a ``DynamicLayer`` would hold. :func:`reserved_cache` stands
aside (None) for an untested transformers and for models whose layers are not all full attention.
"""

from __future__ import annotations

import functools

import torch

from verl_lite.compat import installed_version, is_tested

# written for and checked against the Cache(layers=...) and DynamicLayer (keys/values/is_initialized/device, update,
# get_seq_length, get_mask_sizes) of the transformers versions in compat.TESTED_VERSIONS
FULL_ATTENTION = "full_attention"


@functools.lru_cache(maxsize=None)
def reserved_layer_class():
    """The :class:`ReservedLayer` class (built once, on transformers' ``DynamicLayer``)."""
    from transformers.cache_utils import DynamicLayer

    class ReservedLayer(DynamicLayer):
        """A ``DynamicLayer`` (the same keys and values after every call) that writes new positions in place."""

        def __init__(self, capacity: int):
            super().__init__()
            self.capacity = capacity
            self._key_buffer: torch.Tensor | None = None
            self._value_buffer: torch.Tensor | None = None
            self._length = 0

        def _expose(self) -> None:
            self.keys = self._key_buffer.narrow(2, 0, self._length)
            self.values = self._value_buffer.narrow(2, 0, self._length)

        def _reserve(self, keys: torch.Tensor, values: torch.Tensor, room: int, repeats: int = 1) -> None:
            """New buffers of ``room`` positions holding ``keys`` / ``values`` (the filled part), each row repeated
            ``repeats`` times in place (``batch_repeat_interleave``'s order) by one copy."""
            length = keys.shape[-2]
            for name, states in (("_key_buffer", keys), ("_value_buffer", values)):
                batch, heads, _, width = states.shape
                buffer = states.new_empty((batch * repeats, heads, room, width))
                filled = buffer.narrow(2, 0, length).view(batch, repeats, heads, length, width)
                filled.copy_(states.unsqueeze(1).expand(batch, repeats, heads, length, width))
                setattr(self, name, buffer)
            self._length = length
            self._expose()

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            self.device = key_states.device
            self.is_initialized = True

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            if self._key_buffer is None:
                self._reserve(key_states, value_states, max(self.capacity, key_states.shape[-2]))
                return self.keys, self.values
            new = key_states.shape[-2]
            end = self._length + new
            if end > self._key_buffer.shape[-2]:
                self._reserve(self.keys, self.values, max(end, 2 * self._key_buffer.shape[-2]))
            self._key_buffer.narrow(2, self._length, new).copy_(key_states)
            self._value_buffer.narrow(2, self._length, new).copy_(value_states)
            self._length = end
            self._expose()
            return self.keys, self.values

        def crop(self, tokens_to_remove: int) -> None:
            if tokens_to_remove > 0:
                raise ValueError(f"crop({tokens_to_remove}): give a negative number of tokens to remove")
            if tokens_to_remove and self._key_buffer is not None:
                self._length = max(0, self._length + tokens_to_remove)
                self._expose()

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            if self._key_buffer is None:
                return
            indices = indices.to(self._key_buffer.device)
            room = self._key_buffer.shape[-2]
            if 2 * self._length <= room:  # the filled part twice (select, then into a new room) costs less than the room
                self._reserve(self.keys.index_select(0, indices), self.values.index_select(0, indices), room)
            else:
                self._key_buffer = self._key_buffer.index_select(0, indices)
                self._value_buffer = self._value_buffer.index_select(0, indices)
                self._expose()

        def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
            self.batch_select_indices(beam_idx)

        def batch_repeat_interleave(self, repeats: int) -> None:
            if self._key_buffer is not None:
                self._reserve(self.keys, self.values, self._key_buffer.shape[-2], repeats)

        def reset(self) -> None:
            self._key_buffer = self._value_buffer = None
            self._length = 0
            super().reset()

    return ReservedLayer


@functools.lru_cache(maxsize=None)
def _tested_transformers_installed() -> bool:
    return is_tested("transformers", installed_version("transformers"))  # reads package metadata: once per process


def _served_layers(config) -> int | None:
    """The number of layers of a model of this (HF) config when :func:`reserved_cache` serves it under the
    installed transformers (every layer full attention, no shared KV), else None."""
    if not _tested_transformers_installed():
        return None
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layer_types = getattr(text, "layer_types", None) or [FULL_ATTENTION] * text.num_hidden_layers
    shared_kv = getattr(text, "num_kv_shared_layers", 0) or 0
    plain = all(kind == FULL_ATTENTION for kind in layer_types) and not shared_kv and not getattr(
        text, "use_sliding_window", False)
    return text.num_hidden_layers if plain else None


def supported(config) -> bool:
    """Whether :func:`reserved_cache` serves a model of this (HF) config under the installed transformers."""
    return _served_layers(config) is not None


def reserved_cache(config, capacity: int):
    """A cache of :class:`ReservedLayer` for a model of ``config`` that will hold about ``capacity`` positions per row,
    or None where it does not serve the model or the installed transformers (the model then builds its own cache)."""
    layers = _served_layers(config)
    if layers is None:
        return None
    from transformers.cache_utils import Cache

    return Cache(layers=[reserved_layer_class()(capacity) for _ in range(layers)])
