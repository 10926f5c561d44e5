"""The tool-agent recipe with a slow, heavy-tailed tool, several ways side by side in one run:

- ``lockstep``: synchronous, every model turn waits for every trajectory's tool call
  (``multi_turn.batch_wait_s=null``: the agent loop as it was before the barrier went);
- ``sync``: synchronous (staleness 0, colocated), no barrier across trajectories (the default agent loop);
- ``async``: ``trainer.v1.trainer_mode=separate_async``: a rollout worker of its own streaming trajectories, one
  batch of prompt groups ahead (verl's default ``num_warmup_batches=1``), each step taking the oldest complete
  groups, weights landing between model turns;
- ``async_w2``: the same, two batches ahead (``num_warmup_batches=2``);
- ``async_w2_is``: two batches ahead with token-level importance weights pi_old / pi_behaviour on the loss
  (``algorithm.rollout_correction.rollout_is=token``, as verl's asynchronous recipes set it): the trajectories
  are 1-4 policy versions old, and without a correction their update is a plain on-policy gradient;
- ``async_w2_clip``: the shipped ``--recipe async`` (``recipes/async.yaml``): ``async_w2_is`` with the behaviour
  log-probs as the old ones (``rollout_correction.bypass_mode=true, loss_type=ppo_clip``): the PPO ratio
  pi / pi_behaviour, clipped, bounds each token's step;
- ``colocate_w2_clip``: ``async_w2_clip`` on the actor's own workers (``trainer.v1.trainer_mode=colocate_async``,
  two batches ahead): no rollout worker of its own; the stream runs while the step waits and scores, and pauses
  while the actor computes.

Every side runs ``python -m verl_lite.trainer.main_ppo --recipe tool_agent`` with the recipe's calculator replaced
by ``bench/slow_tool.py``'s (each call sleeps a lognormal time: median 1 s, sigma 1, capped at 10 s) and
``--steps`` RL steps, validating before and after (the held-out set, greedy, the slow tool running). Rounds
alternate the order of the sides; round r seeds every side with ``trainer.seed=data.seed=`` ``--first-seed`` + r
(``--same-seed``: 0 in every round) so the synchronous side's own spread over seeds is the noise an asynchronous
side is judged against.
Printed per side: training wall time (the sum of the steps' ``timing_s/step``),
the whole process, steps per minute of training, held-out accuracy before and after, held-out points per minute of
training; then the ratios to ``sync`` (steps per minute also without each run's first step: an asynchronous run's
first step waits for its pipeline to fill, a cost paid once per run however long).

    .venv/bin/python bench/async_agent.py [--steps 10] [--rounds 1] [--tool-processes 64] [--sides sync,async_w2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SIDES = ("lockstep", "sync", "async", "async_w2", "async_w2_is", "async_w2_clip", "colocate_w2_clip")
SIDE_KEYS = {"lockstep": ["actor_rollout_ref.rollout.multi_turn.batch_wait_s=null"], "sync": [],
             "async": ["trainer.v1.trainer_mode=separate_async"],
             "async_w2": ["trainer.v1.trainer_mode=separate_async", "trainer.v1.separate_async.num_warmup_batches=2"],
             "async_w2_is": ["trainer.v1.trainer_mode=separate_async", "trainer.v1.separate_async.num_warmup_batches=2",
                             "algorithm.rollout_correction.rollout_is=token"],
             "async_w2_clip": ["--recipe", "async"],  # recipes/async.yaml: async_w2_is's keys and the clipped ratio
             "colocate_w2_clip": ["--recipe", "async", "trainer.v1.trainer_mode=colocate_async",
                                  "trainer.v1.colocate_async.num_warmup_batches=2"]}
TOOL_CONFIG = """tools:
- class_name: bench.slow_tool.SlowCalculator
  config: {type: native, median_s: %(median)s, sigma: %(sigma)s, cap_s: %(cap)s}
  tool_schema:
    type: function
    function:
      name: calculator
      description: Evaluate an arithmetic expression of integers with + - * and parentheses.
      parameters:
        type: object
        properties:
          expression: {type: string, description: "the expression, e.g. 3471*89"}
        required: [expression]
