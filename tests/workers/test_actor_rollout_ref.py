"""The worker's only data transform: a Batch piece -> the engine's SequenceBatch."""

from types import SimpleNamespace

import torch

from verl_lite.protocol import Batch, response_lengths
from verl_lite.workers.actor_rollout_ref import ACTOR_LOSS_KEYS
from verl_lite.workers.engine_worker import sequence_batch


def test_sequence_batch_joins_prompt_and_valid_response_tokens():
    responses = torch.tensor([[7, 8, 2, 0], [9, 2, 0, 0], [4, 4, 4, 4]])
    mask = (torch.arange(4)[None, :] < torch.tensor([3, 2, 4])[:, None]).float()
    adv = torch.randn(3, 4)
    piece = Batch.from_dict(
        {"responses": responses, "response_mask": mask, "advantages": adv, "old_log_probs": torch.zeros(3, 4),
         "entropy": torch.ones(3, 4)},
        {"prompt_ids": [[5, 6], [5], [1, 2, 3]], "uid": ["a", "b", "c"]},
    )
    sb = sequence_batch(piece, ACTOR_LOSS_KEYS)
    assert [x.tolist() for x in sb.input_ids] == [[5, 6, 7, 8, 2], [5, 9, 2], [1, 2, 3, 4, 4, 4, 4]]
    assert sb.response_lengths.tolist() == [3, 2, 4] and sb.response_width == 4
    assert set(sb.data) == {"response_mask", "advantages", "old_log_probs"}  # only what the loss reads
    assert torch.equal(sb.data["advantages"], adv)
    assert sequence_batch(piece).data == {}


def test_masks_with_holes_keep_every_response_token():
    """Observation tokens (m = 0 inside the response) stay in the sequence; only trailing padding goes."""
    responses = torch.tensor([[7, 8, 9, 3, 0], [4, 5, 6, 0, 0]])
    mask = torch.tensor([[1, 0, 0, 1, 0], [0, 1, 0, 0, 0]], dtype=torch.float32)
    assert response_lengths(mask).tolist() == [4, 2]
    assert response_lengths(torch.zeros(2, 3)).tolist() == [0, 0]
    piece = Batch.from_dict({"responses": responses, "response_mask": mask}, {"prompt_ids": [[1], [2, 2]]})
    sb = sequence_batch(piece)
    assert [x.tolist() for x in sb.input_ids] == [[1, 7, 8, 9, 3], [2, 2, 4, 5]]


class _CountingActor:
    """An engine stand-in: each optimizer step bumps a version the exported weight carries."""

    cfg = SimpleNamespace(routing_replay=False)

    def __init__(self):
        self.version = 0

    def train_step(self, *args, **kwargs):
        self.version += 1
        return {"loss": 0.0}

    def advance_lr_schedule(self):
        pass

    def export_merged_hf(self):
        return [("w", torch.full((1,), float(self.version)))]


class _RecordingRollout:
    def __init__(self):
        self.loaded = []

    def load_weights(self, named_tensors):
        self.loaded.append(float(named_tensors[0][1]))
        return 1

    def generate(self, prompt_ids, **sampling):
        return [{"response_ids": [1], "log_probs": torch.zeros(1)} for _ in prompt_ids]


def test_the_rollout_catches_up_with_the_actor_before_it_next_samples():
    """Colocated weight sync has no controller call: after an update the next generation call loads the
    actor's weights first, on every rank (an empty piece included: the export is collective), once."""
    from verl_lite.workers.actor_rollout_ref import ActorRolloutRefWorker

    worker = ActorRolloutRefWorker.__new__(ActorRolloutRefWorker)
    worker.actor, worker.rollout, worker.rollout_behind = _CountingActor(), _RecordingRollout(), False
    piece = Batch.from_dict({"responses": torch.tensor([[7, 2]]), "response_mask": torch.ones(1, 2)},
                            {"prompt_ids": [[5]]})
    job = {"plan": None, "piece": piece, "micro_batches": [[0]], "global_token_count": 2}

    worker.generate([[5]], None, {"n": 1})
    assert worker.rollout.loaded == []  # nothing updated yet: the initial weights are the actor's
    worker.update_actor([job, job], None, 1.0)
    assert worker.rollout.loaded == []  # the update itself sends nothing
    assert worker.generate([], None, {"n": 1}) == []  # an empty piece still takes part
    assert worker.rollout.loaded == [2.0]  # the weights after both optimizer steps
    worker.generate([[5]], None, {"n": 1})
    worker.update_actor([], None, 1.0)  # no optimizer step: nothing to catch up
    worker.generate([[5]], None, {"n": 1})
    assert worker.rollout.loaded == [2.0]
    worker.update_actor([job], None, 1.0)
    worker.sample([[5]], None, {"n": 1})  # the split-placement body samples as loaded
    assert worker.rollout.loaded == [2.0]
    worker.generate([[5]], None, {"n": 1})
    assert worker.rollout.loaded == [2.0, 3.0]
