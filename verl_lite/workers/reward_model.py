"""The reward-model role: a frozen score-head ``MegatronEngine`` on its own workers and layout.

Thin shell. The controller sends rows whose ``prompt_ids`` are the reward model's whole input (the
trajectory in the RM's own tokens, ``verl_lite.reward.model_reward.rm_inputs``) and whose one-token
"response" is a placeholder appended after it. The engine reports a value-head output for every
response token t at the position that precedes it (label shift), so the output of the placeholder
is the score head read at the LAST token of the RM's input; causal attention keeps the placeholder
out of it. That is what ``AutoModelForSequenceClassification`` returns for an unpadded sequence.

Initial weights: ``reward_model.model.path``, an HF sequence-classification checkpoint with one
logit (``model.*`` body + ``score.weight [1, hidden]``, loaded as the engine's value head).
"""

from __future__ import annotations

from verl_lite.engine.engine import MegatronEngine
from verl_lite.workers.engine_worker import EngineWorker, EngineWorkerConfig, sequence_batch


class RewardModelWorker(EngineWorker):
    def __init__(self, rank: int, world_size: int, cfg: EngineWorkerConfig):
        super().__init__(rank, world_size, cfg)
        self.rm = None

    def init_model(self) -> None:
        self.rm = MegatronEngine(self._init_world())

    def _owner_engine(self):
        return self.rm

    def compute_rm_score(self, piece, micro_batches: list[list[int]]) -> dict | None:
        """``{"rm_scores": [n]}`` of this DP rank's piece (None off the output owner)."""
        out = self.rm.infer(sequence_batch(piece), micro_batches, outputs=("values",))
        return None if out is None else {"rm_scores": out["values"][:, 0]}
