"""Mixture-of-experts router losses, normalised as a property of the mini-batch.

The objective (per optimizer step, summed over the model's MoE layers l):

    R = sum_l [ z_coeff * Z_l + aux_coeff * A_l ]
    Z_l = (1/N) * sum over the mini-batch's real tokens t of logsumexp(router_logits_l[t])^2
    A_l = sum over sequences s of (n_s / N) * a_{l,s},
          a_{l,s} = E * sum_e f_{s,e} * P_{s,e}     (the Switch load-balancing loss of ONE sequence)
          f_{s,e} = (tokens of s with e among their top-k) / (k * n_s),  P_{s,e} = mean over s of softmax_e

N = real (non-padding) tokens of the whole mini-batch (prompt + response, all DP ranks), n_s the
real tokens of sequence s, E experts, top-k. Because P is linear in the per-token softmax,
``A_l = (1/N) sum_t E * f_{s(t)} . p_t``: R is a sum of per-token terms with weight 1/N and a
per-sequence constant f (no gradient through the top-k counts, as in Switch/megatron). Sequences
are never split across micro-batches or DP ranks, so R depends neither on the micro-batching
nor on the layout; under CP and sequence parallelism a sequence's tokens are spread over the
TP x CP group, so the expert counts of f are summed over that group (one all-reduce per MoE
layer, a constant: no autograd through it).

Megatron's own router losses (``MoEAuxLossAutoScaler``, its 1/num_microbatches scaling and the
per-token-mode multiplication by the local token count, verl #6609) are switched off
(``moe_aux_loss_coeff=0``, ``moe_z_loss_coeff=None``, ``moe_router_load_balancing_type="none"``);
``RouterWithMiniBatchLosses`` computes each rank's local share of R and ``_InjectLossGradient``
back-propagates it with the engine's ``grad_scale``, the same factor the engine applies to the
policy loss (DP x CP when megatron averages gradients, the global token count K when it divides
by the reduced token count). Every MoE stage does this for its own layers (no loss owner needed).

The engine calls three functions: ``train_step_router_losses`` (the ``router_loss_step`` context
of one ``train_step``, or a null context for a dense model / zero coefficients),
``start_micro_batch`` before each micro-batch's forward (the per-token sequence index), and
``router_metrics`` after the step. Outside a step (inference) the router computes no loss.

The router's gating product is computed here without TransformerEngine (megatron-core 0.16.1's
``RouterGatingLinearFunction`` reads the undefined ``te_general_gemm`` without it); the alltoall
dispatcher's device-to-host stream on a CPU-only torch is :mod:`verl_lite.compat.megatron_internals`'.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

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


@dataclass
class _MicroBatchTokens:
    seq_ids: torch.Tensor  # [T] long: sequence index within the micro-batch per local token, -1 = padding
    seq_lengths: torch.Tensor  # [b] real tokens n_s of each sequence


@dataclass
class _Step:
    weight: float  # 1/N
    grad_scale: float
    sequence_parallel: bool
    tokens: _MicroBatchTokens | None = None
    z_sum: dict[int, float] = field(default_factory=dict)  # layer -> local sum of (1/N) z terms
    aux_sum: dict[int, float] = field(default_factory=dict)


_STEP: _Step | None = None


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


class router_loss_step(contextlib.AbstractContextManager):
    """Active during one train step: ``with router_loss_step(N, grad_scale, sp) as step: ...``.

    ``num_tokens`` = N (real tokens of the whole mini-batch); ``grad_scale`` = the factor the
    engine multiplies the policy contribution by before megatron's reduction; ``sequence_parallel``
    tells how the local pack is split over TP. ``step.micro_batch(seq_ids, seq_lengths)`` before each
    forward; ``step.metrics(group)`` after the step (collective over ``group``)."""

    def __init__(self, num_tokens: int, grad_scale: float, sequence_parallel: bool):
        if num_tokens <= 0:
            raise ValueError(f"router losses need a mini-batch with real tokens, got N={num_tokens}")
        self.state = _Step(weight=1.0 / num_tokens, grad_scale=float(grad_scale), sequence_parallel=sequence_parallel)

    def __enter__(self):
        global _STEP
        if _STEP is not None:
            raise RuntimeError("router_loss_step is already active (nested train steps?)")
        _STEP = self.state
        return self

    def __exit__(self, *exc):
        global _STEP
        _STEP = None
        return False

    def micro_batch(self, seq_ids: torch.Tensor, seq_lengths) -> None:
        self.state.tokens = _MicroBatchTokens(
            seq_ids=torch.as_tensor(seq_ids, dtype=torch.long).reshape(-1),
            seq_lengths=torch.as_tensor(seq_lengths, dtype=torch.float64).reshape(-1),
        )

    def metrics(self, group, num_moe_layers: int, coeffs: RouterLossCoefficients) -> dict[str, float]:
        """Router-loss metrics of the step, the same on every rank of ``group`` (collective; pass the
        whole world: every MoE stage contributes its own layers): ``router_z_loss`` and
        ``router_aux_loss`` = mean over the MoE layers of Z_l and A_l, ``router_loss`` = R."""
        import torch.distributed as dist

        s = self.state
        t = torch.tensor([sum(s.z_sum.values()), sum(s.aux_sum.values())], dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size(group) > 1:
            dist.all_reduce(t, group=group)
        z, aux = float(t[0]), float(t[1])
        return {
            "router_z_loss": z / num_moe_layers,
            "router_aux_loss": aux / num_moe_layers,
            "router_loss": coeffs.z * z + coeffs.aux * aux,
        }


def _local_token_ids(tokens: _MicroBatchTokens, num_local: int, sequence_parallel: bool, tp_group) -> torch.Tensor:
    """Sequence index of each token the router sees (the TP slice of the local pack under SP)."""
    ids = tokens.seq_ids
    if sequence_parallel:
        tp = tp_group.size()
        r = tp_group.rank()
        chunk = ids.numel() // tp
        ids = ids[r * chunk : (r + 1) * chunk]
    if ids.numel() != num_local:
        raise RuntimeError(f"router saw {num_local} tokens, the micro-batch context has {ids.numel()}")
    return ids


def router_losses_local(
    logits: torch.Tensor,
    seq_ids: torch.Tensor,
    seq_lengths: torch.Tensor,
    top_k: int,
    weight: float,
    count_group=None,
) -> tuple[torch.Tensor, torch.Tensor]:
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


def _router_class():
    from megatron.core.transformer.moe.router import TopKRouter

    class RouterWithMiniBatchLosses(TopKRouter):
        """megatron's ``TopKRouter`` (softmax scores, top-k, renormalised unless ``moe_router_pre_softmax``)
        plus the mini-batch router losses of this module, active inside ``router_loss_step``."""

        def gating(self, input):
            """megatron's gating; without TransformerEngine its ``RouterGatingLinearFunction`` reads the
            undefined name ``te_general_gemm`` (megatron-core 0.16.1, ``moe_utils.py:1192``), so the same
            product (input and weight in the router dtype, no bias) is computed here with ``F.linear``."""
            from megatron.core.transformer.moe import moe_utils

            if moe_utils.HAVE_TE:
                return super().gating(input)
            dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
            bias = None if self.bias is None else self.bias.to(dtype)
            return torch.nn.functional.linear(input.to(dtype), self.weight.to(dtype), bias)

        def routing(self, logits, padding_mask=None):
            step = _STEP
            coeffs: RouterLossCoefficients = getattr(self.config, "router_loss", RouterLossCoefficients())
            if step is not None and coeffs.enabled and self.training and torch.is_grad_enabled():
                flat = logits.view(-1, self.config.num_moe_experts)
                if step.tokens is None:
                    raise RuntimeError("router_loss_step.micro_batch(...) was not called before the forward")
                ids = _local_token_ids(step.tokens, flat.shape[0], step.sequence_parallel, self.tp_group)
                z, aux = router_losses_local(
                    flat, ids, step.tokens.seq_lengths, self.topk, step.weight, count_group=self.tp_cp_group
                )
                layer = int(self.layer_number or 0)
                step.z_sum[layer] = step.z_sum.get(layer, 0.0) + float(z.detach())
                step.aux_sum[layer] = step.aux_sum.get(layer, 0.0) + float(aux.detach())
                local = coeffs.z * z + coeffs.aux * aux
                logits = _InjectLossGradient.apply(logits, local, step.grad_scale)
            return super().routing(logits, padding_mask)

    return RouterWithMiniBatchLosses


_ROUTER_CLASS = None


def router_class():
    """The router class for the MoE layer spec (built lazily: megatron is imported on first use)."""
    global _ROUTER_CLASS
    if _ROUTER_CLASS is None:
        _ROUTER_CLASS = _router_class()
    return _ROUTER_CLASS


def local_sequence_ids(lengths, padded_lengths, real_mask: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Per local-pack token: index of its sequence in the micro-batch, -1 on padding (see packing)."""
    per_seq = torch.tensor([p // cp_size for p in padded_lengths], dtype=torch.long)
    ids = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.long), per_seq)
    return torch.where(real_mask.reshape(-1), ids, torch.full_like(ids, -1))


