"""The critic role: a value-head ``MegatronEngine`` on its own workers and layout, a thin shell over
``algorithms.critic_loss``; ``score.weight`` comes from the checkpoint or a fresh init (``engine.model.ValueHead``).
"""

from __future__ import annotations

from functools import partial

from verl_lite.algorithms import critic_loss
from verl_lite.workers.engine_worker import EngineWorker, sequence_batch

CRITIC_LOSS_KEYS = ("response_mask", "old_values", "returns")


class CriticWorker(EngineWorker):
    def compute_values(self, piece, micro_batches: list[list[int]]) -> dict | None:
        """Values [n, W] of this DP rank's piece (None off the output owner)."""
        return self.engine.infer(sequence_batch(piece), micro_batches, outputs=("values",))

    def update_critic(self, jobs: list[dict], cliprange_value: float) -> list[dict]:
        """``_train_jobs`` of the clipped value loss (the RL step's one call)."""
        return self._train_jobs(jobs, partial(critic_loss, cliprange_value=cliprange_value), CRITIC_LOSS_KEYS)

    def save_checkpoint(self, path: str) -> None:
        """The critic's engine state (+ this rank's RNG) into ``path``. Collective."""
        from verl_lite.engine.checkpoint import save_role_state  # megatron's dist_checkpointing: on use

        save_role_state(self.engine, path)

    def load_checkpoint(self, path: str) -> dict:
        """Load a :meth:`save_checkpoint` directory (any layout). Collective."""
        from verl_lite.engine.checkpoint import load_role_state

        return load_role_state(self.engine, path)
