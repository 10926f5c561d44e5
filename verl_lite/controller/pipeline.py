"""The rollout/training pipeline of split placement (verl's one-step-off schedule; docs/async.md, "One-step-off"): a
bounded queue of rollout batches, each tagged with the policy version that sampled it. One generation thread samples
batch b with version ``v(b) = max(0, b - k)``, k = ``async_training.staleness_threshold``, in order, at most k + 1
batches ahead. Every wait is bounded; a failure in the generation thread is re-raised on the trainer's thread at its
next ``next()``::

    pipe.start(); item = pipe.next(step_index); pipe.publish(step_index + 1, weights); pipe.close()
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from verl_lite.errors import RunFailure
from verl_lite.protocol import Batch


class PipelineError(RunFailure):
    """The rollout pipeline of split placement failed (a rollout worker, a weight sync, a starving queue)."""


STARVING_FIX = ("raise async_training.queue_timeout_s, or give the rollout pool more workers "
                "(actor_rollout_ref.rollout.n_gpus_per_node)")
WORKER_FAILED_FIX = "see the worker's traceback above; the run's workers were stopped"


@dataclass
class RolloutItem:
    index: int  # the RL step (0-based) this batch trains at
    rows: list  # its prompt rows
    version: int  # the policy version that sampled it
    batch: Any = None  # the generated rollout (verl_lite.protocol.Batch)
    generate_s: float = 0.0
    metrics: dict = field(default_factory=dict)

    def to_state(self) -> dict:
        """Plain containers, tensors and scalars only: a checkpoint reads it with ``torch.load(weights_only=True)``."""
        batch = None if self.batch is None else {"tensors": dict(self.batch.tensors.items()),
                                                 "non_tensors": dict(self.batch.non_tensors)}
        return {"index": self.index, "rows": self.rows, "version": self.version, "batch": batch,
                "generate_s": self.generate_s, "metrics": dict(self.metrics)}

    @classmethod
    def from_state(cls, state: dict) -> "RolloutItem":
        batch = state["batch"]
        if batch is not None:
            batch = Batch.from_dict(batch["tensors"], batch["non_tensors"])
        return cls(state["index"], state["rows"], state["version"], batch, state["generate_s"], state["metrics"])


class RolloutPipeline:
    """``generate(rows, index) -> Batch`` on the rollout pool; ``load(weights, version)`` into every rollout worker;
    ``next_rows()`` (trainer's thread): the next batch's prompt rows. A resumed run starts at ``first_index`` with
    ``ready`` (the batches it saved); ``end_index``: no batch past it; ``loaded_version``: the workers' now (None:
    unknown)."""

    def __init__(self, generate: Callable[[list, int], Any], load: Callable[[Any, int], None],
                 next_rows: Callable[[], list], staleness: int, queue_timeout_s: float, first_index: int = 0,
                 end_index: int | None = None, loaded_version: int | None = 0, ready: list[RolloutItem] = ()):
        if staleness < 0:
            raise ValueError(f"staleness must be >= 0, got {staleness}")
        self.generate_fn, self.load_fn, self.next_rows = generate, load, next_rows
        self.staleness, self.queue_timeout_s = staleness, queue_timeout_s
        self._ready = list(ready)  # generated, not yet handed out (in order)
        self._queue: queue.Queue = queue.Queue(maxsize=staleness + 1)
        self._rows: dict[int, list] = {}
        self._published: dict[int, Any] = {}
        self._loaded = loaded_version
        self._next_submit = self._next_generate = first_index + len(self._ready)
        self._handed = first_index  # the next step to hand a batch to
        self._end = end_index
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rollout-pipeline", daemon=True)
        self._busy_since: float | None = None  # when the thread's current load/generation began
        self._busy_with = ""

    def start(self) -> None:
        self._thread.start()

    def _top_up(self, index: int) -> None:
        """Hand the thread the rows of every batch up to ``index + staleness`` (the pipeline's depth)."""
        last = index + self.staleness if self._end is None else min(index + self.staleness, self._end - 1)
        while self._next_submit <= last:
            rows = self.next_rows()
            with self._cond:
                self._rows[self._next_submit] = rows
                self._next_submit += 1
                self._cond.notify_all()

    def next(self, index: int) -> RolloutItem:
        """The batch RL step ``index`` (0-based) trains on; :class:`PipelineError` when the generation thread failed
        or no batch came within ``queue_timeout_s``."""
        self._top_up(index)
        item = self._ready.pop(0) if self._ready else self._get(index)
        self._handed = index + 1
        if item.index != index:
            raise PipelineError(f"the rollout pipeline handed out batch {item.index} for step {index + 1}",
                                "this is a bug in verl_lite.controller.pipeline")
        lag = index - item.version
        if not 0 <= lag <= self.staleness:  # the schedule guarantees it; never train on a batch past the bound
            raise PipelineError(f"step {index + 1}: the rollout batch was sampled by policy version {item.version}, "
                                f"{lag} versions old, past async_training.staleness_threshold={self.staleness}",
                                "this is a bug in verl_lite.controller.pipeline")
        item.metrics.update({"async/staleness": lag, "async/policy_version": item.version,
                             "async/queue_size": self._queue.qsize() + len(self._ready)})
        return item

    def _get(self, index: int) -> RolloutItem:
        t0 = time.monotonic()
        try:
            item = self._queue.get(timeout=self.queue_timeout_s)
        except queue.Empty:
            busy = "" if self._busy_since is None else (f"; the rollout pool has been busy with {self._busy_with} "
                                                        f"for {time.monotonic() - self._busy_since:.0f}s")
            raise PipelineError(
                f"step {index + 1}: no rollout batch arrived within async_training.queue_timeout_s="
                f"{self.queue_timeout_s:g}s (the queue starved{busy})", STARVING_FIX) from None
        if isinstance(item, BaseException):
            raise item
        item.metrics["timing_s/wait_rollout"] = time.monotonic() - t0
        return item

    def publish(self, version: int, weights: Any) -> None:
        """The policy of ``version`` (after ``version`` RL steps), for the batches that need it."""
        with self._cond:
            self._published[version] = weights
            self._cond.notify_all()

    def in_flight(self) -> list[RolloutItem]:
        """Every batch handed to the thread and not yet to the trainer, generated (bounded waits); they stay in the
        pipeline, in order (a checkpoint saves them)."""
        while self._handed + len(self._ready) < self._next_submit:
            self._ready.append(self._get(self._handed + len(self._ready)))
        return list(self._ready)

    def close(self) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        with contextlib.suppress(queue.Empty):  # unblock a thread waiting to put into a full queue
            while True:
                self._queue.get_nowait()

    def _wait_for(self, ready: Callable[[], bool]) -> bool:
        with self._cond:
            while not ready():
                if self._stop.is_set():
                    return False
                self._cond.wait(timeout=1.0)
            return not self._stop.is_set()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                b = self._next_generate
                need = max(0, b - self.staleness)  # v(b) of the module docstring
                if not self._wait_for(lambda: b in self._rows and (self._loaded == need or need in self._published)):
                    return
                if self._loaded != need:
                    with self._cond:
                        weights = self._published[need]
                    self._busy_since, self._busy_with = time.monotonic(), f"loading policy version {need}"
                    self.load_fn(weights, need)
                    self._loaded = need
                with self._cond:  # versions no later batch needs
                    for v in [v for v in self._published if v <= need]:
                        del self._published[v]
                    rows = self._rows.pop(b)
                self._busy_since, self._busy_with = time.monotonic(), f"generating batch {b + 1}"
                batch = self.generate_fn(rows, b)
                item = RolloutItem(b, rows, need, batch, time.monotonic() - self._busy_since)
                item.metrics["timing_s/generate_async"] = item.generate_s
                self._busy_since = None
                with self._cond:
                    self._next_generate = b + 1
                self._hand_over(item)
        except BaseException as err:  # noqa: BLE001 - handed to the trainer's thread
            if self._stop.is_set():
                return
            if not isinstance(err, RunFailure):
                err = PipelineError(f"the rollout pool failed while {self._busy_with or 'idle'}: {err}",
                                    WORKER_FAILED_FIX)
            self._hand_over(err)

    def _hand_over(self, item) -> None:
        """Put a batch (or the thread's error) in the bounded queue, waiting while it is full until ``close``."""
        while not self._stop.is_set():
            with contextlib.suppress(queue.Full):
                self._queue.put(item, timeout=1.0)
                return
