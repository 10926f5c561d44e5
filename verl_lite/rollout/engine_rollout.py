"""Generation with the trainer's own engine in its batch-invariant mode (``actor_rollout_ref.rollout.batch_invariant``).

Each decode step is the actor engine's forward over every running sequence (``MegatronEngine.next_token_logits``,
no KV cache), the token is drawn by the HF rollout's rules (``hf_rollout``) and its log-prob is
``MegatronEngine.token_log_probs`` of the same logits: bit for bit the trainer's (``rollout/logprob_diff_max`` = 0.0).
No weights are synced. With ``record_routing`` (MoE, R3) one recording pass over every finished trajectory gives
its routing (docs/algorithms.md, "Consistency mode (`rollout.batch_invariant`)").
"""

from __future__ import annotations

from typing import Iterable

import torch

from verl_lite.engine.engine import SequenceBatch
from verl_lite.protocol import ROUTED_EXPERTS_KEY
from verl_lite.rollout.base import Rollout, rollout_temperature
from verl_lite.rollout.hf_rollout import draw_tokens, ends_in_stop_string, row_keys


class EngineRollout(Rollout):
    """A ``Rollout`` whose model is ``engine`` (a ``MegatronEngine`` built with ``batch_invariant_length``, TP = 1);
    the eos id is read from ``tokenizer``. ``record_routing``: every result also holds ``routed_experts``
    (uint8 ``[len(prompt) + len(response), layers, top_k]``, as ``HFRollout``'s). ``max_tokens_per_forward``: a
    decode step's forward in micro-batches of at most that many tokens (None: one)."""

    interruptible = True
    shares_trainer_weights = True  # nothing to sync after an update

    def __init__(self, engine, tokenizer, record_routing: bool = False, max_tokens_per_forward: int | None = None):
        if not engine.cfg.batch_invariant_length:
            raise ValueError("EngineRollout needs an engine built with batch_invariant_length > 0")
        self.engine, self.tokenizer, self.record_routing = engine, tokenizer, record_routing
        self.max_tokens_per_forward = max_tokens_per_forward
        self.eos_token_id = tokenizer.eos_token_id
        if self.eos_token_id is None:
            raise ValueError("the tokenizer has no eos_token; the rollout needs one to stop generation")
        self.vocab_size = int(engine.hf_config.vocab_size)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Nothing to load: the rollout generates with the engine's own (current) weights."""
        return 0

    def _generate(self, prompt_ids, n, do_sample, temperature, top_p, top_k, max_new_tokens, keys, *,
                  repetition_penalty: float = 1.0, min_p: float = 0.0, stop: list[str] | None = None,
                  stop_token_ids: list[int] | None = None, interrupt=None) -> list[dict]:
        """``Rollout.generate``; the further ``generation_kwargs`` and ``interrupt`` as ``HFRollout._generate``'s."""
        stop = [stop] if isinstance(stop, str) else list(stop or [])
        scale = rollout_temperature(temperature)
        sequences = [list(p) for p in prompt_ids for _ in range(n)]
        rows = len(sequences)
        responses: list[list[int]] = [[] for _ in range(rows)]
        log_probs: list[list[torch.Tensor]] = [[] for _ in range(rows)]
        seeds, samples = torch.tensor(keys, dtype=torch.int64).unbind(-1)
        hashes = row_keys(seeds, samples)
        stop_ids = {self.eos_token_id, *(stop_token_ids or [])}
        running, interrupted = list(range(rows)), set()
        for t in range(max_new_tokens):
            logits = self.engine.next_token_logits([sequences[i] for i in running], scale, self.max_tokens_per_forward)
            scaled = logits[:, : self.vocab_size].float()  # the draw's rules in float32, as the HF rollout's
            seen = None
            if repetition_penalty != 1.0:
                seen = torch.zeros_like(scaled, dtype=torch.bool)
                for row, i in enumerate(running):
                    seen[row, sequences[i]] = True
            tokens = draw_tokens(scaled, seen, repetition_penalty, do_sample, top_k, top_p, min_p, hashes[running], t)
            reported = self.engine.token_log_probs(logits, tokens)
            still = []
            for row, i in enumerate(running):
                token = int(tokens[row])
                sequences[i].append(token)
                responses[i].append(token)
                log_probs[i].append(reported[row])
                # a row at the attention's fixed length stops: past it is beyond every caller's room (an agent's
                # batched turns ask for the largest room of the batch and cut each row to its own)
                full = len(sequences[i]) >= self.engine.cfg.batch_invariant_length
                if token not in stop_ids and not full and not (stop and ends_in_stop_string(self.tokenizer,
                                                                                             responses[i], stop)):
                    still.append(i)
            running = still
            if not running or t + 1 == max_new_tokens:
                break
            if interrupt is not None and interrupt():
                interrupted = set(running)
                break
        results = [{"response_ids": responses[i], "log_probs": torch.stack(log_probs[i]).float(),
                    "interrupted": i in interrupted} for i in range(rows)]
        if self.record_routing:
            self._attach_routing(sequences, results)
        return results

    def _attach_routing(self, sequences: list[list[int]], results: list[dict]) -> None:
        """One recording pass over the trajectories (prompt + response): each one's routing per token."""
        batch = SequenceBatch([torch.tensor(s, dtype=torch.long) for s in sequences],
                              torch.tensor([max(1, len(r["response_ids"])) for r in results]))
        micro_batches = self.engine.token_budget_micro_batches(batch.lengths, self.max_tokens_per_forward)
        recorded = self.engine.infer(batch, micro_batches, outputs=("log_probs",), record_routing=True)["routed_experts"]
        for i, (seq, res) in enumerate(zip(sequences, results)):
            res[ROUTED_EXPERTS_KEY] = recorded[i, : len(seq)].clone()
