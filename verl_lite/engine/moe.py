"""Mixture-of-experts router losses, normalised as a property of the mini-batch, and routing replay.

    R = sum_l [ z_coeff * Z_l + aux_coeff * A_l ]
    Z_l = (1/N) * sum over the mini-batch's real tokens t of logsumexp(router_logits_l[t])^2
    A_l = sum over sequences s of (n_s / N) * E * sum_e f_{s,e} * P_{s,e}   (per-sequence Switch loss; f no gradient)

N = real tokens of the whole mini-batch (all DP ranks). Megatron's own router losses are off; each router adds its
local share of R, back-propagated with the engine's ``grad_scale``, inside a train step only
(docs/contracts.md, "Mixture-of-experts router losses: a property of the mini-batch too").

Routing replay (:class:`RoutingReplay`): every router takes the given experts instead of its own top k, through
megatron-core's ``RouterReplay`` (``REPLAY_FORWARD``); the router losses keep the router's own top k for f
(docs/algorithms.md, "Routing replay (`actor.router_replay`, MoE)").
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RouterLossCoefficients:
    """verl's ``override_transformer_config.moe_aux_loss_coeff`` / ``moe_z_loss_coeff`` (>= 0)."""

    aux: float = 0.0
    z: float = 0.0

    def __post_init__(self):
        for name in ("aux", "z"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or v < 0:
                raise ValueError(f"moe_{name}_loss_coeff={v!r} must be a number >= 0")

    @property
    def enabled(self) -> bool:
        return self.aux > 0 or self.z > 0

    @classmethod
    def pop_from(cls, overrides: dict) -> "RouterLossCoefficients":
        """Remove the two keys from megatron overrides (megatron must not see them) and return them."""
        aux = overrides.pop("moe_aux_loss_coeff", 0.0)
        z = overrides.pop("moe_z_loss_coeff", 0.0)
        return cls(aux=float(aux or 0.0), z=float(z or 0.0))


_STEP: "RouterLossStep | None" = None  # the active train step's, read by the routers
_REPLAY: "RoutingReplay | None" = None  # the micro-batch's routing to replay, read by the routers
UNKNOWN_EXPERT = 255  # a token whose routing the rollout did not record (its last token; dense layers)


def sequence_ids(packed) -> torch.Tensor:
    """``[T_local]`` long: the sequence (its index in the micro-batch) of each row of the local pack, -1 on padding
    (a pack without shared prompts: sequence i holds P_i / CP consecutive rows)."""
    per_seq = torch.tensor([p // packed.cp_size for p in packed.padded_lengths], dtype=torch.long)
    ids = torch.repeat_interleave(torch.arange(len(packed.lengths), dtype=torch.long), per_seq)
    return torch.where(packed.real_mask.reshape(-1), ids, torch.full_like(ids, -1))


class RoutingReplay:
    """The experts to route each token of one micro-batch to: ``experts`` ``[T_local, num_layers, k]`` on the local
    pack (``packing.pack_tokens``), ``UNKNOWN_EXPERT`` where not recorded (the last token of each sequence, padding:
    those tokens take the router's own choice, as without replay). ``experts=None`` records instead: every router
    keeps its own choice in ``recorded`` (``[T_local, num_layers, k]``, -1 for the tokens and layers this rank does not
    route), gathered per sequence by :meth:`reduced_routing`.

    It also counts, per sequence and layer, the recorded tokens whose router would have chosen other experts
    (``mismatched``) out of those it saw (``compared``) ``[b, num_layers]``: this rank's share (the tokens it routes;
    TP ranks without sequence parallelism see the same tokens, so only TP rank 0 counts), summed over the model-
    parallel groups by :meth:`reduced_counts`."""

    def __init__(self, experts: torch.Tensor | None, seq_ids: torch.Tensor, num_seqs: int, sequence_parallel: bool,
                 num_layers: int, top_k: int):
        """``experts`` and ``seq_ids`` (``sequence_ids``) on the device the routers run on: the counts and the record
        stay there (no host sync per layer) until :meth:`reduced_counts` / :meth:`reduced_routing`."""
        self.experts, self.seq_ids, self.sequence_parallel = experts, seq_ids, sequence_parallel
        self.mismatched = torch.zeros(num_seqs, num_layers, dtype=torch.float64, device=seq_ids.device)
        self.compared = torch.zeros_like(self.mismatched)
        self.recorded = (torch.full((seq_ids.numel(), num_layers, top_k), -1, dtype=torch.long, device=seq_ids.device)
                         if experts is None else None)  # -1: not routed here

    def record(self, layer_number: int, logits: torch.Tensor, top_k: int, tp_group) -> None:
        """Keep this router's own top k of its tokens (the TP slice of the local pack under sequence parallelism;
        without it only TP rank 0 keeps them, the others see the same tokens)."""
        if not (self.sequence_parallel or tp_group.rank() == 0):
            return
        self._local(self.recorded, tp_group)[:, layer_number - 1] = logits.detach().topk(top_k, dim=-1).indices

    def reduced_routing(self, positions: torch.Tensor, width: int, groups) -> torch.Tensor:
        """The recorded routing per sequence, uint8 ``[b, width, num_layers, k]`` on the CPU (``positions``: each
        local row's position in its sequence, -1 on padding), each token's from the rank that routed it: a sum over
        ``groups`` (TP, CP, PP) of one-hot contributions, ``UNKNOWN_EXPERT`` where no rank routed it."""
        positions = positions.to(self.seq_ids.device)
        rows = (self.seq_ids >= 0) & (positions >= 0)
        out = self.recorded.new_zeros(self.mismatched.shape[0], width, *self.recorded.shape[1:], dtype=torch.int32)
        out[self.seq_ids[rows], positions[rows]] = (self.recorded[rows] + 1).to(torch.int32)  # 0: not routed here
        out = summed_over(out, groups)
        return torch.where(out > 0, out - 1, UNKNOWN_EXPERT).to(torch.uint8).cpu()

    def _local(self, x: torch.Tensor, tp_group) -> torch.Tensor:
        """The rows of ``x`` (the local pack's) this router sees: its TP slice under sequence parallelism."""
        if not self.sequence_parallel:
            return x
        chunk = x.shape[0] // tp_group.size()
        return x[tp_group.rank() * chunk : (tp_group.rank() + 1) * chunk]

    def layer_experts(self, layer_number: int, logits: torch.Tensor, top_k: int, tp_group) -> torch.Tensor:
        """``[tokens, k]`` long of decoder layer ``layer_number`` (1-based, global) for the tokens this router sees
        (``logits`` ``[tokens, E]``: its own scores, compared with the recorded choice; the recorded ids were
        checked against E when the micro-batch was packed)."""
        recorded = self._local(self.experts[:, layer_number - 1], tp_group).long()
        if recorded.shape[0] != logits.shape[0]:
            raise RuntimeError(f"router saw {logits.shape[0]} tokens, the replayed routing has {recorded.shape[0]}")
        known = (recorded != UNKNOWN_EXPERT).all(-1)
        own = logits.detach().topk(top_k, dim=-1).indices
        if self.sequence_parallel or tp_group.rank() == 0:
            seq = self._local(self.seq_ids, tp_group)
            counted = known & (seq >= 0)
            differs = (own.sort(-1).values != recorded.sort(-1).values).any(-1)
            rows = seq.clamp(min=0)  # padding rows add 0
            self.compared[:, layer_number - 1].index_add_(0, rows, counted.to(torch.float64))
            self.mismatched[:, layer_number - 1].index_add_(0, rows, (counted & differs).to(torch.float64))
        return torch.where(known[:, None], recorded, own)

    def reduced_counts(self, groups) -> tuple[torch.Tensor, torch.Tensor]:
        """(mismatched, compared) ``[b, num_layers]`` on the CPU, summed over ``groups`` (TP, CP and PP: every rank of
        a DP rank's model replica, in the same order on each)."""
        counts = summed_over(torch.stack([self.mismatched, self.compared]), groups).cpu()
        return counts[0], counts[1]


def summed_over(x: torch.Tensor, groups) -> torch.Tensor:
    """``x`` all-reduced (summed) over each of ``groups`` in turn (a group of one, or None, skipped)."""
    import torch.distributed as dist

    for group in groups:
        if group is not None and group.size() > 1:
            dist.all_reduce(x, group=group)
    return x


def mismatch_shares(mismatched: torch.Tensor, compared: torch.Tensor) -> dict[str, float]:
    """Of the tokens whose routing was replayed, the share whose experts the router itself would have chosen
    otherwise, per decoder layer (``routing_mismatch/layer_<l>``, 0-based, layers with any compared token) and over
    all of them (``routing_mismatch``); from counts ``[..., layers]`` (summed over the leading dims)."""
    mismatched = mismatched.reshape(-1, mismatched.shape[-1]).sum(0)
    compared = compared.reshape(-1, compared.shape[-1]).sum(0)
    out = {f"routing_mismatch/layer_{layer}": float(mismatched[layer] / compared[layer])
           for layer in range(compared.numel()) if compared[layer] > 0}
    if compared.sum() > 0:
        out["routing_mismatch"] = float(mismatched.sum() / compared.sum())
    return out


@contextlib.contextmanager
def replaying(routing: "RoutingReplay | None"):
    """Routers replay ``routing`` inside (nothing when None)."""
    global _REPLAY
    _REPLAY = routing
    try:
        yield
    finally:
        _REPLAY = None


class _InjectLossGradient(torch.autograd.Function):
    """Identity on ``x``; in backward, ``loss`` receives the gradient ``grad_scale`` (a constant)."""

    @staticmethod
    def forward(ctx, x, loss, grad_scale: float):
        ctx.save_for_backward(loss)
        ctx.grad_scale = grad_scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_x):
        (loss,) = ctx.saved_tensors
        return grad_x, torch.full_like(loss, ctx.grad_scale), None


class RouterLossStep(contextlib.AbstractContextManager):
    """The router losses of one train step, active inside ``with``. ``num_tokens`` = N; ``grad_scale``: the
    factor the engine multiplies the policy contribution by; ``sequence_parallel``: how the local pack is
    split over TP. :meth:`micro_batch` before each forward, :meth:`metrics` after the step."""

    def __init__(self, num_tokens: int, grad_scale: float, sequence_parallel: bool):
        if num_tokens <= 0:
            raise ValueError(f"router losses need a mini-batch with real tokens, got N={num_tokens}")
        self.weight, self.grad_scale, self.sequence_parallel = 1.0 / num_tokens, float(grad_scale), sequence_parallel
        self.seq_ids = self.seq_lengths = None  # the micro-batch's: sequence index per local token (-1: padding), n_s
        self.z_sum: dict[int, float] = {}  # layer -> local sum of (1/N) z terms
        self.aux_sum: dict[int, float] = {}

    def __enter__(self):
        global _STEP
        if _STEP is not None:
            raise RuntimeError("a router-loss step is already active (nested train steps?)")
        _STEP = self
        return self

    def __exit__(self, *exc):
        global _STEP
        _STEP = None
        return False

    def micro_batch(self, packed) -> None:
        """Before a micro-batch's forward (every stage): which sequence each token of ``packed`` is."""
        self.seq_ids = sequence_ids(packed)
        self.seq_lengths = torch.as_tensor(packed.lengths, dtype=torch.float64).reshape(-1)

    def metrics(self, num_moe_layers: int, coeffs: RouterLossCoefficients) -> dict[str, float]:
        """The same on every rank (collective over the world: every MoE stage adds its own layers):
        ``router_z_loss`` / ``router_aux_loss`` = mean over the MoE layers of Z_l / A_l, ``router_loss`` = R."""
        import torch.distributed as dist

        t = torch.tensor([sum(self.z_sum.values()), sum(self.aux_sum.values())], dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(t)
        z, aux = float(t[0]), float(t[1])
        return {"router_z_loss": z / num_moe_layers, "router_aux_loss": aux / num_moe_layers,
                "router_loss": coeffs.z * z + coeffs.aux * aux}

    def local_token_ids(self, num_local: int, tp_group) -> torch.Tensor:
        """Sequence index of each token the router sees (the TP slice of the local pack under SP)."""
        ids = self.seq_ids
        if self.sequence_parallel:
            chunk = ids.numel() // tp_group.size()
            ids = ids[tp_group.rank() * chunk : (tp_group.rank() + 1) * chunk]
        if ids.numel() != num_local:
            raise RuntimeError(f"router saw {num_local} tokens, the micro-batch context has {ids.numel()}")
        return ids


def router_losses_local(logits: torch.Tensor, seq_ids: torch.Tensor, seq_lengths: torch.Tensor, top_k: int,
                        weight: float, count_group=None) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of (Z_l, A_l) for one layer and micro-batch: ``weight`` * sums over the local
    real tokens (``seq_ids >= 0``). ``logits`` [T, E]; expert counts are summed over ``count_group``."""
    import torch.distributed as dist

    logits = logits.float()
    num_experts = logits.shape[-1]
    real = seq_ids.to(logits.device) >= 0
    ids = seq_ids.to(logits.device)[real]
    lg = logits[real]
    z = torch.logsumexp(lg, dim=-1).pow(2).sum() * weight
    probs = torch.softmax(lg, dim=-1)
    with torch.no_grad():
        routed = torch.zeros_like(probs).scatter_(1, torch.topk(probs, top_k, dim=-1).indices, 1.0)
        counts = torch.zeros(seq_lengths.numel(), num_experts, dtype=torch.float32, device=logits.device)
        counts.index_add_(0, ids, routed)
        if count_group is not None and count_group.size() > 1:
            dist.all_reduce(counts, group=count_group)
        f = counts / (top_k * seq_lengths.to(counts.device, torch.float32).clamp(min=1.0))[:, None]
    aux = (f[ids] * probs).sum() * (num_experts * weight)
    return z, aux


@functools.cache
def router_class():
    """The router class for the MoE layer spec (built on first use: it imports megatron)."""
    from megatron.core.transformer.moe.router import TopKRouter

    class RouterWithMiniBatchLosses(TopKRouter):
        """megatron's ``TopKRouter`` plus this module's mini-batch router losses inside a train step."""

        def gating(self, input):
            """megatron's gating; without TransformerEngine its ``RouterGatingLinearFunction`` reads the
            undefined ``te_general_gemm`` (megatron-core 0.16.1), so the same product (input and weight in
            the router dtype, no bias) is computed here with ``F.linear``."""
            from megatron.core.transformer.moe import moe_utils

            if moe_utils.HAVE_TE:
                return super().gating(input)
            dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
            bias = None if self.bias is None else self.bias.to(dtype)
            return torch.nn.functional.linear(input.to(dtype), self.weight.to(dtype), bias)

        def routing(self, logits, padding_mask=None):
            replay = _REPLAY
            if replay is not None and replay.experts is None:  # recording: the router's own choice, kept
                replay.record(int(self.layer_number), logits.view(-1, self.config.num_moe_experts), self.topk,
                              self.tp_group)
            if replay is None or replay.experts is None or self.router_replay is None:
                return self._routing_with_losses(logits, padding_mask)
            from megatron.core.transformer.moe.router_replay import RouterReplayAction

            flat = logits.view(-1, self.config.num_moe_experts)
            experts = replay.layer_experts(int(self.layer_number), flat, self.topk, self.tp_group)
            self.router_replay.set_target_indices(experts)
            self.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            try:
                return self._routing_with_losses(logits, padding_mask)
            finally:
                self.router_replay.clear_indices()
                self.router_replay.clear_router_replay_action()

        def _routing_with_losses(self, logits, padding_mask=None):
            step = _STEP
            coeffs: RouterLossCoefficients = getattr(self.config, "router_loss", RouterLossCoefficients())
            if step is not None and coeffs.enabled and self.training and torch.is_grad_enabled():
                flat = logits.view(-1, self.config.num_moe_experts)
                if step.seq_ids is None:
                    raise RuntimeError("RouterLossStep.micro_batch(...) was not called before the forward")
                ids = step.local_token_ids(flat.shape[0], self.tp_group)
                z, aux = router_losses_local(flat, ids, step.seq_lengths, self.topk, step.weight,
                                             count_group=self.tp_cp_group)
                layer = int(self.layer_number or 0)
                step.z_sum[layer] = step.z_sum.get(layer, 0.0) + float(z.detach())
                step.aux_sum[layer] = step.aux_sum.get(layer, 0.0) + float(aux.detach())
                local = coeffs.z * z + coeffs.aux * aux
                logits = _InjectLossGradient.apply(logits, local, step.grad_scale)
            return super().routing(logits, padding_mask)

    return RouterWithMiniBatchLosses


def router_losses_enabled(tf_config) -> bool:
    """Whether the model has MoE layers and a router-loss coefficient above 0."""
    coeffs = getattr(tf_config, "router_loss", None)
    return tf_config.num_moe_experts is not None and coeffs is not None and coeffs.enabled


def train_step_router_losses(engine, num_tokens: int):
    """The :class:`RouterLossStep` of one train step (N = ``num_tokens``), or ``nullcontext(None)`` without
    router losses. grad_scale = DP x CP when megatron averages gradients over DP x CP, K = N when it divides
    them by the reduced token count (per-token mode)."""
    cfg = engine.tf_config
    if not router_losses_enabled(cfg):
        return contextlib.nullcontext(None)
    if cfg.recompute_granularity is not None:
        raise ValueError(
            "MoE router losses (moe_aux_loss_coeff / moe_z_loss_coeff > 0) with activation recompute "
            "(enable_gradient_checkpointing / recompute_granularity) are not built: the recomputed router forward "
            "would see another micro-batch's token map; turn one of them off")
    grad_scale = num_tokens if cfg.calculate_per_token_loss else engine.dp * engine.cp
    return RouterLossStep(num_tokens, grad_scale, bool(cfg.sequence_parallel))
