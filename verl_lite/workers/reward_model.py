"""The reward-model role: a frozen score-head ``MegatronEngine`` (``reward_model.model.path``, an HF
sequence-classification checkpoint with one logit) on its own workers and layout.

A row's ``prompt_ids`` are the reward model's whole input (``verl_lite.reward.model_reward.rm_inputs``), its
one-token "response" a placeholder. The engine reports the value head for a response token at the position
that precedes it, so the placeholder's output is the score head at the LAST input token (causal attention
keeps the placeholder out): what ``AutoModelForSequenceClassification`` returns for an unpadded sequence.
"""

from __future__ import annotations

from verl_lite.workers.engine_worker import EngineWorker, sequence_batch


class RewardModelWorker(EngineWorker):
    def compute_rm_score(self, piece, micro_batches: list[list[int]]) -> dict | None:
        """``{"rm_scores": [n]}`` of this DP rank's piece (None off the output owner)."""
        out = self.engine.infer(sequence_batch(piece), micro_batches, outputs=("values",))
        return None if out is None else {"rm_scores": out["values"][:, 0]}
