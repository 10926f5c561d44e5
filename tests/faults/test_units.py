"""The pieces behind the fault matrix, each against its own contract (no Ray, no workers):
Ray start-up retries, the reward process (time bound, crash, import once), run directories,
the zero-signal warning."""

import contextlib
import os
import re
import signal
import time
from pathlib import Path

import psutil
import pytest

from verl_lite.reward.config import CustomRewardFunctionConfig, RewardConfig
from verl_lite.data.char_tokenizer import build_char_tokenizer
from verl_lite.errors import BadInput, RayStartError
from verl_lite.reward import RewardConfigError, RewardError, RewardManager


# ---------------------------------------------------------------- Ray start-up


@pytest.fixture
def fake_ray(monkeypatch):
    """ray.init replaced by a stub that fails ``fail`` times (Ray's own start-up error), then succeeds."""
    import verl_lite.controller.local_ray as lr

    state = {"calls": 0, "fail": 0}

    def init(**kw):
        state["calls"] += 1
        signal.signal(signal.SIGTERM, lambda *a: None)  # as ray.init does
        if state["calls"] <= state["fail"]:
            raise Exception("The current node timed out during startup. This could happen because ...")

    monkeypatch.setattr(lr.ray, "init", init)
    monkeypatch.setattr(lr.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(lr.time, "sleep", lambda s: None)
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    return lr, state


def test_ray_start_retries_then_succeeds_and_keeps_signal_handlers(fake_ray):
    lr, state = fake_ray
    state["fail"] = lr.RAY_START_ATTEMPTS - 1
    handler = signal.getsignal(signal.SIGTERM)
    assert lr.start_ray() is True
    assert state["calls"] == lr.RAY_START_ATTEMPTS
    assert signal.getsignal(signal.SIGTERM) is handler


def test_ray_start_gives_up_with_a_message(fake_ray):
    lr, state = fake_ray
    state["fail"] = 99
    with pytest.raises(RayStartError) as info:
        lr.start_ray()
    assert state["calls"] == lr.RAY_START_ATTEMPTS
    msg = str(info.value)
    assert f"could not join the Ray cluster at RAY_ADDRESS=10.0.0.1:6379 after {lr.RAY_START_ATTEMPTS} attempts" in msg
    assert "timed out during startup" in msg and "ray status" in msg


# ---------------------------------------------------------------- the reward process


def _manager(path, name="compute_score", manager="naive", timeout_s=30.0, **kwargs):
    cfg = RewardConfig(reward_manager=manager, timeout_s=timeout_s,
                       custom_reward_function=CustomRewardFunctionConfig(path=str(path), name=name, reward_kwargs=kwargs))
    return RewardManager(cfg, build_char_tokenizer())


def _call(m, texts):
    tok = m.tokenizer
    return m([tok.encode(t, add_special_tokens=False) for t in texts], ["src"] * len(texts), ["1"] * len(texts))


REWARD = '''
import os, time
with open(os.environ["IMPORT_LOG"], "a") as f:
    f.write("imported\\n")
def compute_score(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):
    if solution_str == "hang":
        time.sleep(3600)
    if solution_str == "die":
        os._exit(3)
    return scale * len(solution_str)
'''


@pytest.fixture
def reward_file(tmp_path, monkeypatch):
    log = tmp_path / "imports.log"
    monkeypatch.setenv("IMPORT_LOG", str(log))
    path = tmp_path / "my_reward.py"
    path.write_text(REWARD)
    return path, log


def test_reward_file_is_imported_once_in_its_own_process(reward_file):
    from verl_lite.config import load_config, validate_config

    path, log = reward_file
    cfg = load_config([f"reward.custom_reward_function.path={path}"])
    try:
        validate_config(cfg)  # checks the file without running it
    except Exception:
        pass
    assert not log.exists()
    m = _manager(path, scale=2.0)
    try:
        assert _call(m, ["ab", "abc"])[0].tolist() == [4.0, 6.0]
        assert _call(m, ["a"])[0].tolist() == [2.0]
        assert log.read_text() == "imported\n"
        (pid,) = m.pids()
        assert pid != os.getpid() and psutil.Process(pid).ppid() == os.getpid()
    finally:
        m.close()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_hung_reward_is_killed_after_its_timeout(reward_file):
    path, _ = reward_file
    m = _manager(path, timeout_s=1.0)
    try:
        (pid,) = m.pids()
        start = time.monotonic()
        with pytest.raises(RewardError, match=r"my_reward\.py:compute_score did not return within reward\.timeout_s="
                                              r"1\.0s on sample 1 \(data_source='src'\) of a batch of 3"):
            _call(m, ["ok", "hang", "ok"])
        assert 1.0 <= time.monotonic() - start < 10.0
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        assert _call(m, ["abc"])[0].tolist() == [3.0]  # a fresh process serves the next call
    finally:
        m.close()


def test_reward_process_dying_is_an_error_not_a_hang(reward_file):
    path, _ = reward_file
    m = _manager(path)
    try:
        with pytest.raises(RewardError, match=r"the reward process exited with code 3 while scoring on sample 0"):
            _call(m, ["die"])
    finally:
        m.close()


HELPER_REWARD = '''
import os, subprocess
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    helper = subprocess.Popen(["sleep", "1000"])  # a helper the file never stops
    with open(os.environ["HELPER_PIDS"], "a") as f:
        f.write(f"{helper.pid}\\n")
    return 1.0
'''


@pytest.mark.parametrize("ending", ["close", "timeout"])
def test_helpers_the_reward_file_starts_end_with_its_process(ending, tmp_path, monkeypatch):
    pids_file = tmp_path / "helpers"
    monkeypatch.setenv("HELPER_PIDS", str(pids_file))
    path = tmp_path / "helper_reward.py"
    path.write_text(HELPER_REWARD if ending == "close" else HELPER_REWARD.replace("return 1.0", "return time.sleep(60)")
                    .replace("import os", "import os, time"))
    m = _manager(path, timeout_s=1.0)
    try:
        if ending == "close":
            assert _call(m, ["a", "b"])[0].tolist() == [1.0, 1.0]
        else:
            with pytest.raises(RewardError, match="did not return within"):
                _call(m, ["a"])
    finally:
        m.close()
    helpers = [int(line) for line in pids_file.read_text().split()]
    assert len(helpers) == (2 if ending == "close" else 1)
    deadline = time.monotonic() + 5.0
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in helpers):
        assert time.monotonic() < deadline, f"the reward file's helper processes {helpers} outlived it"
        time.sleep(0.1)


