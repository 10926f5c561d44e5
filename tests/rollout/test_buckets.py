"""A weight sync's flat buckets (``verl_lite.rollout.buckets``): every tensor comes back bit for bit, in order, with its
dtype and shape, through the object store's pickling too; buckets keep to their size; the config's rules."""

from __future__ import annotations

import pickle

import pytest
import torch

from verl_lite.controller.wire import wire
from verl_lite.rollout.buckets import ALIGN, bucket_bytes_of, bucket_tensors, weight_buckets


def _tensors() -> list[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    base = torch.randn(7, 5, generator=generator, dtype=torch.float64)
    return [
        ("embed.weight", torch.randn(13, 6, generator=generator)),
        ("norm.weight", torch.randn(3, generator=generator).to(torch.bfloat16)),  # an odd byte count
        ("half", torch.randn(2, 3, 1, generator=generator).to(torch.float16)),
        ("transposed", base.t()),  # not contiguous
        ("scalar", torch.tensor(2.5)),
        ("empty", torch.zeros(0, 4)),
        ("ids", torch.arange(11, dtype=torch.int64)),
        ("flags", torch.tensor([True, False, True])),
        ("big", torch.randn(64, 64, generator=generator)),  # 16 KiB: larger than the small buckets below
        ("special", torch.tensor([float("nan"), float("inf"), -0.0])),
    ]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal dtype, shape and bytes (NaNs and -0.0 included)."""
    return a.dtype == b.dtype and a.shape == b.shape and (
        a.numel() == 0 or torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


@pytest.mark.parametrize("bucket_bytes", [1, 100, 600, 4096, 1 << 30])
def test_every_tensor_comes_back_bit_for_bit_in_order(bucket_bytes):
    tensors = _tensors()
    buckets = list(weight_buckets(iter(tensors), bucket_bytes))
    back = [pair for bucket in buckets for pair in bucket_tensors(bucket)]
    assert [name for name, _ in back] == [name for name, _ in tensors]
    for (name, original), (_, got) in zip(tensors, back):
        assert _same(original.contiguous(), got), name
    for bucket in buckets:
        assert bucket.data.dtype == torch.uint8 and bucket.data.dim() == 1
        assert all(offset % ALIGN == 0 for *_, offset in bucket.entries)
        assert bucket.data.numel() <= bucket_bytes or len(bucket.entries) == 1  # only a lone tensor exceeds it
    if bucket_bytes == 1 << 30:
        assert len(buckets) == 1
    if bucket_bytes == 1:
        assert len(buckets) == len(tensors)


def test_buckets_pack_tightly_up_to_their_size():
    tensors = [(f"w{i}", torch.full((16,), float(i))) for i in range(10)]  # 64 bytes each, aligned back to back
    buckets = list(weight_buckets(tensors, 256))
    assert [len(b.entries) for b in buckets] == [4, 4, 2]
    assert [b.data.numel() for b in buckets] == [256, 256, 128]


def test_a_bucket_survives_the_object_stores_pickling():
    (bucket,) = weight_buckets(_tensors(), 1 << 30)
    for protocol in (4, 5):
        back = pickle.loads(pickle.dumps(wire(bucket), protocol=protocol))
        assert torch.equal(back.data, bucket.data) and back.entries == bucket.entries
        for (name, a), (_, b) in zip(bucket_tensors(bucket), bucket_tensors(back)):
            assert _same(a, b), name


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(weight_buckets(_tensors(), 0))
    assert bucket_bytes_of(2048) == 2048 << 20 and bucket_bytes_of(0.5) == 1 << 19


def test_the_config_rules():
    from verl_lite.rollout.config import CheckpointEngineConfig

    key = "actor_rollout_ref.rollout.checkpoint_engine"
    assert CheckpointEngineConfig().problems(key) == []
    (line,) = CheckpointEngineConfig(backend="nccl").problems(key)
    assert f"{key}.backend='nccl' is not built" in line and "naive" in line
    for size in (0, -1):
        (line,) = CheckpointEngineConfig(update_weights_bucket_megabytes=size).problems(key)
        assert f"{key}.update_weights_bucket_megabytes={size}" in line


def test_verl_checkpoint_engine_keys_from_the_cli():
    """verl's section as a script sets it: the bucket size and an empty engine_kwargs run; another backend, its
    kwargs or a custom backend module are refused before start, each in a line naming the key."""
    from verl_lite.config import ConfigError, load_config, validate_config

    key = "actor_rollout_ref.rollout.checkpoint_engine"
    cfg = load_config([f"{key}.update_weights_bucket_megabytes=4096", f"+{key}.engine_kwargs={{}}"])
    validate_config(cfg)
    assert cfg.actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes == 4096
    for override, named in ((f"{key}.backend=nccl", f"{key}.backend"),
                            (f"+{key}.engine_kwargs.nccl.rebuild_group=false", f"{key}.engine_kwargs.nccl"),
                            (f"+{key}.custom_backend_module=my.backend", f"{key}.custom_backend_module")):
        with pytest.raises(ConfigError) as info:
            validate_config(load_config([override]))
        assert any(named in line for line in str(info.value).splitlines()), str(info.value)
