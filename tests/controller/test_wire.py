"""The controller's wire form (controller/wire.py): an object graph comes back as itself, bit for bit."""

import pickle

import pytest
import torch
from ray import cloudpickle

from verl_lite.controller.wire import Wire, wire
from verl_lite.protocol import Batch

DUMPS = {
    "pickle-4": lambda o: pickle.dumps(o, protocol=4),
    "pickle-5": lambda o: pickle.dumps(o, protocol=5),
    "cloudpickle": cloudpickle.dumps,  # what Ray uses for arguments and results
}


def _graph():
    g = torch.Generator().manual_seed(0)
    piece = Batch.from_dict(
        {"responses": torch.randint(0, 100, (6, 5), generator=g), "response_mask": torch.ones(6, 5),
         "advantages": torch.randn(6, 5, generator=g, dtype=torch.float64)},
        {"prompt_ids": [[1, 2, 3][: 1 + i % 3] for i in range(6)]})
    return {
        "piece": piece,
        "micro_batches": [[0, 1, 2], [3, 4, 5]],
        "bf16": torch.randn(3, 4, generator=g).bfloat16(),
        "scalar": torch.tensor(3.5),
        "strided": torch.randn(4, 6, generator=g)[:, ::2],
        "bool": torch.tensor([True, False, True]),
        "int8": torch.tensor([-3, 4], dtype=torch.int8),
        "grad": torch.ones(2, requires_grad=True),  # pickled by torch, as before
        "none": None,
    }


@pytest.mark.parametrize("how", sorted(DUMPS))
def test_wire_round_trip_is_the_object_itself(how):
    sent = _graph()
    got = pickle.loads(DUMPS[how](wire(sent)))
    assert not isinstance(got, Wire) and set(got) == set(sent)
    assert isinstance(got["piece"], Batch) and got["piece"]["prompt_ids"] == sent["piece"]["prompt_ids"]
    for k in sent["piece"].tensors.keys():
        a, b = got["piece"][k], sent["piece"][k]
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), k
    for k in ("bf16", "scalar", "strided", "bool", "int8", "grad"):
        assert got[k].dtype == sent[k].dtype and got[k].shape == sent[k].shape and torch.equal(got[k], sent[k]), k
    assert got["grad"].requires_grad and got["micro_batches"] == sent["micro_batches"] and got["none"] is None
    # the receiver owns writable memory: writing changes neither the sender's tensor nor warns
    got["piece"]["responses"][0, 0] = -1
    assert sent["piece"]["responses"][0, 0] != -1


def test_tensor_bytes_travel_out_of_band():
    """With protocol 5 and a buffer callback (Ray's pickler) a tensor's bytes leave the pickle stream whole."""
    t = torch.arange(100_000, dtype=torch.float32)
    buffers = []
    stream = pickle.dumps(wire({"w": t}), protocol=5, buffer_callback=buffers.append)
    assert len(stream) < 1_000 and sum(len(b.raw()) for b in buffers) == t.numel() * 4
    got = pickle.loads(stream, buffers=[bytes(b.raw()) for b in buffers])  # read-only buffers, as Ray hands them
    assert torch.equal(got["w"], t)
    got["w"][0] = 1.0  # copied out of the read-only buffer: writable


def test_the_same_tensor_twice_arrives_as_one():
    t = torch.zeros(3)
    got = pickle.loads(cloudpickle.dumps(wire({"embed": t, "lm_head": t})))
    assert got["embed"] is got["lm_head"]
