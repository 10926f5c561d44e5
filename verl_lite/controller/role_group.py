"""One role of the RL job (actor/rollout/ref, critic, ...) on its own workers and layout: a :class:`WorkerGroup`
whose workers form ONE torch.distributed world with the role's TP/PP/CP/DP layout. The trainer talks to roles
only through it::

    actor, critic = RoleGroup("actor", ...), RoleGroup("critic", ...)   # processes start
    start_roles(actor, critic)                        # engines built, side by side
    actor.generate(prompts, seeds, sampling)          # every rank holds a full rollout model
    actor.infer("compute_log_prob", batch, sizing)    # forward-only, rows back in batch order
    critic.train("update_critic", jobs, ...)          # one optimizer step per job, owners' results

DP-dispatched calls follow ``dispatch.py`` (pieces in wire form). Roles share one :class:`ResourcePool`,
colocated (each takes a share of a bundle) or on bundles of their own (``bundle_offset``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import ray

from verl_lite.controller.dispatch import collect_from_owners, make_layouts, per_rank_args, shard_by_plan
from verl_lite.controller.resource_pool import ResourcePool
from verl_lite.controller.wire import wire
from verl_lite.controller.worker_group import WorkerGroup
from verl_lite.protocol import Batch, response_lengths


@dataclass(frozen=True)
class MicroBatching:
    """How a DP rank's share is cut for memory (never changes the math): ``micro_batch_size`` trajectories per
    micro-batch, or (``max_tokens`` set) a token budget per micro-batch and per CP rank."""

    micro_batch_size: int | None = None
    max_tokens: int | None = None

    @classmethod
    def of(cls, use_dynamic: bool, micro_batch_size: int | None, max_tokens: int) -> "MicroBatching":
        return cls(max_tokens=max_tokens) if use_dynamic else cls(micro_batch_size=micro_batch_size)


def sequence_lengths(batch: Batch) -> list[int]:
    """prompt + response tokens of every row (what the engine packs)."""
    responses = response_lengths(batch["response_mask"]).tolist()
    return [len(p) + r for p, r in zip(batch["prompt_ids"], responses)]


def split_contiguous(n: int, parts: int) -> list[range]:
    """``n`` items into ``parts`` contiguous near-equal ranges (the first ones one longer)."""
    base, extra = divmod(n, parts)
    bounds = [part * base + min(part, extra) for part in range(parts + 1)]
    return [range(start, end) for start, end in zip(bounds, bounds[1:])]


def start_roles(*roles: "RoleGroup | None") -> None:
    """Build every role's engines and rollouts (the workers' ``init_model``) at the same time, then read each
    role's layout. Each role's wait is bounded by its group's timeout; on any failure every role is shut down."""
    roles = [r for r in roles if r is not None]
    try:
        pending = [(role, role.group.submit_all("init_model")) for role in roles]
        for role, refs in pending:
            role.group.gather(refs, "init_model")
        for role in roles:
            role._set_layout()
    except BaseException:
        for role in roles:
            role.shutdown()
        raise


class RoleGroup:
    """The workers of one role: creating it starts their processes, :func:`start_roles` builds the engines. Token
    budgets scale with ``cp``; micro-batch counts are a multiple of ``vpp_multiple`` (pp with virtual PP, else 1)."""

    def __init__(self, name: str, worker_cls: type, world_size: int, worker_cfg: Any, pool: ResourcePool,
                 timeout_s: float, cp: int = 1, vpp_multiple: int = 1, bundle_offset: int = 0, share: float = 1.0,
                 concurrent_ranks: int | None = None):
        self.name, self.world_size = name, world_size
        self.cp, self.vpp_multiple = cp, vpp_multiple
        self.group = WorkerGroup(worker_cls, world_size, init_kwargs={"cfg": worker_cfg}, pool=pool,
                                 timeout_s=timeout_s, bundle_offset=bundle_offset, share=share, name=name,
                                 concurrent_ranks=concurrent_ranks)
        self.layouts: list | None = None  # set by start_roles, once the engines are built
        self.dp: int | None = None
        self.shares_prompts = False  # whether the engines pack a shared prompt once (engine/packing.py)

    def _set_layout(self) -> None:
        reports = self.group.call_all("layout")
        self.layouts = make_layouts(reports)
        self.dp = self.layouts[0].dp_size
        self.shares_prompts = all(r.get("shares_prompts", False) for r in reports)

    def call_all(self, method: str, *args, **kwargs) -> list[Any]:
        return self.group.call_all(method, *args, **kwargs)

    def shutdown(self) -> None:
        self.group.shutdown()

    def generate(self, prompts: list, seeds: list[int] | None, sampling: dict, method: str = "generate",
                 timeout_s: float | None = None) -> list[dict]:
        """Prompts split contiguously over ALL ranks (each holds a full rollout model); ``sampling['n']`` outputs
        per prompt, prompt-major. ``method``: ``generate`` or ``generate_agent`` (agent rows); ``timeout_s``: bound."""
        ranges = split_contiguous(len(prompts), self.world_size)
        args = [([prompts[i] for i in rg], None if seeds is None else [seeds[i] for i in rg], sampling)
                for rg in ranges]
        return [o for rank_out in self.group.call_per_rank(method, args, timeout_s=timeout_s) for o in rank_out]

    def _shared(self, piece: Any) -> Any:
        """A DP piece in wire form: put in the object store once when several ranks (TP/PP/CP peers) receive it,
        else by value."""
        return ray.put(wire(piece)) if self.world_size > self.dp else wire(piece)

    def _shards(self, batch: Batch, lengths: Sequence[int], sizing: MicroBatching):
        return shard_by_plan(
            batch, lengths, self.dp,
            micro_batch_size=sizing.micro_batch_size,
            max_tokens_per_micro_batch=None if sizing.max_tokens is None else sizing.max_tokens * self.cp,
            vpp_multiple=self.vpp_multiple,
            prompts=batch["prompt_ids"] if self.shares_prompts else None,  # a prompt's samples together
        )

    def infer(self, method: str, batch: Batch, sizing: MicroBatching, *args) -> dict:
        """Forward-only ``method(piece, micro_batches, *args)`` over the batch; outputs [n, ...] in row order."""
        shards = self._shards(batch, sequence_lengths(batch), sizing)
        pieces = [(self._shared(piece), mbs, *args) for piece, mbs in zip(shards.pieces, shards.micro_batches)]
        results = self.group.call_per_rank(method, per_rank_args(pieces, self.layouts), wired_results=True)
        return shards.gather(collect_from_owners(results, self.layouts))

    def train(self, method: str, mini_batches: Sequence[tuple[Batch, Any]], sizing: MicroBatching,
              *args) -> list[list[dict]]:
        """One optimizer step per ``(mini_batch, loss_plan)``, in ONE call per rank; a job holds DP rank d's
        ``piece``, its ``micro_batches``, the ``plan`` and the mini-batch's ``global_token_count`` (megatron's
        per-token mode). Returns the owners' results ``[dp][step]``."""
        jobs_per_dp: list[list[dict]] = [[] for _ in range(self.dp)]
        for mini, plan in mini_batches:
            lengths = sequence_lengths(mini)
            shards = self._shards(mini, lengths, sizing)
            for d in range(self.dp):
                jobs_per_dp[d].append({"piece": shards.pieces[d], "micro_batches": shards.micro_batches[d],
                                       "plan": plan, "global_token_count": sum(lengths)})
        results = self.group.call_per_rank(
            method, per_rank_args([(self._shared(jobs), *args) for jobs in jobs_per_dp], self.layouts))
        return collect_from_owners(results, self.layouts)
