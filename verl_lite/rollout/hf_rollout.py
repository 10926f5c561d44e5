"""Generation with an HF transformers causal LM (CPU or one GPU): batched, left-padded, KV-cached.

The output contract is ``verl_lite.rollout.base.Rollout``'s. Each prompt is prefilled once, its n samples start
from copies of its KV cache; every row draws its token by inverting the CDF of softmax(filtered logits / T)
(``inverse_cdf_sample``) at a uniform hashed from its key (``counter_uniform``, ``base.sample_keys``) and the
position, so its draws depend on its key and its own logits only (docs/rollout.md,
"HF (`verl_lite/rollout/hf_rollout.py`)"). The logits come from a batched forward; batched and single-row kernels
agree to ~1e-6, so another batch can flip a draw only where u falls that close to a boundary of the row's CDF.
A call leaves the global RNG alone.
"""

from __future__ import annotations

import inspect
import re
from typing import Iterable

import torch

from verl_lite.compat.hf_attention import use_decode_attention
from verl_lite.compat.kv_cache import reserved_cache
from verl_lite.compat.torch_internals import torch_function_disabled
from verl_lite.engine.attention import MATMUL_ATTENTION_DTYPES, grouped_matmul_attention
from verl_lite.engine.hf_bridge import fused_expert_view
from verl_lite.engine.moe import UNKNOWN_EXPERT
from verl_lite.protocol import ROUTED_EXPERTS_KEY
from verl_lite.rollout.base import Rollout, rollout_temperature


def _filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """Set logits outside the top-k, outside the top-p nucleus and below ``min_p`` x the top token's
    probability to -inf ([b, V], already temperature-scaled; HF's warpers in HF's order)."""
    if top_k is not None and top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass strictly before it already reaches top_p (the top token is always kept)
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if min_p is not None and min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.amax(dim=-1, keepdim=True), float("-inf"))
    return logits


def _penalize_repetition(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """HF's repetition penalty: the logit of every token already in the sequence (``seen`` [b, V] bool)
    divided by ``penalty`` where positive, multiplied where negative (sign-preserving, so it commutes
    with the temperature)."""
    penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalized, logits)


_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for uint32 values held in int64 (or a Python int), without int64 overflow."""
    hi = ((x * (c >> 16)) & 0xFFFF) << 16
    return (hi + x * (c & 0xFFFF)) & _M32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """murmur3's 32-bit finaliser (a bijection with full avalanche) on uint32 values held in int64 (or a Python int)."""
    x = x & _M32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def row_keys(seeds: torch.Tensor, sample_ids: torch.Tensor) -> torch.Tensor:
    """The per-row part of :func:`counter_uniform`'s hash, int64 ``[b]`` (the same at every position)."""
    s = seeds.to(torch.int64)
    return _fmix32(_fmix32(_fmix32(s & _M32) ^ _fmix32((s >> 32) & _M32) ^ 0x9E3779B9) ^ (sample_ids.to(torch.int64) & _M32))


def uniform_at(keys: torch.Tensor, position: int) -> torch.Tensor:
    """:func:`counter_uniform` from the rows' :func:`row_keys`."""
    position_key = _fmix32((int(position) * 0x632BE5AB + 0x2545F491) & _M32)  # a Python int: no tensor ops
    h = _fmix32(_fmix32(keys ^ position_key) + 0x7F4A7C15)
    return (h.double() + 0.5) / 2.0**32


def counter_uniform(seeds: torch.Tensor, sample_ids: torch.Tensor, position: int) -> torch.Tensor:
    """One uniform in (0, 1) per row, float64 ``[b]``: a hash of (seeds[i], sample_ids[i], position) and
    nothing else (the same value on any device, in any batch), on a grid of 2**-32."""
    return uniform_at(row_keys(seeds, sample_ids), position)