"""


def command(side: str, out: Path, steps: int, tool_config: Path, tool_processes: int, seed: int = 0) -> list[str]:
    return [sys.executable, "-m", "verl_lite.trainer.main_ppo", "--recipe", "tool_agent", *SIDE_KEYS[side],
            f"trainer.seed={seed}", f"data.seed={seed}",
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tool_config}",
            f"actor_rollout_ref.rollout.multi_turn.tool_processes={tool_processes}",
            f"trainer.total_training_steps={steps}", f"trainer.test_freq={steps}", "trainer.val_before_train=true",
            f"trainer.output_dir={out}", f"trainer.default_local_dir={out / 'ckpt'}", "trainer.logger=[jsonl]"]


def run_side(side: str, out: Path, a, tool_config: Path, seed: int) -> dict:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=str(REPO) + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else ""))
    started = time.perf_counter()
    proc = subprocess.run(command(side, out, a.steps, tool_config, a.tool_processes, seed), env=env,
                          capture_output=True, text=True, cwd=str(REPO))
    whole = time.perf_counter() - started
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-30:])
        raise RuntimeError(f"the {side} side failed (exit {proc.returncode}):\n{tail}")
    (run_dir,) = [path.parent for path in out.glob("*/metrics.jsonl") if not path.parent.is_symlink()]  # not latest/
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = list({r["step"]: r for r in records if r.get("step", 0) >= 1 and "timing_s/step" in r}.values())
    vals = [r for r in records if "val/accuracy" in r]
    steps.sort(key=lambda r: r["step"])
    return {"whole_s": whole, "train_s": sum(r["timing_s/step"] for r in steps), "steps": len(steps),
            "after_first_s": sum(r["timing_s/step"] for r in steps[1:]),
            "before": vals[0]["val/accuracy"], "after": vals[-1]["val/accuracy"],
            "staleness": max(r.get("training/off_policy/trajectory_staleness_worst/max", 0) for r in steps)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--tool-processes", type=int, default=64, help="multi_turn.tool_processes: concurrent tool calls")
    p.add_argument("--median", type=float, default=1.0)
    p.add_argument("--sigma", type=float, default=1.0)
    p.add_argument("--cap", type=float, default=10.0)
    p.add_argument("--sides", default=",".join(SIDES), help=f"which of {', '.join(SIDES)} (sync always runs)")
    p.add_argument("--same-seed", action="store_true", help="seed 0 in every round (default: round r uses seed r)")
    p.add_argument("--first-seed", type=int, default=0, help="the seed of the first round (the next ones count up)")
    a = p.parse_args()
    unknown = set(a.sides.split(",")) - set(SIDES)
    if unknown:
        p.error(f"--sides: {', '.join(sorted(unknown))} not among {', '.join(SIDES)}")
    sides = tuple(s for s in SIDES if s == "sync" or s in a.sides.split(","))
    root = Path(tempfile.mkdtemp(prefix="async-agent-"))
    tool_config = root / "slow_tool.yaml"
    tool_config.write_text(TOOL_CONFIG % {"median": a.median, "sigma": a.sigma, "cap": a.cap})
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    for r in range(a.rounds):
        for side in sides[r % len(sides):] + sides[:r % len(sides)]:
            seed = 0 if a.same_seed else a.first_seed + r
            result = run_side(side, root / f"{side}-{r}", a, tool_config, seed)
            runs[side].append(result)
            print(f"round {r + 1}/{a.rounds} (seed {seed}) {side}: training {result['train_s']:.1f} s, "
                  f"whole {result['whole_s']:.1f} s, "
                  f"held-out {result['before']:.3f} -> {result['after']:.3f} (load average {os.getloadavg()[0]:.2f})",
                  flush=True)
    summary = {}
    print(f"\ntool latency: lognormal, median {a.median:g} s, sigma {a.sigma:g}, capped at {a.cap:g} s; "
          f"{a.steps} steps per run; {a.tool_processes} tool processes")
    for side in sides:
        rs = runs[side]
        steps_per_min = statistics.median(x["steps"] / (x["train_s"] / 60) for x in rs)
        points_per_min = statistics.median(100 * (x["after"] - x["before"]) / (x["train_s"] / 60) for x in rs)
        steady = statistics.median((x["steps"] - 1) / (x["after_first_s"] / 60) for x in rs)
        summary[side] = (steps_per_min, points_per_min, steady)
        print(f"{side:>11}: {steps_per_min:.2f} steps/min of training ({steady:.2f} after the first step), held-out "
              f"{', '.join('%.3f -> %.3f' % (x['before'], x['after']) for x in rs)}, {points_per_min:.2f} points/min, "
              f"whole process {statistics.median(x['whole_s'] for x in rs):.0f} s, max staleness "
              f"{max(x['staleness'] for x in rs)}")
    base = summary["sync"]
    for side in (s for s in sides if s != "sync"):
        s = summary[side]
        points = f"{s[1] / base[1]:.2f}x" if base[1] > 0 else "n/a (sync gained no points)"
        print(f"{side} / sync: steps per minute {s[0] / base[0]:.2f}x ({s[2] / base[2]:.2f}x after the first step, "
              f"which fills the pipeline), points per minute {points}")


if __name__ == "__main__":
    main()
