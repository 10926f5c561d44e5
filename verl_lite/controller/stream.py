"""verl's streamed modes (``separate_async`` on the rollout pool, ``colocate_async`` on the actor's workers): prompt
groups stream through the workers' trajectory streams (``verl_lite.agent.stream``); step s (1-based) trains version
s - 1 on the oldest complete groups whose age ``s - submit_step + 1`` is at most ``max_off_policy_threshold``, then
publishes version s (verl's v1 sampler: the outstanding groups, ``drop`` and ``wait``: docs/async.md, "Streaming").
Every wait is bounded.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from verl_lite.controller.pipeline import STARVING_FIX, WORKER_FAILED_FIX, PipelineError
from verl_lite.controller.worker_group import WorkerError, WorkerTimeout

POLL_S = 0.05  # how long a rollout worker holds the driver's ask for finished trajectories when none has finished


@dataclass
class Group:
    gid: int
    row: dict
    submit_step: int  # 1-based: the step during which it was submitted
    samples: dict = field(default_factory=dict)  # sample index -> the trajectory's output


def _age(group: Group, step: int) -> int:
    return step - group.submit_step + 1


class StreamingPipeline:
    def __init__(self, role, next_rows: Callable[[], list[dict]], n: int, batch_groups: int, warmup_batches: int,
                 threshold: int, strategy: str, seed_of: Callable[[int], int], queue_timeout_s: float,
                 load: Callable[[Any, int], None], resubmit: list[dict] = (), first_gid: int = 0):
        self.role, self.next_rows, self.n, self.batch_groups = role, next_rows, n, batch_groups
        self.capacity = (1 + warmup_batches) * batch_groups
        self.threshold, self.strategy, self.seed_of = threshold, strategy, seed_of
        self.queue_timeout_s, self.load_fn = queue_timeout_s, load
        self.pending_rows: list[dict] = list(resubmit)  # pulled from the data, not yet submitted (in order)
        self.groups: dict[int, Group] = {}  # outstanding, by gid (submission order)
        self.next_gid = first_gid
        self.load = [0] * role.world_size  # outstanding trajectories per worker
        self.evicted = 0

    def next(self, index: int, count: int | None = None) -> tuple[list[dict], list[dict], dict]:
        """(rows, ``n`` samples each prompt-major, the wait's metrics) of ``count`` (default ``batch_groups``)
        complete groups for step ``index + 1``, within ``queue_timeout_s``."""
        step, count = index + 1, count or self.batch_groups
        started = time.monotonic()
        while True:
            self._submit(step)
            self._collect(step, started, count)
            chosen, stale = self._choose(step, count)
            if self.strategy == "drop":
                for group in stale:
                    del self.groups[group.gid]
                self.evicted += len(stale)
            if len(chosen) == count and not self._must_wait(step):
                break
            if time.monotonic() - started > self.queue_timeout_s:
                raise self._starving(step, count)
        for group in chosen:
            del self.groups[group.gid]
        rows = [g.row for g in chosen]
        outputs = [g.samples[k] for g in chosen for k in range(self.n)]
        metrics = {"timing_s/wait_rollout": time.monotonic() - started, "async/queue_size": len(self.groups),
                   "training/off_policy/evicted_samples": self.evicted}
        self.evicted = 0
        return rows, outputs, metrics

    def publish(self, version: int, weights: Any) -> None:
        """Policy ``version`` into every rollout worker (each loads it once its running backend call returns)."""
        self.load_fn(weights, version)

    def outstanding_rows(self) -> list[dict]:
        """The prompt rows pulled from the data and not yet trained, in submission order (a checkpoint saves them;
        a resumed run submits them again first)."""
        return [g.row for g in sorted(self.groups.values(), key=lambda g: g.gid)] + list(self.pending_rows)

    def _choose(self, step: int, count: int) -> tuple[list[Group], list[Group]]:
        """(the first ``count`` complete groups within the bound, oldest first; the complete ones past it)."""
        complete = sorted((g for g in self.groups.values() if len(g.samples) == self.n),
                          key=lambda g: (g.submit_step, g.gid))
        stale = [g for g in complete if _age(g, step) > self.threshold]
        fresh = [g for g in complete if _age(g, step) <= self.threshold]
        return fresh[:count], stale

    def _must_wait(self, step: int) -> bool:
        """``wait``: an outstanding group still generating has reached the bound (no new prompt meanwhile)."""
        return self.strategy == "wait" and any(
            len(g.samples) < self.n and _age(g, step) >= self.threshold for g in self.groups.values())

    def _submit(self, step: int) -> None:
        jobs: list[list[dict]] = [[] for _ in range(self.role.world_size)]
        while len(self.groups) < self.capacity and not self._must_wait(step):
            if not self.pending_rows:
                self.pending_rows = list(self.next_rows())
            row = self.pending_rows.pop(0)
            worker = min(range(len(self.load)), key=lambda w: self.load[w])
            group = Group(self.next_gid, row, step)
            self.groups[group.gid] = group
            self.next_gid += 1
            self.load[worker] += self.n
            jobs[worker].append({"group": group.gid, "row": row, "seed": self.seed_of(group.gid), "n": self.n})
        if any(jobs):
            try:
                self.role.group.call_per_rank("stream_submit", [[j] for j in jobs])
            except WorkerError as err:
                raise self._failed(err) from err

    def _failed(self, err: WorkerError) -> PipelineError:
        return PipelineError(f"the {self.role.name} workers' trajectory streams failed: {err}", WORKER_FAILED_FIX)

    def _starving(self, step: int, count: int, why: str = "") -> PipelineError:
        complete = sum(len(g.samples) == self.n for g in self.groups.values())
        return PipelineError(
            f"step {step}: {complete} of the {count} prompt groups it needs were complete after "
            f"async_training.queue_timeout_s={self.queue_timeout_s:g}s ({len(self.groups)} outstanding{why})",
            STARVING_FIX if self.role.name == "rollout" else "raise async_training.queue_timeout_s")

    def _collect(self, step: int, started: float, count: int) -> None:
        """Every worker's finished trajectories; a worker silent past the step's ``queue_timeout_s`` is starving."""
        left = max(1.0, self.queue_timeout_s - (time.monotonic() - started))
        try:
            answers = self.role.call_all("stream_collect", POLL_S, timeout_s=left)
        except WorkerTimeout:
            raise self._starving(step, count, f"; a {self.role.name} worker stopped answering") from None
        except WorkerError as err:
            raise self._failed(err) from err
        for worker, finished in enumerate(answers):
            for out in finished:
                self.load[worker] -= 1
                group = self.groups.get(out["group"])
                if group is not None:  # an evicted group's late samples are dropped
                    group.samples[out["sample"]] = out


def off_policy_metrics(segment_versions: list[list[int]], step: int) -> dict[str, float]:
    """verl's ``training/off_policy/*`` over a step's trajectories (``segment_versions``: each one's model turns'
    versions; step s trains version s - 1): ``trajectory_staleness`` = (s - 1) - the newest version used,
    ``trajectory_staleness_worst`` = (s - 1) - the oldest, ``trajectory_spans`` = newest - oldest + 1."""
    current = step - 1
    used = [[v for v in versions if v is not None] or [current] for versions in segment_versions]
    spans = {"trajectory_staleness": [current - max(v) for v in used],
             "trajectory_staleness_worst": [current - min(v) for v in used],
             "trajectory_spans": [max(v) - min(v) + 1 for v in used]}
    return {f"training/off_policy/{name}/{stat}": value for name, values in spans.items()
            for stat, value in (("mean", sum(values) / len(values)), ("max", max(values)), ("min", min(values)))}
