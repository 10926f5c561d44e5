"""The fault matrix, runtime: real runs of ``python -m verl_lite.trainer.main_ppo`` that fail (or are
stopped) mid-run. Each asserts the exit code, the message, the time from the fault to the exit
(the configured bound plus a fixed slack), and that no process of the run is left: every pid seen
in the run's process tree while it ran, and every process carrying the run's marker.

Also: a default job listens on loopback only (every listening TCP socket of every process of the
run, sampled while it runs), and a failing rerun into a finished run's output directory leaves
that run's metrics.jsonl, summary.json and curve byte-identical."""

import hashlib
import json
import re
import signal
import time
from pathlib import Path

import psutil
import pytest

from tests.faults.conftest import (CliRun, bad_files, check_clean_exit, tiny_assets,  # noqa: F401
                                  tiny_overrides, wait_for_run)

SLACK_S = 30.0  # teardown (workers, Ray) on a loaded 2-core machine, on top of each fault's own bound
WATCHDOG_SLACK_S = 15.0  # the stop watchdog's kill-and-wait (3 s) and the exit, on a loaded machine
LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")

MARK = '''
import os, time
def _mark():
    path = os.environ["FAULT_MARK"]
    if not os.path.exists(path):
        with open(path, "w") as f:
            f.write(repr(time.time()))
'''
REWARDS = {
    "raise": ("naive", MARK + '''
_calls = [0]
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    _calls[0] += 1
    if _calls[0] == 6:
        _mark()
        raise ValueError("the grader crashed")
    return 0.5
'''),
    "nan": ("naive", MARK + '''
_calls = [0]
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    _calls[0] += 1
    if _calls[0] == 3:
        _mark()
        return float("nan")
    return 1.0
'''),
    "count": ("batch", MARK + '''
def compute_score(data_sources, solution_strs, ground_truths, extra_infos):
    _mark()
    return [1.0] * (len(solution_strs) - 1)
'''),
    "hang": ("naive", MARK + '''
_calls = [0]
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    _calls[0] += 1
    if _calls[0] == 3:
        _mark()
        time.sleep(3600)
    return 0.5
'''),
    "slow_first_call": ("naive", MARK + '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if not os.path.exists(os.environ["FAULT_MARK"]):
        _mark()
        time.sleep(4.0)  # the test SIGKILLs a worker meanwhile
    return 0.5
'''),
    "plain": ("naive", '''
import subprocess
_helper = subprocess.Popen(["sleep", "1000"])  # a helper the file never stops: it must end with the run
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(c.isdigit() for c in solution_str) / max(1, len(solution_str))
'''),
    "leak": ("naive", MARK + '''
_kept = []
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    _mark()
    _kept.append(bytearray(32 << 20))  # 32 MiB more per call, never freed
    return 0.5
'''),
}


def _reward(tmp_path: Path, kind: str) -> dict:
    manager, src = REWARDS[kind]
    path = tmp_path / f"reward_{kind}.py"
    path.write_text(src)
    return {"reward.custom_reward_function.path": str(path), "reward.reward_manager": manager}


def _mark_time(path: Path) -> float:
    assert path.is_file(), "the fault never fired"
    return float(path.read_text())


def _digest(run_dir: Path) -> dict:
    return {name: hashlib.sha256((run_dir / name).read_bytes()).hexdigest()
            for name in ("metrics.jsonl", "summary.json", "curves.png")}


# ---------------------------------------------------------------- a default job: loopback only; its results survive


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """The default job (shipped model, synthetic task, built-in reward), one step, sockets watched."""
    out = tmp_path_factory.mktemp("finished_run")
    run = CliRun(["trainer.total_training_steps=1", "trainer.val_before_train=false", "trainer.test_freq=-1",
                  f"trainer.output_dir={out}", "trainer.logger=[jsonl]"], watch_sockets=True).wait(timeout=400)
    assert run.code == 0, run.err[-4000:]
    run_dirs = [p for p in out.iterdir() if p.is_dir() and not p.is_symlink()]
    assert len(run_dirs) == 1
    return out, run_dirs[0], run


def test_default_job_listens_on_loopback_only(finished_run):
    _, _, run = finished_run
    listening_pids = set(run.listening.values())
    # Ray's GCS, raylet, the driver's and the worker's core workers all listen: a run that saw fewer
    # processes listening was not sampled properly, and the check below would prove nothing
    assert len(listening_pids) >= 3 and len(run.listening) >= 5, run.listening
    exposed = {addr: pid for addr, pid in run.listening.items() if addr[0] not in LOOPBACK}
    assert exposed == {}, f"listening beyond loopback: { {a: (p, run.cmdlines.get(p, '')[-160:]) for a, p in exposed.items()} }"
    assert run.leftover() == []


LIBRARY_NOISE = ("Warning", "Transformer Engine", "Apex", "authentication_token_setup", "Token authentication")


def test_default_job_console_has_no_library_noise(finished_run):
    """Megatron's import warnings (driver and workers) and Ray's token-auth notice are hidden by default
    (verl_lite/utils/quiet.py); --debug brings them back (tests/trainer/test_console_quiet.py)."""
    _, _, run = finished_run
    noisy = [line for line in (run.out + run.err).splitlines() if any(w in line for w in LIBRARY_NOISE)]
    assert noisy == [], "\n".join(noisy)


def test_failing_rerun_keeps_the_finished_run(finished_run, tiny_assets, tmp_path, capsys):  # noqa: F811
    from verl_lite.trainer import main_ppo

    out, first, _ = finished_run
    before = _digest(first)
    assert json.loads((first / "summary.json").read_text())["status"] == "completed"
    # a config that fails before start ...
    assert main_ppo.main([f"trainer.output_dir={out}", "data.train_batch_size=0"]) == 2
    # ... and one that fails mid-run (the reward raises), both into the same trainer.output_dir
    mark = tmp_path / "mark"
    run = CliRun(tiny_overrides(tiny_assets, **_reward(tmp_path, "raise"), **{"trainer.output_dir": str(out)}),
                 env={"FAULT_MARK": str(mark)}).wait(timeout=300)
    check_clean_exit(run, 1, r"reward function .*reward_raise\.py:compute_score raised ValueError: the grader "
                              r"crashed on sample 5")
    assert _digest(first) == before, "the failing rerun changed the finished run's results"
    runs = [p for p in out.iterdir() if p.is_dir() and not p.is_symlink()]
    rerun = [p for p in runs if p != first]  # its name differs: the run name follows the data and the model
    assert len(runs) == 2 and len(rerun) == 1 and (out / "latest").resolve() == rerun[0]
    failed = json.loads((rerun[0] / "summary.json").read_text())
    assert failed["status"] == "failed" and "the grader crashed" in (rerun[0] / "run.log").read_text()


# ---------------------------------------------------------------- the reward fails mid-run

REWARD_FAULTS = [
    # kind, extra overrides, bound (s) from the fault to the error, message
    ("nan", {}, 0.0, r"reward function .*reward_nan\.py:compute_score on sample 2 .*non-finite score nan"),
    ("count", {}, 0.0, r"batched reward function .*reward_count\.py:compute_score returned 15 scores for 16 samples"),
    ("hang", {"reward.timeout_s": 3}, 3.0,
     r"reward function .*reward_hang\.py:compute_score did not return within reward\.timeout_s=3\.0s on sample 2 "
     r"\(data_source='synthetic/addition'\) of a batch of 16.*raise reward\.timeout_s"),
    ("leak", {"reward.max_memory_gb": 0.25}, 0.0,
     r"reward function .*reward_leak\.py:compute_score raised MemoryError: the reward process reached its memory "
     r"limit reward\.max_memory_gb=0\.25 GiB; free what the function keeps between calls or raise "
     r"reward\.max_memory_gb on sample \d+"),
]


@pytest.mark.parametrize("kind,extra,bound,pattern", REWARD_FAULTS, ids=[f[0] for f in REWARD_FAULTS])
def test_reward_fault_stops_the_run(kind, extra, bound, pattern, tiny_assets, tmp_path):  # noqa: F811
    mark = tmp_path / "mark"
    overrides = {**_reward(tmp_path, kind), "trainer.val_before_train": "false",
                 "trainer.output_dir": str(tmp_path / "out"), **extra}
    run = CliRun(tiny_overrides(tiny_assets, **overrides), env={"FAULT_MARK": str(mark)}).wait(timeout=300)
    check_clean_exit(run, 1, pattern)
    took = run.ended - _mark_time(mark)
    assert took <= bound + SLACK_S, f"{took:.1f}s from the fault to the exit"
    if kind == "hang":
        assert took >= bound, "the hung reward was abandoned before reward.timeout_s"


# ---------------------------------------------------------------- a worker dies, the driver is signalled


def test_worker_sigkilled_mid_step(tiny_assets, tmp_path):  # noqa: F811
    mark = tmp_path / "mark"
    overrides = {**_reward(tmp_path, "slow_first_call"), "trainer.val_before_train": "false",
                 "trainer.output_dir": str(tmp_path / "out")}
    run = CliRun(tiny_overrides(tiny_assets, **overrides), env={"FAULT_MARK": str(mark)})
    wait_for_run(mark.is_file, run, 300, "the first reward call")  # the step has generated; the reward is running

    def worker():
        for p in psutil.Process(run.proc.pid).children(recursive=True):
            cmd = " ".join(p.cmdline())
            if cmd.startswith("ray::") and "Worker" in cmd and "IDLE" not in cmd:
                return p
        return None

    victim = wait_for_run(worker, run, 10, "finding the worker process")
    killed_at = time.time()
    victim.kill()
    run.wait(timeout=300)
    check_clean_exit(run, 1, r"worker rank 0 died during '\w+'")
    assert run.ended - killed_at <= SLACK_S


def _session_dir(run: CliRun) -> str:
    """The Ray session directory of the run, from the raylet's command line."""
    for cmd in run.cmdlines.values():
        match = re.search(r"--session_dir=(\S+)", cmd)
        if match:
            return match.group(1)
    raise AssertionError(f"no raylet seen among the run's processes: {sorted(run.cmdlines.values())}")


def _session_processes(session_dir: str, marker: str) -> list:
    """Live processes of one Ray session: the session dir on their command line or among their open
    files (their logs: Ray's Python processes overwrite their command line and environment with a
    ``ray::`` title), or the run's marker in their environment."""
    from tests.faults.conftest import processes_of

    return [(p.pid, " ".join(p.cmdline())[:100]) for p in processes_of(marker, session_dir)]


def test_driver_sigkilled_mid_run_takes_its_ray_down(tiny_assets, tmp_path):  # noqa: F811
    """SIGKILL of the driver (no handler, no teardown): every process of its Ray session, the
    dashboard and runtime-env agents included, is gone within a bounded time."""
    out = tmp_path / "out"
    overrides = {**_reward(tmp_path, "plain"), "trainer.total_training_steps": 200, "trainer.test_freq": -1,
                 "trainer.output_dir": str(out)}
    run = CliRun(tiny_overrides(tiny_assets, **overrides))
    metrics = out / "latest" / "metrics.jsonl"
    wait_for_run(lambda: metrics.is_file() and metrics.read_text().count("\n") >= 1, run, 300, "a metrics line")
    session_dir = _session_dir(run)

    def titled_agents():  # set late in their start-up; they also hide the session's marker then
        names = set()
        for p in psutil.Process(run.proc.pid).children(recursive=True):
            try:
                names.add(p.cmdline()[0].split()[0])
            except (psutil.Error, IndexError):
                pass
        return {"ray::DashboardAgent", "ray::RuntimeEnvAgent"} <= names

    wait_for_run(titled_agents, run, 120, "the dashboard and runtime-env agents running")
    killed_at = time.time()
    run.proc.kill()
    run.wait(timeout=60)
    deadline = killed_at + 20.0
    while _session_processes(session_dir, run.marker) and time.time() < deadline:
        time.sleep(0.5)
    assert _session_processes(session_dir, run.marker) == [], "processes of the killed driver's Ray left behind"
    assert run.leftover(settle_s=0) == []


# when the signal lands: "init_model" (the workers are building their engines; the driver waits in
# ray.wait), or seconds after the second metrics line (mid-step: mostly inside ray.wait too, where a
# handler's exception used to surface as "SystemError: <cyfunction CoreWorker.wait> returned a
# result with an exception set")
SIGNAL_MOMENTS = [(signal.SIGTERM, "init_model"), (signal.SIGINT, 0.0), (signal.SIGINT, 0.5), (signal.SIGINT, 1.3)]


@pytest.mark.parametrize("signum,moment", SIGNAL_MOMENTS, ids=[f"{s.name}-{m}" for s, m in SIGNAL_MOMENTS])
def test_signal_stops_the_run_cleanly(signum, moment, tiny_assets, tmp_path):  # noqa: F811
    from verl_lite.trainer.stop_signals import STOP_GRACE_S

    out = tmp_path / "out"
    overrides = {**_reward(tmp_path, "plain"), "trainer.total_training_steps": 200, "trainer.test_freq": -1,
                 "trainer.output_dir": str(out)}
    run = CliRun(tiny_overrides(tiny_assets, **overrides))
    metrics = out / "latest" / "metrics.jsonl"
    if moment == "init_model":
        def in_init_model():
            for p in psutil.Process(run.proc.pid).children(recursive=True):
                try:
                    if p.cmdline()[0].startswith("ray::") and ".init_model" in p.cmdline()[0]:
                        return True
                except (psutil.Error, IndexError):
                    pass
            return False

        wait_for_run(in_init_model, run, 300, "a worker running init_model")
    else:
        wait_for_run(lambda: metrics.is_file() and metrics.read_text().count("\n") >= 2, run, 300, "two metrics lines")
        time.sleep(moment)
    sent = time.time()
    run.proc.send_signal(signum)
    run.wait(timeout=120)
    name = signal.Signals(signum).name
    check_clean_exit(run, 128 + signum, rf"stopped by {name}")
    assert "internal error" not in run.err, run.err[-3000:]
    # the watchdog's bound: STOP_GRACE_S, then its kill of what is left (itself bounded), then the exit
    assert run.ended - sent <= STOP_GRACE_S + WATCHDOG_SLACK_S, f"{run.ended - sent:.1f}s from {name} to the exit"
    if "did not stop within" in run.err:  # a loaded machine: the watchdog stopped a slow teardown (that is its job),
        return  # before summary.json was written; the stop itself was checked above
    summary = json.loads((out / "latest" / "summary.json").read_text())
    assert summary["status"] == f"interrupted ({name})", summary
    if moment != "init_model":
        text = metrics.read_text()
        assert text.endswith("\n") and all(json.loads(line) for line in text.splitlines()), "a torn metrics line"
        assert summary["steps"] >= 1