def inverse_cdf_sample(scaled_logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One draw per row from softmax(scaled_logits) (-inf entries never drawn): the first token whose
    cumulative probability (float64, in vocabulary order) exceeds ``uniforms[i]`` times the total. A token of
    probability p owns an interval of width p of the CDF, so it is drawn with probability p (to the 2**-32 grid
    of ``counter_uniform``), at one softmax and cumsum per row (a Gumbel-max would hash every token). Only a row of
    NaN logits could point past the end; the clamp keeps its draw a token id, as argmax would."""
    cdf = torch.softmax(scaled_logits.double(), dim=-1).cumsum_(dim=-1)
    target = (uniforms.to(cdf.dtype) * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp_(max=cdf.shape[-1] - 1)


def draw_tokens(scaled: torch.Tensor, seen: torch.Tensor | None, repetition_penalty: float, do_sample: bool,
                top_k: int, top_p: float, min_p: float, keys: torch.Tensor, position: int) -> torch.Tensor:
    """Each row's next token from its float32 temperature-scaled logits [b, V]: the repetition penalty on its
    ``seen`` tokens (bool; None: none), then the inverse-CDF draw of the filtered logits at
    ``uniform_at(keys, position)``, or the argmax."""
    if seen is not None:
        scaled = _penalize_repetition(scaled, seen, repetition_penalty)
    if do_sample:
        return inverse_cdf_sample(_filter_top_k_top_p(scaled, top_k, top_p, min_p), uniform_at(keys, position))
    return scaled.argmax(dim=-1)


# Stopped rows leave the batch once at most this fraction of its rows is still generating: a kept stopped row
# costs less than its share of a decode step (the matmuls read the weights once for all rows), while dropping
# rows copies every layer's KV cache.
COMPACT_AT = 7 / 8


def ends_in_stop_string(tokenizer, response: list[int], stop: list[str]) -> bool:
    """Whether ``response`` ends in one of ``stop`` (only its last tokens are decoded: a stop string that completed
    earlier would have stopped the row then)."""
    window = 4 * max(len(s) for s in stop) + 4
    tail = tokenizer.decode(response[-window:], skip_special_tokens=False)
    return any(s in tail for s in stop)


def _cache_of(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


class _RouterRecorder:
    """Forward hooks on the routers of an HF MoE model (transformers' qwen3_moe / qwen2_moe: a module whose class
    name ends in ``TopKRouter``, inside decoder layer ``layers.<i>``, whose forward returns ``(router_logits,
    router_scores, router_indices)``). :meth:`take` gives the routing of the model's latest forward."""

    def __init__(self, model, model_path: str):
        routers = {int(m.group(1)): module for name, module in model.named_modules()
                   if type(module).__name__.endswith("TopKRouter") and (m := re.search(r"layers\.(\d+)\.", name))}
        if not routers:
            raise ValueError(f"record_routing=True: the model of {model_path} ({type(model).__name__}) has no MoE "
                             "router (no decoder-layer module *TopKRouter); use an MoE model or record_routing=False")
        if (num_experts := max(int(r.num_experts) for r in routers.values())) > UNKNOWN_EXPERT:
            raise ValueError(f"record_routing=True: the model of {model_path} has {num_experts} experts; the uint8 "
                             f"routing record holds ids up to {UNKNOWN_EXPERT - 1} ({UNKNOWN_EXPERT}: unknown)")
        self.num_layers, self.top_k = model.config.num_hidden_layers, max(int(r.top_k) for r in routers.values())
        self._indices: dict[int, torch.Tensor] = {}  # decoder layer -> router_indices of its latest forward
        for layer, router in routers.items():
            router.register_forward_hook(lambda _m, _args, out, layer=layer: self._indices.__setitem__(layer, out[2]))

    def take(self) -> torch.Tensor:
        """uint8 ``[tokens of the latest forward (batch x seq, row-major), num_hidden_layers, top_k]``: each token's
        experts per layer in the router's top-k order, ``UNKNOWN_EXPERT`` for layers without a router."""
        indices, self._indices = self._indices, {}
        tokens = next(iter(indices.values()))
        out = torch.full((tokens.shape[0], self.num_layers, self.top_k), UNKNOWN_EXPERT, dtype=torch.uint8,
                         device=tokens.device)
        for layer, idx in indices.items():
            out[:, layer, : idx.shape[1]] = idx.to(torch.uint8)
        return out


class HFRollout(Rollout):
    """An HF causal LM (``model_path``, a local HF model dir) used for generation; weights are synced in place from
    the trainer. The eos / pad ids are read from ``tokenizer``.

    ``record_routing`` (an MoE model: transformers' qwen3_moe / qwen2_moe; ValueError for a model without routers):
    every result of ``generate`` also holds ``routed_experts``, uint8 ``[len(prompt) + len(response),
    num_hidden_layers, top_k]``, the experts the rollout's router chose for each token in the forward that fed it;
    ``UNKNOWN_EXPERT`` (255) for the last response token and layers without experts (docs/algorithms.md,
    "Routing replay (`actor.router_replay`, MoE)")."""

    interruptible = True

    def __init__(self, model_path: str, tokenizer, dtype: torch.dtype = torch.float32, device: str | None = None,
                 record_routing: bool = False):
        import transformers

        self.tokenizer = tokenizer
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.model = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(self.device)
        use_decode_attention(self.model, grouped_matmul_attention, MATMUL_ATTENTION_DTYPES)
        self.model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        # the forward's KV cache argument: `cache` in newer transformers, else `past_key_values`
        self._cache_kw = "cache" if "cache" in inspect.signature(self.model.forward).parameters else "past_key_values"
        self.eos_token_id = tokenizer.eos_token_id
        if self.eos_token_id is None:
            raise ValueError(f"tokenizer of {model_path} has no eos_token; HFRollout needs one to stop generation")
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token_id
        self._router_recorder = _RouterRecorder(self.model, model_path) if record_routing else None

    @torch.no_grad()
    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], strict: bool = False) -> int:
        """``Rollout.load_weights``; strict=True also requires every model parameter to be covered."""
        targets = self.model.state_dict(keep_vars=True)
        loaded: set[str] = set()
        for name, tensor in named_tensors:
            fused = None if name in targets else fused_expert_view(targets, name)  # MoE: experts fused in memory
            if name not in targets and fused is None:
                raise ValueError(f"load_weights: {name!r} is not a parameter of the rollout model ({type(self.model).__name__})")
            name, target = fused if fused is not None else (name, targets[name])
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"load_weights: {name!r} has shape {tuple(tensor.shape)}, the model expects {tuple(target.shape)}")
            target.data.copy_(tensor.detach().to(device=target.device, dtype=target.dtype))
            loaded.add(name)
        if strict:
            missing = {n for n, _ in self.model.named_parameters()} - loaded
            if missing:
                raise ValueError(f"load_weights(strict=True): parameters not provided: {sorted(missing)}")
        return len(loaded)

    def _left_pad(self, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s):] = 1
        return ids.to(self.device), mask.to(self.device)

    def _generate(self, prompt_ids, n, do_sample, temperature, top_p, top_k, max_new_tokens, keys, *,
                  repetition_penalty: float = 1.0, min_p: float = 0.0, stop: list[str] | None = None,
                  stop_token_ids: list[int] | None = None, interrupt=None) -> list[dict]:
        """``Rollout.generate`` in one batched call. The further ``generation_kwargs``, as HF ``generate`` names
        them: ``repetition_penalty`` (HF's, over prompt + response tokens) and ``min_p`` shape which token is drawn
        (greedy too, for the penalty); the reported log-probs stay log p_T of the unshaped logits, as with top-k /
        top-p. ``stop`` (strings) ends a response at the token that completes one of them, ``stop_token_ids`` at
        one of those tokens (both kept in the response, as EOS is). ``interrupt`` (a callable) is asked after every
        token: once true, the call returns, each response still running marked ``interrupted``."""
        stop = [stop] if isinstance(stop, str) else list(stop or [])
        # no __torch_function__ overrides (e.g. a colocated engine's CPU adapter: a Python hop per torch call) and
        # no autograd bookkeeping
        with torch_function_disabled(), torch.inference_mode():
            tokens, logps, lengths, running, routing = self._sample(
                prompt_ids, n, do_sample, temperature, top_p, top_k, max_new_tokens, keys, float(repetition_penalty),
                float(min_p or 0.0), stop, list(stop_token_ids or []), interrupt)
        # cloned outside inference mode: the caller gets ordinary tensors
        results = [{"response_ids": tokens[i, :k].tolist(), "log_probs": logps[i, :k].clone(),
                    "interrupted": running[i]} for i, k in enumerate(lengths)]
        if routing is not None:  # row i's columns: its prompt right-aligned at the prefill's width, then its response
            routing, width = routing.cpu(), routing.shape[1] - max_new_tokens
            for i, (res, k) in enumerate(zip(results, lengths)):
                res[ROUTED_EXPERTS_KEY] = routing[i, width - len(prompt_ids[i // n]) : width + k].clone()
        return results

    def _prefill(self, prompt_ids: list[list[int]], n: int, max_new_tokens: int):
        """The forward of each DISTINCT prompt once, its KV cache rows and last logits then selected for each of the
        call's rows (n per prompt; a prompt given twice, as a stream's samples of one group are, shares its row:
        ``Cache.batch_select_indices``; a cache without it gets every row's prompt instead). Returns (ids, attention
        mask, cache, last logits) per row and the rows' index into the forward's (None: one row each); the cache has
        room for ``max_new_tokens`` more positions where ``compat.kv_cache`` serves the model."""
        def forward(seqs):
            ids, attn = self._left_pad(seqs)
            position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
            cache = reserved_cache(self.model.config, ids.shape[1] + max_new_tokens)
            out = self.model(input_ids=ids, attention_mask=attn, position_ids=position_ids, use_cache=True,
                             **({} if cache is None else {self._cache_kw: cache}))
            return ids, attn, _cache_of(out), out.logits[:, -1, :]

        rows = [tuple(p) for p in prompt_ids for _ in range(n)]
        distinct = {prompt: i for i, prompt in enumerate(dict.fromkeys(rows))}
        if len(distinct) == len(rows):
            return (*forward([list(p) for p in rows]), None)
        ids, attn, past, logits = forward([list(p) for p in distinct])
        if not callable(getattr(past, "batch_select_indices", None)):
            return (*forward([list(p) for p in rows]), None)
        index = torch.tensor([distinct[r] for r in rows], device=self.device)
        past.batch_select_indices(index)
        return ids[index], attn[index], past, logits[index], index

    def _stopped_by_string(self, tokens: torch.Tensor, lengths: torch.Tensor, rows: torch.Tensor,
                           stop: list[str]) -> torch.Tensor:
        """[len(rows)] bool: the response of each row ends in one of ``stop`` (:func:`ends_in_stop_string`)."""
        out = [ends_in_stop_string(self.tokenizer, tokens[r, : int(lengths[r])].tolist(), stop) for r in rows.tolist()]
        return torch.tensor(out, dtype=torch.bool, device=tokens.device)

    def _sample(self, prompt_ids, n, do_sample, temperature, top_p, top_k, max_new_tokens, keys, repetition_penalty,
                min_p, stop, stop_ids, interrupt) -> tuple:
        """Tokens [rows, max_new_tokens], their log-probs, each row's response length and whether it was still
        running when ``interrupt()`` stopped the call (``_generate``'s rows), and with ``record_routing`` the routing
        uint8 [rows, prefill width + max_new_tokens, layers, top_k] (column width + t: response token t), else None."""
        scale = rollout_temperature(temperature)
        b = len(prompt_ids) * n
        row_seeds, row_samples = torch.tensor(keys, dtype=torch.int64, device=self.device).unbind(-1)
        row_hashes = row_keys(row_seeds, row_samples)  # counter_uniform's per-row part, hashed once per call
        ids, attn, past, logits, index = self._prefill(prompt_ids, n, max_new_tokens)
        routing = self._prefill_routing(index, ids.shape[1], max_new_tokens)
        position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
        next_pos = position_ids[:, -1:] + 1

        tokens = torch.full((b, max_new_tokens), self.pad_token_id, dtype=torch.long, device=self.device)
        logps = torch.zeros((b, max_new_tokens), dtype=torch.float32, device=self.device)
        lengths = torch.zeros(b, dtype=torch.long, device=self.device)
        attn = torch.cat([attn, attn.new_zeros((b, max_new_tokens))], dim=1)  # filled in as tokens are kept
        width = ids.shape[1]
        # the call's rows still in the batch: stopped rows leave it and the KV cache (``batch_select_indices``) at
        # COMPACT_AT; until then, or with a cache without it, a stopped row stays, masked
        rows = torch.arange(b, device=self.device)
        alive = torch.ones(b, dtype=torch.bool, device=self.device)
        compact = callable(getattr(past, "batch_select_indices", None))
        seen = None  # [b, V]: tokens of each row's prompt + response so far (repetition penalty)
        if repetition_penalty != 1.0:
            seen = torch.zeros((b, logits.shape[-1]), dtype=torch.float32, device=self.device)
            seen = seen.scatter_add_(1, ids, attn[:, :width].float()) > 0
        stop_ids_t = torch.tensor([self.eos_token_id, *stop_ids], dtype=torch.long, device=self.device)
        for t in range(max_new_tokens):
            scaled = logits.float() / scale
            logp_full = torch.log_softmax(scaled, dim=-1)
            nxt = draw_tokens(scaled, None if seen is None else seen[rows], repetition_penalty, do_sample, top_k, top_p,
                              min_p, row_hashes[rows], t)
            nxt = torch.where(alive, nxt, torch.full_like(nxt, self.pad_token_id))
            tokens[rows, t] = nxt
            logps[rows, t] = logp_full.gather(-1, nxt[:, None]).squeeze(-1)
            lengths[rows] += alive.long()
            if seen is not None:
                seen[rows[alive], nxt[alive]] = True
            alive = alive & ~torch.isin(nxt, stop_ids_t)
            if stop and bool(alive.any()):
                alive = alive & ~self._stopped_by_string(tokens, lengths, rows, stop)
            if t + 1 == max_new_tokens or not bool(alive.any()):
                break
            if interrupt is not None and interrupt():
                interrupted = torch.zeros(b, dtype=torch.bool)
                interrupted[rows[alive].cpu()] = True
                return tokens.cpu(), logps.cpu(), lengths.tolist(), interrupted.tolist(), routing
            if compact and int(alive.sum()) <= COMPACT_AT * alive.numel():
                keep = alive.nonzero().squeeze(-1)
                past.batch_select_indices(keep)
                rows, nxt, attn, next_pos, alive = rows[keep], nxt[keep], attn[keep], next_pos[keep], alive[keep]
            attn[:, width + t] = alive.long()
            out = self.model(input_ids=nxt[:, None], attention_mask=attn[:, : width + t + 1], position_ids=next_pos,
                             use_cache=True, **{self._cache_kw: past})
            past, logits = _cache_of(out), out.logits[:, -1, :]
            next_pos = next_pos + 1
            if routing is not None:  # a row stopped by token t was fed it masked: its routing stays unknown
                routing[rows[alive], width + t] = self._router_recorder.take()[alive]

        return tokens.cpu(), logps.cpu(), lengths.tolist(), [False] * b, routing

    def _prefill_routing(self, index: torch.Tensor | None, width: int, max_new_tokens: int) -> torch.Tensor | None:
        """The routing of ``_prefill``'s (last) forward, ``UNKNOWN_EXPERT`` in the response columns, per row of the
        call (``index``: ``_prefill``'s): uint8 [rows, width + max_new_tokens, layers, top_k] (None without
        ``record_routing``)."""
        if self._router_recorder is None:
            return None
        prefill = self._router_recorder.take().unflatten(0, (-1, width))
        routing = prefill.new_full((prefill.shape[0], width + max_new_tokens, *prefill.shape[2:]), UNKNOWN_EXPERT)
        routing[:, :width] = prefill
        return routing if index is None else routing[index.to(routing.device)]
