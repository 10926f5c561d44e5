"""The last unbounded waits and leaks (issue 47), each planted for real:

- a tool that never returns, busy (a pure-Python loop holding the GIL) or blocked, ends its call within
  ``multi_turn.tool_timeout_s`` plus :data:`KILL_BOUND_S`, its process tree killed, no thread left behind,
  and the run names the tool;
- what a reward file or a tool starts in a session of its own (``start_new_session=True``) ends with it,
  also when the driver is SIGKILLed;
- ``reward.max_memory_gb`` holds for shared anonymous memory and for the processes a reward starts;
- SIGTERM at any moment of start-up (before Ray, inside ``ray.init``) exits 143 with one line.

Bounds here are the properties themselves, with head-room for a loaded machine (KILL_BOUND_S); the
sizes of the planted allocations are far beyond the limits, so a limit that did not hold would be seen.
"""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from tests.faults.conftest import CliRun, alive, tiny_assets, tiny_overrides, wait_for_run  # noqa: F401

KILL_BOUND_S = 5.0  # a timed-out call: detecting the deadline and killing a process tree, on a loaded machine
GONE_BOUND_S = 30.0  # a killed tree's processes leave the process table: the guard's kill loop (up to its KILL_WAIT_S) and reaping, on a loaded machine
REPO = Path(__file__).resolve().parents[2]


