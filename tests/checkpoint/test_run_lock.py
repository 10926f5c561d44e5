"""One run per checkpoint directory (``verl_lite.trainer.run_lock``).

Through the CLI: while a run that saves checkpoints is alive, a second run given the same
``trainer.default_local_dir`` stops with exit 2 before any worker starts, naming the first run's pid;
after the first is SIGKILLed its lock file is stale text and a new run takes the lock, trains and, on
exit, releases it. At process level: a killed holder never blocks, even when a child it started
(exec'd or merely forked) outlives it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests.checkpoint.conftest import REPO, Run, overrides, run_to_end, wait_for
from verl_lite.trainer.run_lock import LOCK_NAME, CheckpointDirInUse, RunLock, read_holder

HOLDER = textwrap.dedent("""
    import os, subprocess, sys, time
    from verl_lite.trainer.run_lock import RunLock
    RunLock(sys.argv[1]).acquire()
    exec_child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    fork_child = os.fork()
    if fork_child == 0:
        os.write(1, b"forked\\n")  # os.fork() has returned here: the at-fork handlers have run
        time.sleep(120)
        os._exit(0)
    os.write(1, f"children {exec_child.pid} {fork_child}\\n".encode())  # one write each: print's two interleave
    time.sleep(120)
""")


def _holder_pid(lock_file) -> int | None:
    return read_holder(lock_file).get("pid") if lock_file.is_file() else None


def test_a_killed_holder_does_not_block_even_with_children_alive(tmp_path):
    ckpt = tmp_path / "ckpt"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(ckpt)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    lines = [holder.stdout.readline().split(), holder.stdout.readline().split()]
    children = [int(p) for line in lines if line[:1] == ["children"] for p in line[1:]]
    try:
        assert sorted(line[0] for line in lines if line) == ["children", "forked"], lines
        with pytest.raises(CheckpointDirInUse, match=rf"in use by another run: pid {holder.pid} on host "):
            RunLock(ckpt).acquire()
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
        assert all(os.path.exists(f"/proc/{c}") for c in children), "the children must outlive the holder here"
        assert _holder_pid(ckpt / LOCK_NAME) == holder.pid  # the stale record is still there ...
        with RunLock(ckpt) as lock:  # ... and does not block
            assert lock.held and _holder_pid(ckpt / LOCK_NAME) == os.getpid()
        assert (ckpt / LOCK_NAME).read_text() == "", "release empties the holder record"
    finally:
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        holder.kill()


def test_a_second_run_on_the_same_checkpoint_dir_is_refused_until_the_first_is_gone(tiny_assets, tmp_path):
    ckpt = tmp_path / "ckpt"
    lock_file = ckpt / LOCK_NAME
    first = Run(overrides(tiny_assets, tmp_path, **{"trainer.output_dir": str(tmp_path / "out1"),
                                                    "trainer.n_gpus_per_node": 1}), tmp_path / "first.log")
    try:
        locked = wait_for(lambda: _holder_pid(lock_file) == first.proc.pid, timeout=120, poll=0.05)
        assert locked, f"the first run never took the lock:\n{first.text()[-3000:]}"

        second = Run(overrides(tiny_assets, tmp_path, **{"trainer.output_dir": str(tmp_path / "out2")}),
                     tmp_path / "second.log")
        rc = second.wait(120)
        text = second.text()
        assert rc == 2, f"rc={rc}:\n{text[-3000:]}"
        assert f"trainer.default_local_dir='{ckpt}' is in use by another run: pid {first.proc.pid} on host" in text
        assert "Traceback" not in text, text[-3000:]
        summary = json.loads(next((tmp_path / "out2").glob("*/summary.json")).read_text())
        assert summary["status"] == "failed" and summary["startup_s"] is None, "no worker may have started"
        assert first.proc.poll() is None, "the first run must be unaffected"
    finally:
        first.kill()

    assert _holder_pid(lock_file) == first.proc.pid, "a SIGKILLed holder leaves its record behind"
    third = overrides(tiny_assets, tmp_path, **{"trainer.output_dir": str(tmp_path / "out3"),
                                                "trainer.total_training_steps": 1, "trainer.save_freq": 1,
                                                "trainer.n_gpus_per_node": 1, "trainer.resume_mode": "disable"})
    text = run_to_end(third, tmp_path / "third.log")
    assert "in use" not in text
    assert (ckpt / "global_step_1" / "complete").is_file()
    assert lock_file.read_text() == "", "the run released the lock on exit"
    with RunLock(ckpt):
        pass
    # the same command again: the checkpoint is the finished run's; it says so and trains nothing
    again = [o for o in third if not o.startswith("trainer.resume_mode=")] + ["trainer.resume_mode=auto",
                                                                               f"trainer.output_dir={tmp_path / 'out4'}"]
    text = run_to_end(again, tmp_path / "again.log")
    assert "the checkpoint is at step 1 of 1: the run had finished, nothing is trained" in text, text[-3000:]
    assert sorted(p.name for p in ckpt.glob("global_step_*")) == ["global_step_1"]