LEAKY_REWARD = '''
_kept = []
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    _kept.append(bytearray(64 << 20))  # 64 MiB more per call, never freed
    return 1.0
'''


def test_leaking_reward_stops_at_its_memory_limit(tmp_path):
    path = tmp_path / "leaky_reward.py"
    path.write_text(LEAKY_REWARD)
    cfg = RewardConfig(max_memory_gb=0.25, custom_reward_function=CustomRewardFunctionConfig(path=str(path)))
    m = RewardManager(cfg, build_char_tokenizer())
    try:
        assert _call(m, ["a"])[0].tolist() == [1.0]  # well under the limit
        with pytest.raises(RewardError) as info:
            _call(m, ["x"] * 8)  # 8 x 64 MiB more
    finally:
        m.close()
    assert re.fullmatch(r"reward function .*leaky_reward\.py:compute_score raised MemoryError: the reward process "
                        r"reached its memory limit reward\.max_memory_gb=0\.25 GiB; free what the function keeps "
                        r"between calls or raise reward\.max_memory_gb on sample [1-4] \(data_source='src'\) of a "
                        r"batch of 8", str(info.value)), str(info.value)


def test_python_callable_is_bounded_too():
    cfg = RewardConfig(timeout_s=0.5)

    def slow(data_source, solution_str, ground_truth, extra_info=None):
        time.sleep(30)

    m = RewardManager(cfg, build_char_tokenizer(), compute_score=slow)
    start = time.monotonic()
    with pytest.raises(RewardError, match=r"did not return within reward\.timeout_s=0\.5s on sample 0"):
        _call(m, ["x"])
    assert time.monotonic() - start < 5.0


