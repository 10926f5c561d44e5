"""The asynchronous pipeline's faults through the real CLI (``python -m verl_lite.trainer.main_ppo``,
split placement, staleness 1): a rollout worker SIGKILLed mid-run, a weight sync past its bound, and a
queue that starves because the rollout pool stopped answering (SIGSTOP). Each run ends with exit 1,
one message naming what failed and the key that bounds it, no traceback, within the bound plus a fixed
slack, and no process of the run left behind."""

import json
import signal
import time

import psutil
import pytest

from tests.faults.conftest import (CliRun, check_clean_exit, tiny_assets, tiny_overrides,  # noqa: F401
                                   wait_for_run)

SLACK_S = 30.0  # teardown (workers, Ray) on a loaded 2-core machine, on top of each fault's own bound
SPLIT = {"actor_rollout_ref.hybrid_engine": "false", "async_training.staleness_threshold": 1,
         "trainer.val_before_train": "false", "trainer.test_freq": -1, "trainer.logger": "[jsonl]",
         "trainer.total_training_steps": 64}


def _start(assets, tmp_path, **extra) -> tuple[CliRun, object]:
    out = tmp_path / "out"
    return CliRun(tiny_overrides(assets, **{**SPLIT, "trainer.output_dir": str(out), **extra})), out


def _steps_done(out) -> int:
    """RL steps the run has logged to its metrics.jsonl so far."""
    files = list(out.glob("*/metrics.jsonl"))
    if not files:
        return 0
    return sum(1 for line in files[0].read_text().splitlines() if '"step"' in line and json.loads(line).get("step"))


def _rollout_worker(run: CliRun) -> psutil.Process | None:
    """The rollout pool's worker process (Ray titles an actor's process ``ray::<Class>...``)."""
    for p in psutil.Process(run.proc.pid).children(recursive=True):
        try:
            if " ".join(p.cmdline()).startswith("ray::RolloutWorker"):
                return p
        except psutil.Error:
            continue
    return None


STREAMED = {"trainer.v1.trainer_mode": "separate_async"}


@pytest.mark.parametrize("mode", [{}, STREAMED], ids=["one_step_off", "streamed"])
def test_a_dead_rollout_worker_stops_the_run(mode, tiny_assets, tmp_path):  # noqa: F811
    run, out = _start(tiny_assets, tmp_path, **mode)
    wait_for_run(lambda: _steps_done(out) >= 1, run, 300, "the first RL step")
    victim = wait_for_run(lambda: _rollout_worker(run), run, 10, "finding the rollout worker")
    killed_at = time.time()
    victim.kill()
    run.wait(timeout=300)
    check_clean_exit(run, 1, r"rollout.* died")
    assert run.ended - killed_at <= SLACK_S


def test_a_weight_sync_past_its_bound_stops_the_run(tiny_assets, tmp_path):  # noqa: F811
    """1 ms cannot hold an export of the actor's weights: the first sync (after step 1) passes its bound."""
    run, out = _start(tiny_assets, tmp_path, **{"async_training.weight_sync_timeout_s": 0.001})
    run.wait(timeout=300)
    check_clean_exit(run, 1, r"did not finish within async_training\.weight_sync_timeout_s=0\.001s")
    assert _steps_done(out) <= 1


STARVING = {  # mode: (its keys, what ends the run)
    "one_step_off": ({"async_training.weight_sync_timeout_s": 600},
                     r"no rollout batch arrived within async_training\.queue_timeout_s=5s \(the queue starved; "
                     r"the rollout pool has been busy with"),
    # the stream's weight sync runs on the trainer's thread: whichever bound comes first ends the run
    "streamed": ({**STREAMED, "async_training.weight_sync_timeout_s": 5},
                 r"(prompt groups it needs were complete after async_training\.queue_timeout_s=5s|"
                 r"did not finish within async_training\.weight_sync_timeout_s=5s)"),
}


@pytest.mark.parametrize("mode", sorted(STARVING))
def test_a_starving_queue_stops_the_run(mode, tiny_assets, tmp_path):  # noqa: F811
    """The rollout worker stops answering (SIGSTOP): the trainer's wait for its next batch (bounded by
    ``queue_timeout_s``) ends the run, naming what the pool was busy with; the stream's weight sync may come first."""
    bound = 5.0
    keys, expected = STARVING[mode]
    run, out = _start(tiny_assets, tmp_path, **{"async_training.queue_timeout_s": bound, **keys})
    wait_for_run(lambda: _steps_done(out) >= 1, run, 300, "the first RL step")
    victim = wait_for_run(lambda: _rollout_worker(run), run, 10, "finding the rollout worker")
    stopped_at = time.time()
    victim.send_signal(signal.SIGSTOP)
    try:
        run.wait(timeout=300)
    finally:
        if victim.is_running():
            victim.send_signal(signal.SIGCONT)
    check_clean_exit(run, 1, expected)
    assert run.ended - stopped_at <= bound + SLACK_S

