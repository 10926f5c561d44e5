"""Losing a worker node during a step (its raylet SIGKILLed by pid) on a local 2-node cluster: the
CLI (``main_ppo.main``) exits 1 with ONE error naming the node and the roles it hosted, well within
the bound (the cluster's node health check, ~1.5 s here, far below ``trainer.worker_timeout_s``);
no process of the lost node or of the job is left; the last complete checkpoint is intact; and
``trainer.resume_mode=auto`` with ``trainer.nnodes=1`` continues from it on the surviving node."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
import time

import psutil

from tests.multinode.conftest import wait_gone
from tests.multinode.test_multinode import shipped_overrides

STEPS = 6  # the node is lost long before the last step
BOUND_S = 30.0  # node health check (~1.5 s) + tear-down; trainer.worker_timeout_s is 120


def _job_workers(node) -> list[int]:
    """The worker processes (not the agents) the node's raylet runs now."""
    out = []
    with contextlib.suppress(psutil.Error):
        raylet = psutil.Process(node.all_processes["raylet"][0].process.pid)
        for c in raylet.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                title = " ".join(c.cmdline()).strip()
                if title.startswith("ray::") and not title.endswith("Agent"):  # workers, not the node's agents
                    out.append(c.pid)
    return out


def test_lost_node_one_error_nothing_left_checkpoint_resumes(cluster, tiny_assets, tmp_path, capsys):
    from verl_lite.trainer import main_ppo
    from verl_lite.trainer.checkpointing import is_complete, latest_checkpoint, step_of, verify_checkpoint

    ckpt = tmp_path / "ckpt"
    common = {"trainer.save_freq": 1, "trainer.default_local_dir": str(ckpt), "trainer.test_freq": 0,
              "trainer.val_before_train": False, "trainer.output_dir": str(tmp_path / "runs")}
    lost_node = cluster.workers[0]
    seen: dict = {}

    def kill_worker_node_after_first_checkpoint():
        deadline = time.monotonic() + 300
        while not is_complete(ckpt / "global_step_1") and time.monotonic() < deadline:
            time.sleep(0.05)
        seen["pids"] = cluster.node_pids(lost_node)  # raylet, agents, and the job's worker on that node
        seen["head_workers"] = _job_workers(cluster.cluster.head_node)
        seen["t"] = time.monotonic()
        os.kill(cluster.raylet_pid(lost_node), signal.SIGKILL)

    killer = threading.Thread(target=kill_worker_node_after_first_checkpoint, daemon=True)
    killer.start()
    rc = main_ppo.main(shipped_overrides(tiny_assets, **common, **{
        "trainer.nnodes": 2, "trainer.n_gpus_per_node": 1, "trainer.total_training_steps": STEPS,
        "trainer.worker_timeout_s": 120, "trainer.experiment_name": "lost"}))
    elapsed = time.monotonic() - seen["t"]
    killer.join(1)
    err = capsys.readouterr().err
    print(f"lost node reported after {elapsed:.1f} s:\n{err}")
    assert rc == 1, err
    node = lost_node.node_id
    lost = re.findall(r"node ([0-9a-f]{12}) \(127\.0\.0\.1\) was lost during actor's '\w+': it hosted actor rank \[[01]\]",
                      err)
    assert lost == [node[:12]], err  # ONE error, naming the node and the role (and rank) it hosted
    assert "Traceback" not in err
    assert elapsed < BOUND_S, elapsed
    # nothing left: the lost node's processes (its worker exits by itself once its raylet is gone) and the
    # job's workers on the surviving node
    left = wait_gone(seen["pids"] + seen["head_workers"], 15)
    assert not left, [(p, " ".join(psutil.Process(p).cmdline())[:80]) for p in left]
    assert seen["head_workers"], "the surviving node ran a worker of the job"
    # the last complete checkpoint is intact (a step interrupted mid-save leaves only a .tmp-* directory)
    last = latest_checkpoint(ckpt)
    k = step_of(last)
    assert 1 <= k < STEPS
    verify_checkpoint(last)
    # resume on the surviving node: one worker, the checkpoint resharded from DP2
    state = main_ppo.RunState()
    main_ppo.run(shipped_overrides(tiny_assets, **common, **{
        "trainer.nnodes": 1, "trainer.n_gpus_per_node": 1, "trainer.total_training_steps": k + 1,
        "trainer.resume_mode": "auto", "trainer.experiment_name": "resumed"}), state)
    rows = [json.loads(line) for line in (state.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [k + 1]
    assert is_complete(ckpt / f"global_step_{k + 1}")
