"""Where the whole process of a 1-step default job spends its wall time, phase by phase (issue 26).

Runs ``python -m verl_lite.trainer.main_ppo trainer.total_training_steps=1`` (the default job, one
RL step, validation before and after as the default does) ``--runs`` times, each in a fresh
process, and times each run from the outside (spawn to exit) and, inside, at the seams of the
CLI: the child is this script with ``--child``, which wraps the trainer's functions to take a
timestamp (CLOCK_MONOTONIC, shared by parent and child) on entry and exit, then calls
``main_ppo.main`` as ``python -m`` would. Phases:

    interpreter     spawn -> this script's first line (Python, site, the venv's .pth files)
    imports         verl_lite's CLI, trainer, controller (torch, Ray, transformers, ...)
    config          load_config (overrides, schema, validation)
    trainer init    PPOTrainer(...): tokenizer, data, reward, pre-flight
    run dir         run directory, config.json, trackers (until trainer.start)
    ray start       start_ray (wall; other phases may run during it)
    workers         the first role's processes created -> up and given the rendezvous (Ray's worker start and
                    imports; every role's processes start together)
    model init      start_roles: every role's init_model (engine, optimizer, rollout model), side by side, + layout
    first step      validation before training, then step 1
    after steps     the end: validation, summary (until trainer.close)
    shutdown        trainer.close (workers killed, Ray stopped), files, summary print
    exit            main's return -> process exit (atexit handlers; the CLI skips the interpreter's teardown)

Each run also reports the CPU seconds the whole machine spent while it ran (``/proc/stat``: every process,
Ray's and the workers' included; meaningful on an otherwise quiet machine): on 2 cores a run whose CPU
seconds are near twice its wall time cannot get faster by overlapping its phases, only by doing less.

    python bench/startup_phases.py [--runs 3] [--python .venv/bin/python] [ARGS ... for main_ppo]

``--trl`` runs TRL's GRPOTrainer on the same work beside it, alternating (``--runs`` pairs, the order
swapping each pair; TRL in a venv of its own, as ``bench/async_vs_sync.py`` says): one RL step of the
default job's work (``bench/async_vs_sync.py``'s TRL script with 1 step: 16 prompts x 8 samples, 12 new
tokens, the final model saved), timed from spawn to exit. The verl_lite side then runs the same step
without validation (TRL's has none) and saves its final model (``trainer.save_freq=1``: the checkpoint
and its HF export). Printed: each side's whole process per pair, the medians, and the ratio.

    python bench/startup_phases.py --trl [--runs 4] [--trl-python /tmp/trl-venv/bin/python]
"""

from __future__ import annotations

import time

T_SCRIPT = time.monotonic()

import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
STAMPS_ENV = "VERL_LITE_BENCH_STAMPS"  # the child writes its stamps to this file


def _wrap(owner, name: str, stamps: dict, key: str, first_exit: bool = False) -> None:
    """Stamp ``key:enter`` / ``key:exit`` (first entry, last exit, or the first exit) around ``owner.name``."""
    original = getattr(owner, name)

    def timed(*args, **kwargs):
        stamps.setdefault(f"{key}:enter", time.monotonic())
        try:
            return original(*args, **kwargs)
        finally:
            if not (first_exit and f"{key}:exit" in stamps):
                stamps[f"{key}:exit"] = time.monotonic()

    setattr(owner, name, timed)


def child(argv: list[str]) -> int:
    stamps = {"script": T_SCRIPT}
    from verl_lite.trainer import main_ppo, placement, ppo_trainer, training_run  # noqa: F401 (what main's run() imports)
    from verl_lite.config import loader
    from verl_lite.controller import worker_group

    stamps["imports"] = time.monotonic()
    _wrap(loader, "load_config", stamps, "config")
    _wrap(ppo_trainer.PPOTrainer, "__init__", stamps, "trainer_init")
    _wrap(ppo_trainer.PPOTrainer, "start", stamps, "start")
    _wrap(placement, "start_ray", stamps, "ray_start")
    _wrap(worker_group.WorkerGroup, "__init__", stamps, "workers")
    _wrap(worker_group.WorkerGroup, "connect", stamps, "connect", first_exit=True)  # every call connects
    _wrap(placement, "start_roles", stamps, "roles")
    _wrap(ppo_trainer.PPOTrainer, "step", stamps, "step")
    _wrap(ppo_trainer.PPOTrainer, "close", stamps, "close")
    try:
        code = main_ppo.main(argv)
    finally:
        stamps["main_return"] = time.monotonic()
        with open(os.environ[STAMPS_ENV], "w") as f:
            json.dump(stamps, f)
    return code


def phases(spawn: float, stamps: dict, exited: float) -> dict[str, float]:
    s = stamps.get
    out = {
        "interpreter": s("script") - spawn,
        "imports": s("imports") - s("script"),
        "config": s("config:exit") - s("config:enter"),
        "trainer init": s("trainer_init:exit") - s("trainer_init:enter"),
        "run dir": s("start:enter") - s("trainer_init:exit"),
        "ray start": (s("ray_start:exit") - s("ray_start:enter")) if s("ray_start:enter") else float("nan"),
        "workers": s("connect:exit") - s("workers:enter"),
        "model init": s("roles:exit") - s("connect:exit"),
        "first step": s("step:exit") - s("start:exit"),
        "after steps": s("close:enter") - s("step:exit"),
        "shutdown": s("main_return") - s("close:enter"),
        "exit": exited - s("main_return"),
    }
    out["start-up (spawn -> step 1 starts)"] = s("step:enter") - spawn
    out["whole process"] = exited - spawn
    return out


