"""A rollout worker's trajectory stream: agent loops that run continuously, fed prompt groups, drained of
finished trajectories, while new policy versions are loaded beside them (partial rollouts: ``VersionedRollout``).

    stream = TrajectoryStream(runner, sampling)      # runner: an AgentRunner over a VersionedRollout
    stream.submit([{"group": 7, "row": row, "seed": 123, "n": 8}, ...])   # returns at once
    stream.collect(wait_s) -> [{"group": 7, "sample": k, **trajectory.output()}, ...]   # what finished since
    runner.rollout.load(weights, version)             # from another thread: cuts the running call short
    stream.close()

The loops run in an asyncio event loop on a thread of their own, so the worker keeps answering calls. Each model
segment is tagged with the policy version that generated it (``segment_versions``), so a trajectory that straddles
a load has each segment's behaviour log-probs. A trajectory that raises is raised by the next ``collect``.
"""

from __future__ import annotations

import asyncio
import threading

from verl_lite.agent.loop import AgentRunner, split_sampling

CLOSE_TIMEOUT_S = 30.0  # bound on joining the loop's thread at close


class TrajectoryStream:
    def __init__(self, runner: AgentRunner, sampling: dict):
        self.runner = runner
        self.n_default, self.sampling = split_sampling(sampling)
        self.finished: list[dict] = []
        self.errors: list[BaseException] = []
        self.lock = threading.Lock()
        self.done = threading.Condition(self.lock)  # notified as a trajectory finishes or fails
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="trajectory-stream", daemon=True)
        self.thread.start()
        self.batcher = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result()

    async def _start(self):
        await self.runner.executor.warm()
        batcher = self.runner.batcher(self.sampling)
        self.server = asyncio.ensure_future(batcher.serve(forever=True))
        return batcher

    def submit(self, jobs: list[dict]) -> None:
        """Start every trajectory of each job ``{"group", "row", "seed", "n"}`` (returns at once)."""
        for job in jobs:
            self.loop.call_soon_threadsafe(self._launch, job)

    def _launch(self, job: dict) -> None:
        n = int(job.get("n", self.n_default))
        self.batcher.started(n)
        for sample in range(n):
            asyncio.ensure_future(self._one(job, sample))

    async def _one(self, job: dict, sample: int) -> None:
        try:
            traj = await self.runner.run_one(job["row"], job["seed"], sample, self.batcher)
            out = {"group": job["group"], "sample": sample, **traj.output()}
        except BaseException as err:  # noqa: BLE001 - reported by the next collect
            with self.done:
                self.errors.append(err)
                self.done.notify_all()
            return
        with self.done:
            self.finished.append(out)
            self.done.notify_all()

    def collect(self, wait_s: float = 0.0) -> list[dict]:
        """Every trajectory finished since the last call, waiting up to ``wait_s`` for one when none has (raises
        the first trajectory's error, if any)."""
        with self.done:
            self.done.wait_for(lambda: self.finished or self.errors, timeout=wait_s)
            if self.errors:
                raise self.errors[0]
            out, self.finished = self.finished, []
        return out

    def live(self) -> int:
        """Trajectories started and not finished."""
        return self.batcher.live

    def close(self) -> None:
        """Stop the loop and its thread (the trajectories still running are dropped)."""
        if not self.loop.is_running():
            return

        def stop():
            for task in asyncio.all_tasks(self.loop):
                task.cancel()
            self.loop.stop()

        self.loop.call_soon_threadsafe(stop)
        self.thread.join(CLOSE_TIMEOUT_S)
        self.batcher.close()
        self.runner.executor.close()
