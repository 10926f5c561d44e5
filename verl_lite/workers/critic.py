"""The critic role: a value-head ``MegatronEngine`` on its own workers and layout, a thin shell over
``algorithms.critic_loss``; ``score.weight`` comes from the checkpoint or a fresh init (``engine.model.ValueHead``).
"""

from __future__ import annotations

from functools import partial

from verl_lite.algorithms import critic_loss
from verl_lite.engine.engine import MegatronEngine
from verl_lite.workers.engine_worker import EngineWorker, sequence_batch

CRITIC_LOSS_KEYS = ("response_mask", "old_values", "returns")


class CriticWorker(EngineWorker):
    def init_model(self) -> None:
        self.critic = MegatronEngine(self._init_world())

    def _owner_engine(self):
        return self.critic

    def compute_values(self, piece, micro_batches: list[list[int]]) -> dict | None:
        """Values [n, W] of this DP rank's piece (None off the output owner)."""
        return self.critic.infer(sequence_batch(piece), micro_batches, outputs=("values",))

    def update_critic(self, jobs: list[dict], cliprange_value: float) -> list[dict]:
        """One optimizer step per job (see ``RoleGroup.train``), then one LR schedule step (the RL step's one
        call); loss metrics on output owners only."""
        results = []
        for job in jobs:
            loss_fn = partial(critic_loss, plan=job["plan"], cliprange_value=cliprange_value)
            results.append(self.critic.train_step(
                sequence_batch(job["piece"], CRITIC_LOSS_KEYS), job["micro_batches"], loss_fn,
                global_token_count=job["global_token_count"],
            ))
        if jobs:
            self.critic.advance_lr_schedule()
        return results

    def save_checkpoint(self, path: str) -> None:
        """The critic's engine state (+ this rank's RNG) into ``path``. Collective."""
        from verl_lite.engine.checkpoint import save_role_state  # megatron's dist_checkpointing: on use

        save_role_state(self.critic, path)

    def load_checkpoint(self, path: str) -> dict:
        """Load a :meth:`save_checkpoint` directory (any layout). Collective."""
        from verl_lite.engine.checkpoint import load_role_state  # megatron's dist_checkpointing: on use

        return load_role_state(self.critic, path)