def train_step_router_losses(engine, global_token_count: int | None, local_lengths: list[int]):
    """The engine's one call: ``router_loss_step`` for this train step, or ``nullcontext(None)`` for a
    dense model / zero coefficients. N = ``global_token_count`` (required with DP > 1); grad_scale =
    DP x CP when megatron averages gradients over DP x CP (``calculate_per_token_loss=False``),
    K = ``global_token_count`` when it divides them by the reduced token count (per-token mode)."""
    cfg = engine.tf_config
    coeffs = getattr(cfg, "router_loss", None)
    if cfg.num_moe_experts is None or coeffs is None or not coeffs.enabled:
        return contextlib.nullcontext(None)
    if cfg.recompute_granularity is not None:
        raise ValueError(
            "MoE router losses (moe_aux_loss_coeff / moe_z_loss_coeff > 0) with activation recompute "
            "(enable_gradient_checkpointing / recompute_granularity) are not built: the recomputed router forward "
            "would see another micro-batch's token map; turn one of them off"
        )
    if global_token_count is None:
        if engine.dp != 1:
            raise ValueError(
                "MoE router losses (moe_aux_loss_coeff / moe_z_loss_coeff > 0) with data parallelism need "
                "train_step(..., global_token_count=<sum of sequence lengths over the whole mini-batch>)"
            )
        global_token_count = sum(local_lengths)
    n = int(global_token_count)
    grad_scale = n if cfg.calculate_per_token_loss else engine.dp * engine.cp
    return router_loss_step(n, grad_scale, bool(cfg.sequence_parallel))


def start_micro_batch(router_step, packed) -> None:
    """Before a micro-batch's forward (every stage): tell the routers which sequence each token is."""
    if router_step is not None:
        router_step.micro_batch(
            local_sequence_ids(packed.lengths, packed.padded_lengths, packed.real_mask, packed.cp_size),
            packed.lengths,
        )


def router_metrics(engine, router_step) -> dict[str, float]:
    """Router-loss metrics after the step (collective over the whole world, every rank gets them)."""
    if router_step is None:
        return {}
    return router_step.metrics(None, int(engine.tf_config.num_layers), engine.tf_config.router_loss)