def test_python_api_reward_functions_are_bounded_and_report_their_error():
    import asyncio

    from verl_lite.reward.functions import RewardFunctions

    async def judge(completions, **kwargs):
        await asyncio.sleep(30)

    def broken(completions, **kwargs):
        raise KeyError("no grader")

    start = time.monotonic()
    with pytest.raises(RewardError, match=r"reward functions judge did not return within reward\.timeout_s=0\.5s on a "
                                          r"batch of 1 samples"):
        RewardFunctions(judge, build_char_tokenizer(), timeout_s=0.5)([[1]], ["d"], ["x"])
    assert time.monotonic() - start < 5.0
    with pytest.raises(RewardError, match=r"reward functions broken raised KeyError: 'no grader' on a batch of 1"):
        RewardFunctions(broken, build_char_tokenizer(), timeout_s=5.0)([[1]], ["d"], ["x"])


def test_reward_kwargs_checked_against_the_signature(reward_file):
    path, _ = reward_file
    with pytest.raises(RewardConfigError, match=r"reward_kwargs=\{'bonus': 1\} do not fit .*unexpected keyword "
                                                r"argument 'bonus'"):
        _manager(path, bonus=1)


# ---------------------------------------------------------------- run directories


def test_run_dirs_are_fresh_and_latest_points_at_the_newest(tmp_path):
    from verl_lite.trainer.run_dir import make_run_dir

    now = time.time()
    a = make_run_dir(str(tmp_path / "out"), "exp/1", now=now)
    (a / "metrics.jsonl").write_text("first\n")
    b = make_run_dir(str(tmp_path / "out"), "exp/1", now=now)  # same second: a new directory all the same
    assert a != b and a.parent == b.parent and a.name.startswith("exp_1-") and b.name == a.name + "-2"
    assert (a / "metrics.jsonl").read_text() == "first\n" and not any(b.iterdir())
    assert (tmp_path / "out" / "latest").resolve() == b
    (tmp_path / "file").write_text("x")
    with pytest.raises(BadInput, match=r"trainer\.output_dir=.*cannot create"):
        make_run_dir(str(tmp_path / "file" / "out"), "exp")


# ---------------------------------------------------------------- zero learning signal


def test_zero_signal_warns_once_after_k_consecutive_steps():
    from verl_lite.trainer.signal_watch import ZeroSignalWatch

    def step(i, lo, hi, length=5.0):
        return {"step": i, "reward/min": lo, "reward/max": hi, "response_length/mean": length}

    w = ZeroSignalWatch(k=3)
    assert w.update({"step": 0, "val/accuracy": 0.5}) is None  # validation-only record
    assert [w.update(step(1, 0, 0)), w.update(step(2, 0, 0)), w.update(step(3, 0, 1))] == [None] * 3  # run broken
    assert w.update(step(4, 1, 1)) is None and w.update(step(5, 0, 1, length=1.0)) is None
    msg = w.update(step(6, 1, 1))
    assert msg and "3 consecutive steps (4-6)" in msg and "every reward was 1" in msg and "one token" in msg
    assert w.update(step(7, 1, 1)) is None  # once


