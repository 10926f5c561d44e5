"""Bounded waits: a peer that raises alone, or dies, becomes an error on the others within the
configured process-group timeout (``MegatronConfig.timeout_s``), never a 30-minute hang.

Two DP ranks train one step; rank 1 fails inside its loss function (so it never joins the
gradient all-reduce). Rank 0 must raise, and it must do so within timeout_s plus slack.
"""

from __future__ import annotations

import json
import os
import signal
import time
from functools import partial
from pathlib import Path

import pytest
import torch

from tests.fork_ranks import context, with_launch_env
from verl_lite.utils.net import free_port as _free_port

TIMEOUT_S = 10.0
SLACK_S = 20.0


def _failing_loss(kind: str, rank: int, outputs, data):
    if rank == 1:
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise ValueError("rank 1 loss function failed on purpose")
    lp = outputs["log_probs"]
    m = data["response_mask"]
    return (lp * m).sum() / 100.0, {}


def _rank(rank: int, port: int, model_dir: str, kind: str, out_dir: str):
    torch.set_num_threads(1)
    from verl_lite.engine.config import EngineConfig, OptimConfig
    from verl_lite.engine.distributed import init_distributed
    from verl_lite.engine.config import MegatronConfig
    from verl_lite.engine.engine import MegatronEngine, SequenceBatch

    par = MegatronConfig.layout(timeout_s=TIMEOUT_S)
    init_distributed(rank, 2, "127.0.0.1", port, par)
    engine = MegatronEngine(EngineConfig(model_dir, par, OptimConfig(lr=1e-3)))
    g = torch.Generator().manual_seed(rank)
    ids = [torch.randint(1, 64, (n,), generator=g) for n in (7, 9)]
    batch = SequenceBatch(ids, torch.tensor([3, 4]), {"response_mask": torch.ones(2, 4)})
    outcome = {"rank": rank}
    start = time.monotonic()
    try:
        engine.train_step(batch, [[0], [1]], partial(_failing_loss, kind, rank))
        outcome["error"] = None
    except Exception as e:  # noqa: BLE001 - the point is to see it
        outcome["error"] = f"{type(e).__name__}: {e}"[:500]
    outcome["elapsed"] = time.monotonic() - start
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(outcome))
    if rank == 1:
        time.sleep(120)  # stay alive and silent, like a worker whose task raised
    os._exit(0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from verl_lite.utils.tiny_model import make_tiny_hf_model

    return str(make_tiny_hf_model(tmp_path_factory.mktemp("fail") / "m", "qwen2", vocab_size=64, hidden_size=32,
                                  num_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  intermediate_size=64, seed=0))


@pytest.mark.parametrize("kind", ["raise", "kill"])
def test_peer_failure_surfaces_within_timeout(kind, model_dir, tmp_path):
    ctx = context()  # tests/fork_ranks.py
    port = _free_port()
    procs = [ctx.Process(target=with_launch_env, args=(r, dict(os.environ), _rank, (port, model_dir, kind, str(tmp_path))))
             for r in range(2)]
    for p in procs:
        p.start()
    try:
        procs[0].join(timeout=120)
        assert not procs[0].is_alive(), "rank 0 is still waiting: the failure did not surface"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()  # only the processes this test started
            p.join(timeout=10)
    out0 = json.loads((tmp_path / "rank0.json").read_text())
    assert out0["error"] is not None, "rank 0 finished the step although its peer failed"
    assert out0["elapsed"] < TIMEOUT_S + SLACK_S, out0
    if kind == "raise":
        out1 = json.loads((tmp_path / "rank1.json").read_text())
        assert "failed on purpose" in out1["error"]
    else:
        assert procs[1].exitcode == -signal.SIGKILL