def _gone(pids, within: float = GONE_BOUND_S) -> list[int]:
    """The pids still alive (not zombies) after up to ``within`` seconds."""
    deadline = time.monotonic() + within
    while (left := alive(pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


# ============================================================================================ tools
STUCK_TOOLS = '''
import os, subprocess, threading


def _escape(pid_dir):
    """A helper in a session of its own, as a tool's subprocess could be."""
    helper = subprocess.Popen(["sleep", "1000"], start_new_session=True)
    with open(os.path.join(pid_dir, str(helper.pid)), "w"):
        pass


def spin(x: int) -> str:
    """Busy forever in pure Python, holding the GIL.

    Args:
        x: anything
    """
    _escape(os.environ["STUCK_PIDS"])
    while True:
        x += 1


def block(x: int) -> str:
    """Blocked forever.

    Args:
        x: anything
    """
    _escape(os.environ["STUCK_PIDS"])
    threading.Event().wait()


def add(a: int, b: int) -> int:
    """Add.

    Args:
        a: one
        b: two
    """
    return a + b


class Stuck:
    """verl's tool-class shape, named as the shipped tool-agent model's tool: busy or blocked by the expression."""

    def __init__(self, config, tool_schema):
        self.name = tool_schema["function"]["name"]

    def execute(self, instance_id, parameters, **kwargs):
        expression = str(parameters.get("expression"))
        (spin if sum(map(ord, expression)) % 2 else block)(0)
'''


@pytest.fixture
def stuck_tools(tmp_path, monkeypatch):
    """The module above, importable (also in tool processes: they get this import path), and its pid dir."""
    (tmp_path / "stuck_tools.py").write_text(STUCK_TOOLS)
    pids = tmp_path / "pids"
    pids.mkdir()
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("STUCK_PIDS", str(pids))
    import importlib

    import stuck_tools

    yield importlib.reload(stuck_tools), pids
    sys.modules.pop("stuck_tools", None)


def test_busy_and_blocked_tools_end_at_their_timeout_with_their_trees(stuck_tools):
    import asyncio

    from verl_lite.agent.tool_calls import ToolCall
    from verl_lite.agent.tools import FunctionTool, ToolExecutor, ToolFailure

    module, pid_dir = stuck_tools
    timeout = 1.0
    ex = ToolExecutor([FunctionTool(module.spin), FunctionTool(module.block), FunctionTool(module.add)], timeout,
                      256, "middle", "text")
    try:
        asyncio.run(ex.run([ToolCall("add", {"a": 0, "b": 0})]))  # the first process is started (not the tool's time)
        threads = threading.active_count()
        for _ in range(2):  # a second turn: the killed processes were replaced
            start = time.monotonic()
            out = asyncio.run(ex.run([ToolCall("spin", {"x": 1}), ToolCall("block", {"x": 1}),
                                      ToolCall("add", {"a": 2, "b": 3})]))
            took = time.monotonic() - start
            assert [o.status for o in out] == ["timeout", "timeout", "ok"] and out[2].text == "5", out
            assert "did not return within 1.0s" in out[0].text and "'spin'" in out[0].text
            assert took <= timeout + KILL_BOUND_S + 3.0, f"a turn of stuck tools took {took:.1f}s"  # + 2 starts
        assert threading.active_count() == threads, "a timed-out call left a thread behind"
        assert len(ex.pool.processes) <= ex.pool.size
        helpers = [int(p.name) for p in pid_dir.iterdir()]
        assert len(helpers) == 4 and _gone(helpers) == [], "what the stuck tools started outlived them"
        ex.on_error = "fail"
        start = time.monotonic()
        with pytest.raises(ToolFailure, match=r"tool 'spin' timed out: did not return within 1\.0s"):
            asyncio.run(ex.run([ToolCall("spin", {"x": 1})]))
        assert time.monotonic() - start <= timeout + KILL_BOUND_S
    finally:
        pool_pids = [p.guard.pid for p in ex.pool.processes]
        ex.close()
    assert _gone(pool_pids) == [] and _gone([int(p.name) for p in pid_dir.iterdir()]) == []


def test_an_unpicklable_tool_is_refused_before_start():
    from verl_lite.agent.tools import ToolConfigError, build_tools

    lock = threading.Lock()

    def locked(x: int) -> int:
        """Uses a lock.

        Args:
            x: anything
        """
        with lock:
            return x

    with pytest.raises(ToolConfigError, match=r"tools: 'locked' cannot be sent to a tool process \(TypeError: "
                                              r".*lock.*\); .*a tool must be picklable"):
        build_tools([locked])


# ============================================================================================ SIGKILL of the driver
DRIVER = '''
import asyncio, os, sys, time
sys.path.insert(0, {tools_dir!r})
from verl_lite.reward.sandbox import RewardProcess
from verl_lite.agent.tool_calls import ToolCall
from verl_lite.agent.tools import FunctionTool, ToolExecutor
import stuck_tools

reward = RewardProcess({reward!r}, "compute_score", "naive", [])
assert reward("naive", ["x"], ["s"], ["1"], [None], {{}}, 30.0) == [1.0]
tools = ToolExecutor([FunctionTool(stuck_tools.block)], 600.0, 256, "middle", "text")

async def main():
    call = asyncio.ensure_future(tools.run([ToolCall("block", {{"x": 1}})]))
    while len(os.listdir(os.environ["STUCK_PIDS"])) < 2:  # the reward's helper and the tool's
        await asyncio.sleep(0.05)
    print("ready", flush=True)
    await call

asyncio.run(main())
'''

ESCAPING_REWARD = '''
import os, subprocess
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    helper = subprocess.Popen(["sleep", "1000"], start_new_session=True)
    with open(os.path.join(os.environ["STUCK_PIDS"], str(helper.pid)), "w"):
        pass
    return 1.0
'''


def test_what_rewards_and_tools_start_dies_with_a_sigkilled_driver(stuck_tools, tmp_path):
    _, pid_dir = stuck_tools
    (tmp_path / "escaping_reward.py").write_text(ESCAPING_REWARD)
    script = DRIVER.format(tools_dir=str(tmp_path), reward=str(tmp_path / "escaping_reward.py"))
    driver = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert driver.stdout.readline().strip() == "ready"
        tree = [p.pid for p in psutil.Process(driver.pid).children(recursive=True)]
        helpers = [int(p.name) for p in pid_dir.iterdir()]
        assert len(helpers) == 2 and not set(helpers) & {driver.pid}
        driver.kill()
        driver.wait(timeout=30)
        assert _gone(helpers + tree) == [], "processes of a SIGKILLed driver's reward / tools outlived it"
    finally:
        if driver.poll() is None:
            driver.kill()


# ============================================================================================ memory of every kind
SHARED_MEMORY_REWARD = '''
import mmap
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    m = mmap.mmap(-1, 2 << 30, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)  # 2 GiB, touched page by page
    for i in range(0, len(m), mmap.PAGESIZE):
        m[i] = 1
    return 1.0
'''
CHILDREN_REWARD = '''
import subprocess, sys, time
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    # 6 processes of 200 MiB each: every one under the per-process limit, 1.2 GiB together
    kids = [subprocess.Popen([sys.executable, "-c", "import time; b = bytearray(200 << 20); time.sleep(60)"])
            for _ in range(6)]
    for k in kids:
        k.wait()
    return 1.0
'''


@pytest.mark.parametrize("kind", ["shared_anonymous", "subprocesses"])
def test_memory_limit_holds_for_shared_memory_and_subprocesses(kind, tmp_path):
    from verl_lite.reward.config import CustomRewardFunctionConfig, RewardConfig
    from verl_lite.data.char_tokenizer import build_char_tokenizer
    from verl_lite.reward import RewardError, RewardManager

    path = tmp_path / f"{kind}_reward.py"
    path.write_text(SHARED_MEMORY_REWARD if kind == "shared_anonymous" else CHILDREN_REWARD)
    cfg = RewardConfig(max_memory_gb=0.5, timeout_s=120.0, custom_reward_function=CustomRewardFunctionConfig(path=str(path)))
    m = RewardManager(cfg, build_char_tokenizer())
    tree = []
    try:
        tree = [p.pid for p in psutil.Process(m.pids()[0]).children(recursive=True)]
        tok = m.tokenizer
        with pytest.raises(RewardError) as info:
            m([tok.encode("x", add_special_tokens=False)], ["src"], ["1"])
    finally:
        m.close()
    message = str(info.value)
    match = re.fullmatch(r"reward function .*_reward\.py:compute_score raised MemoryError: the reward process and "
                         r"what it started reached (\d+\.\d\d) GiB \(shared memory and subprocesses count\), over its "
                         r"memory limit reward\.max_memory_gb=0\.5 GiB; free what the function keeps between calls or "
                         r"raise reward\.max_memory_gb on sample 0 \(data_source='src'\) of a batch of 1", message)
    assert match, message
    assert 0.5 <= float(match.group(1)) < 1.2, "stopped far from the limit"  # over 0.5 (printed to 2 places); the plants reach 1.2 and 2 GiB
    assert _gone(tree) == []


# ============================================================================================ real runs
def test_stuck_tools_in_a_run_are_bounded_and_named(tmp_path):
    """The shipped tool-agent recipe with its calculator replaced by one that spins or blocks: the step ends,
    each call is a timeout of tool_timeout_s, the run names the tool, nothing it started is left."""
    (tmp_path / "stuck_tools.py").write_text(STUCK_TOOLS)
    pids = tmp_path / "pids"
    pids.mkdir()
    shipped = (REPO / "verl_lite/assets/tool-agent-data/tool_config.yaml").read_text()
    config = tmp_path / "tool_config.yaml"
    config.write_text(shipped.replace("verl_lite.data.tool_task.Calculator", "stuck_tools.Stuck"))
    out = tmp_path / "out"
    mt = "actor_rollout_ref.rollout.multi_turn"
    run = CliRun(["--recipe", "tool_agent", "trainer.total_training_steps=1", "trainer.val_before_train=false",
                  "trainer.test_freq=-1", "data.train_batch_size=2", "actor_rollout_ref.rollout.n=2",
                  "actor_rollout_ref.actor.ppo_mini_batch_size=2", f"{mt}.tool_timeout_s=2",
                  f"{mt}.tool_config_path={config}", f"trainer.output_dir={out}", "trainer.logger=[jsonl]",
                  f"trainer.default_local_dir={tmp_path / 'ckpt'}"],
                 env={"PYTHONPATH": str(tmp_path), "STUCK_PIDS": str(pids)}).wait(timeout=400)
    assert run.code == 0, run.err[-4000:]
    assert re.search(r"warning: tool 'calculator' did not return within actor_rollout_ref\.rollout\.multi_turn\."
                     r"tool_timeout_s=2\.0s; its tool process was killed", run.err), run.err[-4000:]
    (step,) = [json.loads(line) for line in (out / "latest" / "metrics.jsonl").read_text().splitlines()]
    assert step["agent/tool_timeouts"] >= 1, step  # (tool_errors counts calls that could not run: malformed JSON)
    # a call's latency: its timeout, the kill, and the start-up of the process started for it
    assert 2.0 <= step["agent/tool_latency_s/calculator"] <= 2.0 + KILL_BOUND_S + 10.0, step
    helpers = [int(p.name) for p in pids.iterdir()]
    assert helpers and _gone(helpers) == [], "what the stuck tools started outlived the run"
    assert run.leftover() == []


def test_shared_memory_reward_stops_the_run_and_its_escaped_helper_goes(tiny_assets, tmp_path):  # noqa: F811
    pids = tmp_path / "pids"
    pids.mkdir()
    reward = tmp_path / "shm_reward.py"
    reward.write_text(ESCAPING_REWARD.replace("    return 1.0", textwrap.indent(textwrap.dedent('''
        import mmap
        if len(os.listdir(os.environ["STUCK_PIDS"])) >= 3:
            m = mmap.mmap(-1, 2 << 30, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
            for i in range(0, len(m), mmap.PAGESIZE):
                m[i] = 1
        return 1.0'''), "    ")))
    run = CliRun(tiny_overrides(tiny_assets, **{"reward.custom_reward_function.path": str(reward),
                                                "reward.max_memory_gb": 0.5, "trainer.val_before_train": "false",
                                                "trainer.output_dir": str(tmp_path / "out"),
                                                "trainer.default_local_dir": str(tmp_path / "ckpt")}),
                 env={"STUCK_PIDS": str(pids)}).wait(timeout=300)
    assert run.code == 1, run.err[-4000:]
    assert re.search(r"reward function .*shm_reward\.py:compute_score raised MemoryError: the reward process and what "
                     r"it started reached \d+\.\d\d GiB \(shared memory and subprocesses count\), over its memory "
                     r"limit reward\.max_memory_gb=0\.5 GiB", run.err), run.err[-4000:]
    helpers = [int(p.name) for p in pids.iterdir()]
    assert len(helpers) >= 3 and _gone(helpers) == [], "the reward's helpers in sessions of their own outlived the run"
    assert run.leftover() == []


# ---------------------------------------------------------------- SIGTERM at any moment of start-up

def _ray_started(run: CliRun) -> bool:
    """Whether Ray's first process (its GCS) runs among the run's processes."""
    try:
        return any("gcs_server" in " ".join(p.cmdline()) for p in psutil.Process(run.proc.pid).children(recursive=True))
    except psutil.Error:
        return False


# the stop's one line: the run unwound, or (a library's handler swallowed the signal) the watchdog ended it
STOP_LINE = r"verl_lite: stopped by SIGTERM(; the run did not stop within \d+s, \d+ process\(es\) of the run were killed)?"
INFO_LINES = ("verl_lite checkpoint: ",)  # what a run reports before Ray starts (resume: none to resume from)
# "run_dir": pre-flight done, before Ray; "ray+S": S seconds after Ray's first process appeared (inside ray.init)
STARTUP_MOMENTS = ["run_dir", "ray+0.0", "ray+1.0", "ray+2.0"]


@pytest.fixture(scope="module")
def startup_sigterms(tiny_assets, tmp_path_factory):  # noqa: F811
    """One run per moment, two at a time (each stops in its start-up); moment -> (CliRun, seconds signal->exit)."""

    def launch(moment):
        out = tmp_path_factory.mktemp(moment.replace("+", "_"))
        run = CliRun(tiny_overrides(tiny_assets, **{"trainer.output_dir": str(out / "runs"), "trainer.val_before_train":
                                                    "false", "trainer.default_local_dir": str(out / "ckpt")}))
        try:
            if moment == "run_dir":
                wait_for_run(lambda: (out / "runs" / "latest").exists(), run, 300, "the run directory")
            else:
                wait_for_run(lambda: _ray_started(run), run, 300, "Ray's first process")
                time.sleep(float(moment.split("+")[1]))
            if run.proc.poll() is None:
                run.proc.send_signal(signal.SIGTERM)
            sent = time.time()
            run.wait(timeout=120)
            return run, run.ended - sent
        except BaseException as err:  # noqa: BLE001 - reported by that moment's test
            if run.proc.poll() is None:
                run.proc.kill()
            return err

    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(STARTUP_MOMENTS, pool.map(launch, STARTUP_MOMENTS)))


@pytest.mark.parametrize("moment", STARTUP_MOMENTS)
def test_sigterm_during_start_up_exits_143_with_one_line(moment, startup_sigterms):
    from verl_lite.trainer.stop_signals import STOP_GRACE_S, UNSEEN_GRACE_S

    got = startup_sigterms[moment]
    if isinstance(got, BaseException):
        raise got
    run, took = got
    lines = [line for line in run.err.splitlines() if line.strip() and not line.startswith(INFO_LINES)]
    assert run.code == 143 and len(lines) == 1 and re.fullmatch(STOP_LINE, lines[0]), f"exit {run.code}:\n{run.err[-4000:]}"
    assert took <= UNSEEN_GRACE_S + STOP_GRACE_S + KILL_BOUND_S, f"{took:.1f}s from SIGTERM to the exit"
    assert run.leftover() == [], "processes of the run left behind"
