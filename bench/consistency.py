"""The consistency mode's cost, side by side: the default job with the HF rollout (normal) and with
``actor_rollout_ref.rollout.batch_invariant=true`` (the actor's batch-invariant engine generates), alternating.

    .venv/bin/python bench/consistency.py [--pairs 2] [--steps 6] [--layouts]

Each side is the user's command line (``python -m verl_lite.trainer.main_ppo``, the default job, validation off)
in a process of its own; read from its metrics.jsonl, past the first step (warm-up): the mean seconds per step, of
generation and of the update, and the largest ``rollout/logprob_diff_max`` of any step. Printed per side, with
the ratios consistency / normal. ``--layouts`` also runs the normal mode at TP2, PP2 and CP2 (the consistency mode
refuses them: their collectives sum in another order than one process) and prints the gen-vs-train difference
each layout shows.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
M = "actor_rollout_ref.actor.megatron"
LAYOUTS = {"tp2": [f"{M}.tensor_model_parallel_size=2"], "pp2": [f"{M}.pipeline_model_parallel_size=2"],
           "cp2": [f"{M}.context_parallel_size=2"]}


def run(extra: list[str], steps: int, out: Path) -> list[dict]:
    """One default-job process; its metrics rows."""
    cmd = [sys.executable, "-m", "verl_lite.trainer.main_ppo", f"trainer.total_training_steps={steps}",
           "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.save_freq=-1", "trainer.logger=[jsonl]",
           f"trainer.output_dir={out}", f"trainer.default_local_dir={out / 'ckpt'}", *extra]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
    return [json.loads(line) for line in next(out.glob("*/metrics.jsonl")).read_text().splitlines()]


def summary(rows: list[dict]) -> dict:
    warm = rows[1:] or rows
    return {"step_s": statistics.mean(r["timing_s/step"] for r in warm),
            "generate_s": statistics.mean(r["timing_s/generate"] for r in warm),
            "update_s": statistics.mean(r["timing_s/update_actor"] for r in warm),
            "diff_max": max(r["rollout/logprob_diff_max"] for r in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--layouts", action="store_true")
    args = parser.parse_args()
    sides = {"normal": [], "consistency": ["actor_rollout_ref.rollout.batch_invariant=true"]}
    results: dict[str, list[dict]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory() as tmp:
        for pair in range(args.pairs):
            order = list(sides) if pair % 2 == 0 else list(reversed(sides))
            for side in order:
                results[side].append(summary(run(sides[side], args.steps, Path(tmp) / f"{side}{pair}")))
        layouts = {name: summary(run(["trainer.n_gpus_per_node=2", *extra], 3, Path(tmp) / name))
                   for name, extra in (LAYOUTS.items() if args.layouts else [])}
    mean = {side: {k: statistics.mean(r[k] for r in rs) for k in rs[0]} for side, rs in results.items()}
    print(f"default job, {args.steps} steps x {args.pairs} pairs (means past step 1):")
    for side, m in mean.items():
        print(f"  {side:12s} step {m['step_s']:.3f} s  generate {m['generate_s']:.3f} s  update {m['update_s']:.3f} s  "
              f"rollout/logprob_diff_max {max(r['diff_max'] for r in results[side]):.3g}")
    n, c = mean["normal"], mean["consistency"]
    print(f"  consistency / normal: step x{c['step_s'] / n['step_s']:.2f}, generate x{c['generate_s'] / n['generate_s']:.2f}, "
          f"update x{c['update_s'] / n['update_s']:.2f}")
    for name, m in layouts.items():
        print(f"  normal mode at {name} (2 workers): rollout/logprob_diff_max {m['diff_max']:.3g}")


if __name__ == "__main__":
    main()
