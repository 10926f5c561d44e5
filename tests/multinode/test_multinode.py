"""2-node jobs on a local 2-node Ray cluster (head + one worker node, 1 CPU each, loopback only),
joined through ``RAY_ADDRESS`` by the CLI's own ``main_ppo.run``, as a job on a real cluster joins it.

- placement: ``trainer.nnodes=N trainer.n_gpus_per_node=G`` puts G ranks on each of N distinct nodes,
  ranks ordered node by node, and the rendezvous address is rank 0's node address;
- DP2, TP2 and PP2 across the two nodes (one rank per node): the first update (loss, grad norm) and the
  step's rewards equal the 1-node, 1-worker run's within 1e-6 (same seed: same rollouts);
- the DP2 run's checkpoint (written by both nodes' workers into a directory every node sees) resumes on
  ONE node (``trainer.nnodes=1``, one worker: resharded) and continues with step 2.
"""

from __future__ import annotations

import json

import pytest

from tests.e2e.conftest import tiny_overrides

GRPO = {"algorithm.adv_estimator": "grpo", "actor_rollout_ref.actor.entropy_coeff": 0.01}
ONE_STEP = {"trainer.total_training_steps": 1, "trainer.test_freq": 0, "trainer.val_before_train": False}
LAYOUTS = {
    "1node": {"trainer.nnodes": 1, "trainer.n_gpus_per_node": 1},
    "dp2": {"trainer.nnodes": 2, "trainer.n_gpus_per_node": 1},
    "tp2": {"trainer.nnodes": 2, "trainer.n_gpus_per_node": 1,
            "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": 2},
    "pp2": {"trainer.nnodes": 2, "trainer.n_gpus_per_node": 1,
            "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size": 2},
}
_runs: dict = {}


def shipped_overrides(assets, **extra) -> list[str]:
    """The shipped checkpoint and data with the built-in verifier (as tests/e2e/test_layouts.py)."""
    from verl_lite.config import default_data_files, default_model_path

    train, val = default_data_files()
    shipped = {"actor_rollout_ref.model.path": default_model_path(), "data.train_files": train[0],
               "data.val_files": val[0], "reward.custom_reward_function.path": "null",
               "data.max_response_length": 10}
    return tiny_overrides(assets, **shipped, **GRPO, **extra)


def run_job(assets, tmp_root, name: str, **extra):
    """``main_ppo.run`` (the CLI's run) of one job on the cluster; (metrics history, actor updates, run dir)."""
    if name not in _runs:
        from verl_lite.trainer import main_ppo

        state = main_ppo.RunState()
        overrides = shipped_overrides(assets, **{**ONE_STEP, "trainer.output_dir": str(tmp_root / "runs"),
                                                 "trainer.experiment_name": name, **extra})
        main_ppo.run(overrides, state)
        rows = [json.loads(line) for line in (state.run_dir / "metrics.jsonl").read_text().splitlines()]
        _runs[name] = (rows, state.trainer.update_history, state.run_dir)
    return _runs[name]


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory):
    return tmp_path_factory.mktemp("multinode")  # one file system every node of the local cluster sees


def test_placement_per_node_and_rendezvous_on_rank0s_node(cluster):
    """G ranks on each of N nodes, node by node; MASTER_ADDR = rank 0's node address; a job asking
    for more nodes than the cluster has is refused at once, naming trainer.nnodes; loopback only."""
    import ray

    from verl_lite.controller import ResourcePool, Worker, WorkerGroup, start_ray
    from verl_lite.controller.resource_pool import node_address

    class Probe(Worker):
        def where(self):
            import os
            return self.node_id(), os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])

    start_ray()
    pool = ResourcePool(4, nnodes=2)
    group = WorkerGroup(Probe, 4, pool=pool, timeout_s=120, name="probe")
    try:
        where = group.call_all("where")
        nodes = [w[0] for w in where]
        assert nodes[0] == nodes[1] != nodes[2] == nodes[3], nodes  # ranks 0,1 on one node, 2,3 on the other
        assert nodes == [pool.node_of(r) for r in range(4)]
        assert {n["NodeID"] for n in ray.nodes() if n["Alive"]} == set(nodes)
        assert all(w[1:] == (node_address(nodes[0]), group.master_port) for w in where)
        assert pool.roles_on(nodes[2]) == {"probe": [2, 3]}
    finally:
        group.shutdown()
        pool.remove()
    with pytest.raises(RuntimeError, match=r"trainer.nnodes=3 but the Ray cluster has 2 alive node"):
        ResourcePool(3, nnodes=3)
    listening = cluster.listening()
    assert listening and all(ip in ("127.0.0.1", "::1", "::ffff:127.0.0.1") for ip, _ in listening), listening


@pytest.mark.parametrize("layout", ["dp2", "tp2", "pp2"])
def test_first_update_across_nodes_equals_one_node(cluster, tiny_assets, tmp_root, layout):
    extra = {"trainer.save_freq": 1, "trainer.default_local_dir": str(tmp_root / "ckpt_dp2")} if layout == "dp2" else {}
    ref_rows, ref_updates, _ = run_job(tiny_assets, tmp_root, "1node", **LAYOUTS["1node"])
    rows, updates, _ = run_job(tiny_assets, tmp_root, layout, **LAYOUTS[layout], **extra)
    assert [r["step"] for r in rows] == [r["step"] for r in ref_rows] == [1]
    for k in ("reward/mean", "reward/max", "reward/min", "response_length/mean"):
        assert rows[0][k] == ref_rows[0][k], k
    first, ref = updates[0][0], ref_updates[0][0]
    print(f"{layout}: loss {first['loss']!r} vs {ref['loss']!r}, grad_norm {first['grad_norm']!r} vs {ref['grad_norm']!r}")
    assert abs(ref["loss"]) > 1e-6 and ref["grad_norm"] > 1e-6, "the check needs a non-trivial update"
    for k in ("loss", "grad_norm"):  # within 1e-6, and within 1e-5 of the value
        assert abs(first[k] - ref[k]) < min(1e-6, 1e-5 * abs(ref[k])), (k, first[k], ref[k])


def test_two_node_checkpoint_resumes_on_one_node(cluster, tiny_assets, tmp_root):
    from verl_lite.trainer.checkpointing import is_complete, verify_checkpoint

    run_job(tiny_assets, tmp_root, "dp2", **LAYOUTS["dp2"], **{"trainer.save_freq": 1,
                                                               "trainer.default_local_dir": str(tmp_root / "ckpt_dp2")})
    ckpt = tmp_root / "ckpt_dp2" / "global_step_1"
    assert is_complete(ckpt)
    verify_checkpoint(ckpt)  # every file of the manifest, written by the workers of both nodes and the driver
    assert (ckpt / "huggingface" / "model.safetensors").is_file()
    rows, updates, _ = run_job(tiny_assets, tmp_root, "resume_1node", **LAYOUTS["1node"], **{
        "trainer.total_training_steps": 2, "trainer.resume_mode": "auto", "trainer.save_freq": 1,
        "trainer.default_local_dir": str(tmp_root / "ckpt_dp2")})
    assert [r["step"] for r in rows] == [2]  # continued after the 2-node run's step 1
    assert len(updates) == 1 and all(abs(s["grad_norm"]) > 0 for s in updates[0])
    assert is_complete(tmp_root / "ckpt_dp2" / "global_step_2")
