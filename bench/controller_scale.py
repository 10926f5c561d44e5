"""The single controller's own cost per RL step at 2, 4, 8 and 16 workers (issue 24).

Stub workers (``verl_lite.controller.Worker`` subclasses that compute nothing) on a local Ray with
fractional CPUs, driven through the real ``RoleGroup`` path, with the default job's batch
(``data.train_batch_size`` x ``rollout.n`` trajectories, ``data.max_response_length`` tokens) and
the shipped tiny model's weights. Per step the driver makes the default job's calls, and more:

- dispatch + collect: ``generate`` (prompt ids out, per-sample token ids and log-prob lists back),
  ``infer("compute_log_prob")`` (log-probs back per row; the default job skips this pass: its old
  log-probs come from the update's forward, PPO and multi-mini-batch jobs run it) and
  ``train("update_actor")`` (one optimizer step per mini-batch), split per DP rank by the planner,
  results gathered in row order;
- weight sync: the default job's ``sync_rollout_weights`` (the rollout lives in the actor's
  process: one call per worker, no payload);
- broadcast (NOT in a default-job step; the cost a rollout in other processes would add): the
  policy's state dict handed to every worker through the object store (``WorkerGroup.broadcast``).

Printed per worker count (median of ``--steps`` steps after one warm-up): wall ms of each part,
the default-job overhead (dispatch + collect + weight sync) and its share of a default-job step
(``--step-s``, README: 0.16 s at 1 worker), the driver's own CPU ms per step (``time.process_time``:
the driver process's threads, Ray's included; the workers' CPU is not in it), and the bytes
through the object store (Ray keeps arguments and results over 100 KiB there; pieces below that
travel inside the call). On a machine with fewer cores than workers the wall figures include
waiting for the workers to be scheduled; the driver CPU column does not.

    python bench/controller_scale.py [--workers 2 4 8 16] [--steps 5] [--step-s 0.16] [--profile]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

OBJECT_STORE_MIN_BYTES = 100 * 1024  # Ray's max_direct_call_object_size: larger values go through the object store


def make_batch(prompts: int, n: int, response_len: int, prompt_len: int = 24):
    from verl_lite.protocol import Batch

    rows = prompts * n
    return Batch.from_dict(
        {"responses": torch.zeros(rows, response_len, dtype=torch.long),
         "response_mask": torch.ones(rows, response_len, dtype=torch.long),
         "old_log_probs": torch.zeros(rows, response_len), "advantages": torch.zeros(rows, response_len)},
        {"prompt_ids": [[1] * prompt_len for _ in range(rows)]})


def stub_worker_cls():
    from verl_lite.controller import Worker

    class StubWorker(Worker):
        """Receives what the real workers receive and answers with results of the real shapes."""

        def __init__(self, rank, world_size, cfg=None):
            super().__init__(rank, world_size)
            self.response_len = cfg

        def init_model(self):
            return None

        def generate(self, prompt_ids, seeds, sampling):
            k = self.response_len
            return [{"response_ids": [2] * k, "log_probs": [0.0] * k} for _ in prompt_ids for _ in range(sampling["n"])]

        def compute_log_prob(self, piece, micro_batches, *args):
            return {"log_probs": torch.zeros(len(piece), piece["response_mask"].shape[1])}

        def update_actor(self, jobs, *args):
            return [{"loss": 0.0, "grad_norm": 0.0} for _ in jobs]

        def sync_rollout_weights(self):
            return 0

        def load_weights(self, state):
            return sum(t.numel() for t in state.values())

    return StubWorker


def policy_state_dict() -> dict:
    import glob

    from safetensors.torch import load_file

    from verl_lite.config import default_model_path

    state = {}
    for f in glob.glob(f"{default_model_path()}/*.safetensors"):
        state.update(load_file(f))
    return state


def _timed(fn) -> tuple[float, float]:
    """(wall s, driver CPU s) of ``fn()``."""
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w0, time.process_time() - c0


def bench(world: int, steps: int, batch, state: dict, mini_batches: int, response_len: int, loss_cfg,
          profile: bool) -> dict:
    import ray

    from verl_lite.algorithms.aggregation import NormalizationPlan
    from verl_lite.controller import MicroBatching, ResourcePool, RoleGroup
    from verl_lite.controller.role_group import split_contiguous

    pool = ResourcePool(world)
    role = RoleGroup("actor", stub_worker_cls(), world, response_len, pool, timeout_s=600)
    sizing = MicroBatching(micro_batch_size=64)
    minis = [(mini, NormalizationPlan.from_mask(mini["response_mask"], "token-mean"))
             for mini in (batch.select(list(rg)) for rg in split_contiguous(len(batch), mini_batches))]
    prompts = [list(p) for p in batch["prompt_ids"][:: 8]]
    sampling = {"n": len(batch) // len(prompts), "do_sample": True, "temperature": 1.0}
    seeds = list(range(len(prompts)))
    broadcast = getattr(role.group, "broadcast", None)

    def dispatch_collect():
        role.generate(prompts, seeds, sampling)
        role.infer("compute_log_prob", batch, sizing, 1.0)
        role.train("update_actor", minis, sizing, loss_cfg, 1.0)

    def sync():
        role.call_all("sync_rollout_weights")

    def send_weights():
        if broadcast is not None:
            broadcast("load_weights", state)
        else:  # the controller before WorkerGroup.broadcast: one put, the ref to every worker
            role.call_all("load_weights", ray.put(state))

    rows = {"dc": [], "sync": [], "bcast": [], "cpu": []}
    prof = None
    try:
        for step in range(steps + 1):  # the first step warms up
            if profile and step == 1:
                import cProfile

                prof = cProfile.Profile()
                prof.enable()
            (dc, dc_cpu), (sy, sy_cpu) = _timed(dispatch_collect), _timed(sync)
            bc, _ = _timed(send_weights)
            if step:
                rows["dc"].append(dc)
                rows["sync"].append(sy)
                rows["bcast"].append(bc)
                rows["cpu"].append(dc_cpu + sy_cpu)
        if prof is not None:
            prof.disable()
            import pstats

            print(f"--- driver profile, {world} workers, {steps} steps (cumulative) ---")
            pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    finally:
        role.shutdown()
        pool.remove()
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {"workers": world, **med, "object_store_bytes": object_store_bytes(batch, state, world, mini_batches)}


def object_store_bytes(batch, state: dict, world: int, mini_batches: int) -> dict:
    """Bytes a default-job step and a broadcast put through the object store: values over Ray's inline limit."""
    import pickle

    def stored(obj) -> int:
        size = len(pickle.dumps(obj, protocol=5))
        return size if size > OBJECT_STORE_MIN_BYTES else 0

    piece = batch.select(list(range(len(batch) // world)))
    per_step = 2 * world * stored(piece)  # infer + train pieces (each DP rank its own)
    return {"step": per_step, "broadcast": sum(t.numel() * t.element_size() for t in state.values())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--step-s", type=float, default=0.16, help="a default-job step (s), for the share")
    ap.add_argument("--profile", action="store_true", help="cProfile the driver at each worker count")
    args = ap.parse_args()
    from verl_lite.config.schema import PPOConfig
    from verl_lite.controller import start_ray, stop_ray
    from verl_lite.workers.from_config import actor_loss_config

    cfg = PPOConfig()
    loss_cfg = actor_loss_config(cfg.actor_rollout_ref.actor)
    resp = cfg.data.max_response_length
    batch = make_batch(cfg.data.train_batch_size, cfg.actor_rollout_ref.rollout.n, resp)
    minis = max(1, cfg.data.train_batch_size // cfg.actor_rollout_ref.actor.ppo_mini_batch_size)
    state = policy_state_dict()
    start_ray()
    rows = []
    try:
        for w in args.workers:
            rows.append(bench(w, args.steps, batch, state, minis, resp, loss_cfg, args.profile))
    finally:
        stop_ray()
    import os

    print(f"batch: {len(batch)} trajectories x {resp} tokens, {minis} mini-batch(es); weights "
          f"{sum(t.numel() * t.element_size() for t in state.values()) / 1e6:.2f} MB; {os.cpu_count()} cores, "
          f"1-min load {os.getloadavg()[0]:.2f}")
    print(f"{'workers':>7} {'dispatch+collect':>16} {'weight sync':>11} {'default-job total':>17} {'share':>6} "
          f"{'driver CPU':>10} {'broadcast':>9} {'object store MB/step':>20}   (ms)")
    for r in rows:
        total = r["dc"] + r["sync"]
        print(f"{r['workers']:>7} {1e3 * r['dc']:>16.1f} {1e3 * r['sync']:>11.1f} {1e3 * total:>17.1f} "
              f"{100 * total / args.step_s:>5.0f}% {1e3 * r['cpu']:>10.1f} {1e3 * r['bcast']:>9.1f} "
              f"{r['object_store_bytes']['step'] / 1e6:>20.2f}")
    last = rows[-1]
    total = last["dc"] + last["sync"]
    print(f"overhead at {last['workers']} workers: {1e3 * total:.1f} ms = {100 * total / args.step_s:.0f}% of a "
          f"{args.step_s:.2f} s default-job step (driver CPU {1e3 * last['cpu']:.1f} ms); a weight broadcast to "
          f"{last['workers']} workers (not in a default-job step) {1e3 * last['bcast']:.1f} ms")


if __name__ == "__main__":
    main()
