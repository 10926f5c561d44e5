"""compat.kv_cache: the in-place KV cache layer holds exactly what transformers' DynamicLayer holds after
every operation the rollout and transformers use, and stands aside where it was not written for."""

import pytest
import torch
from transformers import AutoConfig
from transformers.cache_utils import DynamicLayer

from verl_lite.compat import TESTED_VERSIONS, installed_version, kv_cache, installed_is_tested

TESTED = pytest.mark.skipif(not installed_is_tested("transformers"),
                            reason=f"transformers {installed_version('transformers')}: compat.kv_cache was written for "
                                   f"{TESTED_VERSIONS['transformers']} and stands aside (its layer is not used)")


def _states(batch, length, generator):
    keys = torch.randn(batch, 2, length, 4, generator=generator)
    return keys, torch.randn(batch, 2, length, 4, generator=generator)


def _assert_same(reserved, dynamic):
    assert reserved.get_seq_length() == dynamic.get_seq_length()
    assert reserved.get_mask_sizes(1) == dynamic.get_mask_sizes(1)
    assert torch.equal(reserved.keys, dynamic.keys) and torch.equal(reserved.values, dynamic.values)


@TESTED
def test_reserved_layer_matches_dynamic_layer_through_every_operation():
    """Prefill, decode steps into the reserved room and past it (the room doubles), a multi-token update,
    rows repeated (shared prefill), selected (stopped rows leave), reordered (beam search), cropped, reset."""
    generator = torch.Generator().manual_seed(0)
    reserved, dynamic = kv_cache.reserved_layer_class()(capacity=7), DynamicLayer()
    assert reserved.get_seq_length() == 0

    def update(batch, length):
        keys, values = _states(batch, length, generator)
        out_reserved, out_dynamic = reserved.update(keys, values), dynamic.update(keys, values)
        for a, b in zip(out_reserved, out_dynamic):
            assert torch.equal(a, b)
        _assert_same(reserved, dynamic)

    update(3, 4)  # prefill: the room is the capacity
    reserved.batch_repeat_interleave(2), dynamic.batch_repeat_interleave(2)
    _assert_same(reserved, dynamic)
    for _ in range(5):  # 4 + 5 = 9 > 7: the room grows on the way
        update(6, 1)
    keep = torch.tensor([0, 2, 5])
    reserved.batch_select_indices(keep), dynamic.batch_select_indices(keep)
    _assert_same(reserved, dynamic)
    update(3, 3)  # a multi-token forward
    beams = torch.tensor([2, 2, 0])
    reserved.reorder_cache(beams), dynamic.reorder_cache(beams)
    _assert_same(reserved, dynamic)
    reserved.crop(-2), dynamic.crop(-2)
    _assert_same(reserved, dynamic)
    update(3, 1)  # writes over the cropped positions
    reserved.reset(), dynamic.reset()
    assert reserved.get_seq_length() == dynamic.get_seq_length() == 0
    update(2, 3)


@TESTED
def test_selecting_rows_early_in_a_large_room_matches_dynamic_layer():
    """Rows selected while the filled part is at most half the room (copied alone into a new room), then decode
    steps into that room."""
    generator = torch.Generator().manual_seed(2)
    reserved, dynamic = kv_cache.reserved_layer_class()(capacity=32), DynamicLayer()
    keys, values = _states(5, 3, generator)
    reserved.update(keys, values), dynamic.update(keys, values)
    keep = torch.tensor([4, 1])
    reserved.batch_select_indices(keep), dynamic.batch_select_indices(keep)
    _assert_same(reserved, dynamic)
    assert reserved._key_buffer.shape[-2] == 32  # the room is kept
    for _ in range(3):
        keys, values = _states(2, 1, generator)
        reserved.update(keys, values), dynamic.update(keys, values)
        _assert_same(reserved, dynamic)


@TESTED
def test_decode_steps_write_in_place():
    """Within its room a decode step allocates nothing for the cache: keys and values stay views of one buffer."""
    reserved = kv_cache.reserved_layer_class()(capacity=10)
    generator = torch.Generator().manual_seed(1)
    reserved.update(*_states(2, 4, generator))
    base = reserved.keys.untyped_storage().data_ptr()
    for _ in range(6):
        reserved.update(*_states(2, 1, generator))
    assert reserved.keys.untyped_storage().data_ptr() == base and reserved.get_seq_length() == 10


@pytest.fixture(scope="module")
def qwen2_config():
    return AutoConfig.for_model("qwen2", vocab_size=32, hidden_size=16, num_hidden_layers=3, num_attention_heads=2,
                                num_key_value_heads=1, intermediate_size=32)


def test_stands_aside_where_it_was_not_written_for(qwen2_config, monkeypatch):
    check = kv_cache._tested_transformers_installed.__wrapped__  # the version check itself (cached per process)
    monkeypatch.setattr(kv_cache, "_tested_transformers_installed", lambda: True)
    cache = kv_cache.reserved_cache(qwen2_config, capacity=16)
    assert cache is not None and len(cache.layers) == 3
    assert all(isinstance(layer, kv_cache.reserved_layer_class()) for layer in cache.layers)
    sliding = AutoConfig.for_model("qwen2", num_hidden_layers=2, use_sliding_window=True, sliding_window=8,
                                   max_window_layers=0)
    assert kv_cache.reserved_cache(sliding, capacity=16) is None
    mixed = AutoConfig.for_model("qwen3", num_hidden_layers=2, layer_types=["full_attention", "sliding_attention"])
    assert kv_cache.reserved_cache(mixed, capacity=16) is None
    monkeypatch.setattr(kv_cache, "installed_version", lambda package: "5.26.0")
    assert not check()
    monkeypatch.setattr(kv_cache, "_tested_transformers_installed", check)
    assert kv_cache.reserved_cache(qwen2_config, capacity=16) is None
