"""The single controller's own cost per RL step at 2, 4, 8 and 16 workers (issue 24).

Stub workers (``verl_lite.controller.Worker`` subclasses that compute nothing) on a local Ray with
fractional CPUs, driven through the real ``RoleGroup`` path, with the default job's batch
(``data.train_batch_size`` x ``rollout.n`` trajectories, ``data.max_response_length`` tokens) and
the shipped tiny model's weights. Per step the driver makes the default job's calls:

- dispatch + collect: ``generate`` (prompt ids out, per-sample token ids and log-prob lists back) and
  ``train("update_actor")`` (one optimizer step per mini-batch), split per DP rank by the planner,
  results gathered in row order. The weight sync of a colocated step sends nothing: each actor worker
  loads its rollout from its actor before it next samples (``ActorRolloutRefWorker._catch_up_rollout``);
- reported beside it, not in a default-job step: ``infer("compute_log_prob")`` (log-probs back per
  row; PPO and multi-mini-batch jobs run it), and a weight broadcast (the policy's state dict handed to
  every worker through the object store, ``WorkerGroup.broadcast``: what a rollout in other processes
  would add).

Ray's own floor is measured in the same run: the same number of bare Ray actors (no verl_lite code),
two empty fan-outs (call every actor, get every result), as the default job's step makes two.

The default job's step is measured in the same run too: the shipped default job (one worker) for a
few steps through the CLI, median ``timing_s/step`` after the first (``--step-s`` gives one instead).

Printed per worker count (median of ``--steps`` steps after one warm-up): wall ms of each part, the
default-job overhead and its share of a default-job step, Ray's floor and its share, the driver's own
CPU ms per step (``time.process_time``: the driver process's threads, Ray's included; the workers' CPU
is not in it), and the bytes through the object store (Ray keeps arguments and results over 100 KiB
there; pieces below that travel inside the call). On a machine with fewer cores than workers the wall
figures include waiting for the workers to be scheduled; the driver CPU column does not.

    python bench/controller_scale.py [--workers 2 4 8 16] [--steps 5] [--step-s S] [--profile]
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


def ray_floor(world: int, steps: int, fan_outs: int = 2) -> float:
    """Median wall s of ``fan_outs`` empty fan-outs to ``world`` bare Ray actors (no verl_lite code): Ray's
    own cost for the calls a default-job step makes, on this machine, at this worker count."""
    import ray

    @ray.remote(num_cpus=0.01)
    class Bare:
        def call(self):
            return 0

    actors = [Bare.remote() for _ in range(world)]
    try:
        ray.get([a.call.remote() for a in actors])
        walls = []
        for _ in range(steps):
            walls.append(_timed(lambda: [ray.get([a.call.remote() for a in actors]) for _ in range(fan_outs)])[0])
        return statistics.median(walls)
    finally:
        for a in actors:
            ray.kill(a)


def bench(world: int, steps: int, batch, state: dict, mini_batches: int, response_len: int, loss_cfg,
          profile: bool) -> dict:
    from verl_lite.algorithms.aggregation import NormalizationPlan
    from verl_lite.controller import MicroBatching, ResourcePool, RoleGroup, start_roles
    from verl_lite.controller.role_group import split_contiguous

    pool = ResourcePool(world)
    role = RoleGroup("actor", stub_worker_cls(), world, response_len, pool, timeout_s=600)
    start_roles(role)
    sizing = MicroBatching(micro_batch_size=64)
    minis = [(mini, NormalizationPlan.from_mask(mini["response_mask"], "token-mean"))
             for mini in (batch.select(list(rg)) for rg in split_contiguous(len(batch), mini_batches))]
    prompts = [list(p) for p in batch["prompt_ids"][:: 8]]
    sampling = {"n": len(batch) // len(prompts), "do_sample": True, "temperature": 1.0}
    seeds = list(range(len(prompts)))

    def default_step():  # generate, then update (the colocated weight sync makes no call)
        role.generate(prompts, seeds, sampling)
        role.train("update_actor", minis, sizing, loss_cfg, 1.0)

    def infer():
        role.infer("compute_log_prob", batch, sizing, 1.0)

    def send_weights():
        role.group.broadcast("load_weights", state)

    rows = {"step": [], "infer": [], "bcast": [], "cpu": []}
    prof = None
    try:
        for step in range(steps + 1):  # the first step warms up
            if profile and step == 1:
                import cProfile

                prof = cProfile.Profile()
                prof.enable()
            wall, cpu = _timed(default_step)
            inf, _ = _timed(infer)
            bc, _ = _timed(send_weights)
            if step:
                rows["step"].append(wall)
                rows["cpu"].append(cpu)
                rows["infer"].append(inf)
                rows["bcast"].append(bc)
        if prof is not None:
            prof.disable()
            import pstats

            print(f"--- driver profile, {world} workers, {steps} steps (cumulative) ---")
            pstats.Stats(prof).sort_stats("cumulative").print_stats(25)
    finally:
        role.shutdown()
        pool.remove()
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {"workers": world, **med, "floor": ray_floor(world, steps),
            "object_store_bytes": object_store_bytes(batch, state, world, mini_batches)}


def default_job_step_s(steps: int = 8) -> float:
    """The shipped default job's step (s): run it through the CLI for ``steps`` steps (no validation, no
    checkpoint), median ``timing_s/step`` of the steps after the first."""
    import json
    import os
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory(prefix="controller_scale_") as out:
        cmd = [sys.executable, "-m", "verl_lite.trainer.main_ppo", f"trainer.total_training_steps={steps}",
               "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.save_freq=-1",
               f"trainer.default_local_dir={out}/ckpt", f"trainer.output_dir={out}/out"]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       env=dict(os.environ, RAY_ADDRESS=""))
        (metrics,) = [os.path.join(d, f) for d, _, fs in os.walk(out) for f in fs if f == "metrics.jsonl"]
        with open(metrics) as fh:
            records = [json.loads(line) for line in fh if line.strip()]
    return statistics.median(r["timing_s/step"] for r in records[1:])


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
    ap.add_argument("--step-s", type=float, default=None,
                    help="a default-job step (s) for the share; default: measured here through the CLI")
    ap.add_argument("--profile", action="store_true", help="cProfile the driver at each worker count")
    args = ap.parse_args()
    import os

    from verl_lite.config.schema import PPOConfig
    from verl_lite.controller import start_ray, stop_ray
    
    step_s = args.step_s if args.step_s is not None else default_job_step_s()
    cfg = PPOConfig()
    loss_cfg = cfg.actor_rollout_ref.actor
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
    print(f"batch: {len(batch)} trajectories x {resp} tokens, {minis} mini-batch(es); weights "
          f"{sum(t.numel() * t.element_size() for t in state.values()) / 1e6:.2f} MB; {os.cpu_count()} cores, "
          f"1-min load {os.getloadavg()[0]:.2f}; default-job step {step_s:.3f} s "
          f"({'given' if args.step_s is not None else 'measured'})")
    print(f"{'workers':>7} {'default-job overhead':>20} {'share':>6} {'Ray floor':>9} {'share':>6} {'driver CPU':>10} "
          f"{'+infer':>7} {'broadcast':>9} {'object store MB/step':>20}   (ms)")
    for r in rows:
        print(f"{r['workers']:>7} {1e3 * r['step']:>20.1f} {100 * r['step'] / step_s:>5.0f}% {1e3 * r['floor']:>9.1f} "
              f"{100 * r['floor'] / step_s:>5.0f}% {1e3 * r['cpu']:>10.1f} {1e3 * r['infer']:>7.1f} "
              f"{1e3 * r['bcast']:>9.1f} {r['object_store_bytes']['step'] / 1e6:>20.2f}")
    last = rows[-1]
    print(f"overhead at {last['workers']} workers: {1e3 * last['step']:.1f} ms = {100 * last['step'] / step_s:.0f}% of a "
          f"{step_s:.3f} s default-job step (driver CPU {1e3 * last['cpu']:.1f} ms); Ray's own floor for the "
          f"step's two fan-outs {1e3 * last['floor']:.1f} ms = {100 * last['floor'] / step_s:.0f}%; a weight broadcast "
          f"to {last['workers']} workers (not in a default-job step) {1e3 * last['bcast']:.1f} ms")


if __name__ == "__main__":
    main()
