"""Driver-side pieces of the loop that need no workers: mini-batch cutting and the N = 0 guard."""

import pytest
import torch

from tests.e2e.conftest import tiny_assets, tiny_overrides  # noqa: F401  (fixture)
from verl_lite.protocol import Batch


@pytest.fixture()
def trainer(tiny_assets):
    from verl_lite.config import load_config
    from verl_lite.trainer.ppo_trainer import PPOTrainer

    return PPOTrainer(load_config(tiny_overrides(tiny_assets)))  # 4 prompts x 4 samples, mini-batch 2 prompts


def test_mini_batches_hold_whole_prompt_groups(trainer):
    mbs = trainer.updates.mini_batches(16, epoch=0, step=0)
    assert mbs == [list(range(8)), list(range(8, 16))]


def test_mini_batch_without_response_tokens_is_rejected_before_dispatch(trainer):
    n, w = 16, 3
    mask = torch.ones(n, w)
    mask[8:] = 0  # the second mini-batch has N = 0
    batch = Batch.from_dict(
        {"responses": torch.ones(n, w, dtype=torch.long), "response_mask": mask,
         "old_log_probs": torch.zeros(n, w), "advantages": torch.zeros(n, w)},
        {"prompt_ids": [[5, 6]] * n},
    )
    assert trainer.actor is None  # nothing started: the check runs on the driver before any dispatch
    with pytest.raises(ValueError, match=r"actor mini-batch 1 of epoch 0 .* no valid response token \(N = 0\)"):
        trainer.updates.update_actor(batch, step=0)