def test_the_reward_process_ends_its_helpers_when_its_input_ends(tmp_path):
    """A driver SIGKILLed closes the reward process's input: the reward process exits, and its guard ends the
    helpers its file started (no driver left to end them)."""
    import pickle
    import subprocess
    import sys

    from verl_lite.reward.sandbox import CHILD
    from verl_lite.reward.sandbox_child import HEADER
    from verl_lite.utils.processes import GuardedProcess

    pids_file = tmp_path / "helpers"
    path = tmp_path / "import_helper.py"
    path.write_text(f"import subprocess\n_helper = subprocess.Popen(['sleep', '1000'])\n"
                    f"open({str(pids_file)!r}, 'w').write(str(_helper.pid))\n"
                    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    guard = GuardedProcess([sys.executable, "-u", str(CHILD)], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    proc = guard.proc
    try:
        data = pickle.dumps(("init", str(path), "compute_score", "naive", [], None))
        proc.stdin.write(HEADER.pack(len(data)) + data)
        proc.stdin.flush()
        (n,) = HEADER.unpack(proc.stdout.read(HEADER.size))
        assert pickle.loads(proc.stdout.read(n))[0] == "ready"
        helper = int(pids_file.read_text())
        assert psutil.pid_exists(helper)
        proc.stdin.close()  # the end of its input, and nothing else
        proc.wait(timeout=30)
        deadline = time.monotonic() + 5.0
        while psutil.pid_exists(helper) and psutil.Process(helper).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, f"the reward file's helper {helper} outlived the reward process"
            time.sleep(0.1)
    finally:
        guard.stop()


def test_a_reward_function_returning_none_adds_nothing_for_that_sample(capsys):
    """TRL's meaning: None = the function does not apply to the sample; the others' weighted scores are its reward
    (a sample no function scores gets 0, said once on stderr); the function's mean is over what it scored."""
    from verl_lite.reward.functions import RewardFunctions

    def only_odd(completions, **kwargs):
        return [1.0 if i % 2 else None for i in range(len(completions))]

    def format_ok(completions, **kwargs):
        return [0.5, None, 0.5, None]

    scorer = RewardFunctions([only_odd, format_ok], build_char_tokenizer(), [1.0, 2.0], timeout_s=5.0)
    scores, extra = scorer([[1]] * 4, ["d"] * 4, ["x"] * 4)
    assert scores.tolist() == [1.0, 1.0, 1.0, 1.0]  # 2 x 0.5, 1.0, 2 x 0.5, 1.0
    assert [x != x for x in extra["only_odd"]] == [True, False, True, False]  # NaN where it did not apply
    assert "returned None" not in capsys.readouterr().err
    nothing = RewardFunctions([lambda completions, **k: [None, 1.0]], build_char_tokenizer(), timeout_s=5.0)
    assert nothing([[1]] * 2, ["d"] * 2, ["x"] * 2)[0].tolist() == [0.0, 1.0]
    nothing([[1]] * 2, ["d"] * 2, ["x"] * 2)
    assert capsys.readouterr().err.count("returned None for 1 of 2 samples") == 1


FORKING_PARENT = """
import multiprocessing, os, sys, time
from verl_lite.utils.processes import forked_children_die_with_parent

def child(pid_file):
    open(pid_file, "w").write(str(os.getpid()))
    time.sleep(120)

if __name__ == "__main__":
    ctx = multiprocessing.get_context("fork")  # as megatron forks its checkpoint writers
    outside = ctx.Process(target=child, args=(sys.argv[1] + ".outside",))
    outside.start()
    with forked_children_die_with_parent():
        inside = ctx.Process(target=child, args=(sys.argv[1] + ".inside",))
        inside.start()
        time.sleep(120)  # killed here, while it waits for its child
"""


def test_a_child_forked_inside_the_block_dies_with_its_killed_parent(tmp_path):
    """``forked_children_die_with_parent`` (around megatron's save, which forks writers and waits for them): SIGKILL
    of the parent takes the child forked inside the block down; one forked outside it lives on (the control)."""
    import subprocess
    import sys

    script, pid_file = tmp_path / "parent.py", tmp_path / "child"
    script.write_text(FORKING_PARENT)
    parent = subprocess.Popen([sys.executable, str(script), str(pid_file)])
    inside, outside = (Path(f"{pid_file}.{where}") for where in ("inside", "outside"))
    deadline = time.time() + 60
    while not (inside.exists() and outside.exists() and inside.read_text() and outside.read_text()):
        assert time.time() < deadline and parent.poll() is None, "the parent never forked its two children"
        time.sleep(0.05)
    children = [psutil.Process(int(f.read_text())) for f in (inside, outside)]
    parent.kill()
    parent.wait(10)
    try:
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert [p.pid for p in gone] == [children[0].pid], (gone, alive)
        assert [p.pid for p in alive] == [children[1].pid]
    finally:
        for p in children:
            with contextlib.suppress(psutil.Error):
                p.kill()