# TRL's side: bench/async_vs_sync.py's GRPOTrainer script, for one step (the argument: its output directory)
TRL_SIDE = ("import sys; from pathlib import Path; sys.path.insert(0, sys.argv[2]); import async_vs_sync as job; "
            "job.STEPS = 1; job.train_trl(Path(sys.argv[1]))")
SAME_WORK_AS_TRL = ["trainer.val_before_train=false", "trainer.test_freq=0", "trainer.save_freq=1"]


def busy_cpu_seconds() -> float:
    """CPU seconds the whole machine has spent outside idle and iowait since boot (Linux ``/proc/stat``; 0 elsewhere)."""
    try:
        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in f.readline().split()[1:9])
    except (OSError, ValueError):
        return 0.0
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def trl_once(trl_python: str) -> tuple[float, float]:
    """Wall seconds of TRL's one-step job, spawn to exit, and the machine's CPU seconds meanwhile."""
    with tempfile.TemporaryDirectory(prefix="trl_startup_") as tmp:
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
        cpu, spawn = busy_cpu_seconds(), time.monotonic()
        proc = subprocess.run([trl_python, "-c", TRL_SIDE, tmp, str(REPO / "bench")], cwd=tmp, env=env,
                              capture_output=True, text=True)
        exited, cpu = time.monotonic(), busy_cpu_seconds() - cpu
        if proc.returncode != 0:
            raise RuntimeError(f"TRL's 1-step job failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        return exited - spawn, cpu


def run_once(python: str, args: list[str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="verl_lite_startup_") as tmp:
        stamps_file = Path(tmp) / "stamps.json"
        env = dict(os.environ, **{STAMPS_ENV: str(stamps_file)})
        cmd = [python, str(Path(__file__).resolve()), "--child", f"trainer.output_dir={tmp}/out",
               f"trainer.default_local_dir={tmp}/ckpt", "trainer.total_training_steps=1", *args]
        cpu, spawn = busy_cpu_seconds(), time.monotonic()
        proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)
        exited, cpu = time.monotonic(), busy_cpu_seconds() - cpu
        if proc.returncode != 0:
            raise RuntimeError(f"the 1-step job failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        return {**phases(spawn, json.loads(stamps_file.read_text()), exited), "CPU s (machine, all processes)": cpu}


def main() -> None:
    if "--child" in sys.argv:
        sys.argv.remove("--child")
        from verl_lite.compat.fast_exit import exit_now

        exit_now(lambda: child(sys.argv[1:]))  # as `python -m verl_lite.trainer.main_ppo` ends
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--python", default=str(REPO / ".venv" / "bin" / "python"))
    ap.add_argument("--trl", action="store_true", help="TRL's GRPOTrainer on the same one step, alternating")
    ap.add_argument("--trl-python", default=os.environ.get("TRL_PYTHON", "/tmp/trl-venv/bin/python"))
    a, rest = ap.parse_known_args()
    runs, trl, trl_cpu = [], [], []
    if a.trl:
        rest = SAME_WORK_AS_TRL + rest
    for k in range(a.runs):
        load = os.getloadavg()[0]
        trl_first = a.trl and k % 2 == 1
        for side in (("trl", "verl") if trl_first else ("verl", "trl") if a.trl else ("verl",)):
            if side == "verl":
                runs.append(run_once(a.python, rest))
            else:
                wall, cpu = trl_once(a.trl_python)
                trl.append(wall)
                trl_cpu.append(cpu)
        beside = (f"; TRL {trl[-1]:.2f} s ({'before' if trl_first else 'after'} it), ratio "
                  f"{runs[-1]['whole process'] / trl[-1]:.2f}") if a.trl else ""
        print(f"run {k + 1}: whole process {runs[-1]['whole process']:.2f} s{beside} (1-min load before it "
              f"{load:.2f})", flush=True)
    table = subprocess.run([a.python, "-c", "import verl_lite.compat.transformers_imports as t; print(t.describe())"],
                           capture_output=True, text=True).stdout.strip()
    print(f"1-step default job, phases (wall s; median / min over {a.runs} runs; {os.cpu_count()} cores; {table}):")
    for key in runs[0]:
        vals = [r[key] for r in runs]
        print(f"  {key:<36} {statistics.median(vals):6.2f} / {min(vals):6.2f}")
    if a.trl:
        ratios = [r["whole process"] / t for r, t in zip(runs, trl)]
        print(f"TRL GRPOTrainer, the same step (whole process): {statistics.median(trl):.2f} / {min(trl):.2f} s, "
              f"CPU {statistics.median(trl_cpu):.2f} s (machine, all processes); "
              f"verl_lite / TRL per pair {', '.join(f'{x:.2f}' for x in ratios)}, median {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
