"""A short GRPO run of a tiny Qwen3-MoE from the command line (``python -m verl_lite.trainer.main_ppo``)
with the router losses on, in three layouts: 1 worker, 4 workers with expert parallelism 2 x
pipeline parallelism 2 (router losses on both stages), and 2 workers with a virtual pipeline
(PP2 x VPP2, four model chunks). Per-prompt seeds make the rollouts identical, so the first
optimizer step (its policy loss, router loss and grad norm) must agree (rel 1e-5). A bf16 run of
the same job must train (its first update close to fp32's within the bf16 tolerance, not equal). PPO with a
MoE critic (a value head on the MoE body) gives the same actor and critic updates with EP2. Routing replay R3
(``router_replay.mode=R3``: the HF rollout records each token's experts, the actor's forwards replay them) with EP2
gives the 1-worker run's first update (fp32: the trainer's routers agree with the rollout's on every token) and
reports the per-layer routing mismatch, 0 here. R2 (the update replays the routing its old-log-prob pass chose; two
epochs, so that pass runs) trains and reports the mismatch of the update's routers against that pass."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.conftest import tiny_overrides

REPO = Path(__file__).resolve().parents[2]
M = "actor_rollout_ref.actor.megatron"
R3 = ["actor_rollout_ref.actor.router_replay.mode=R3", "actor_rollout_ref.rollout.enable_rollout_routing_replay=true"]
LAYOUTS = {
    "1": [],
    "ep2_pp2": ["trainer.n_gpus_per_node=4", f"{M}.expert_model_parallel_size=2", f"{M}.pipeline_model_parallel_size=2"],
    "pp2_vpp2": ["trainer.n_gpus_per_node=2", f"{M}.pipeline_model_parallel_size=2",
                 f"{M}.virtual_pipeline_model_parallel_size=2"],
    "bf16": [f"{M}.dtype=bfloat16"],
    "ep2": ["trainer.n_gpus_per_node=2", f"{M}.expert_model_parallel_size=2",
            "critic.megatron.expert_model_parallel_size=2"],
    "r3_ep2": ["trainer.n_gpus_per_node=2", f"{M}.expert_model_parallel_size=2", *R3],
    "r2_ep2": ["trainer.n_gpus_per_node=2", f"{M}.expert_model_parallel_size=2",
               "actor_rollout_ref.actor.router_replay.mode=R2", "actor_rollout_ref.actor.ppo_epochs=2"],
    "r3_stream": [*R3, "actor_rollout_ref.hybrid_engine=false", "trainer.use_v1=true",
                  "trainer.v1.trainer_mode=separate_async"],
}
BF16_TOL = 0.072  # tests/parity/test_bf16_parity.py: 2 * 2^-8 * sqrt(86), relative


@pytest.fixture(scope="module")
def moe_model(tiny_assets, tmp_path_factory):
    from verl_lite.data import save_char_tokenizer
    from verl_lite.utils.tiny_model import make_tiny_moe_model

    model = make_tiny_moe_model(tmp_path_factory.mktemp("moe_e2e") / "model", "qwen3_moe", vocab_size=104,
                                hidden_size=32, num_layers=4, num_experts=4, top_k=2, moe_intermediate_size=16, seed=1)
    save_char_tokenizer(model)
    return str(model)


_runs: dict[str, dict] = {}
# every run the tests below compare, largest first: the module's first test starts them two at a time
# (a run's start-up and its 1- and 2-worker phases leave a core idle, which the other run uses)
RUNS = [("ep2_pp2", "grpo"), ("ep2", "gae"), ("pp2_vpp2", "grpo"), ("r3_ep2", "grpo"), ("r2_ep2", "grpo"),
        ("r3_stream", "grpo"), ("1", "grpo"), ("1", "gae"), ("bf16", "grpo")]


def _all_runs(assets, model: str, tmp_path_factory) -> None:
    from concurrent.futures import ThreadPoolExecutor

    def launch(key):
        try:
            _launch(*key, assets, model, tmp_path_factory)
        except BaseException as err:  # noqa: BLE001 - raised again by the test that reads this run
            _runs[key] = err

    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(launch, [k for k in RUNS if k not in _runs]))


def first_update(layout: str, assets, model: str, tmp_path_factory, estimator: str = "grpo") -> dict:
    if (layout, estimator) not in _runs:
        _all_runs(assets, model, tmp_path_factory)
    if (layout, estimator) not in _runs:
        _launch(layout, estimator, assets, model, tmp_path_factory)
    result = _runs[layout, estimator]
    if isinstance(result, BaseException):
        raise result
    return result


def _launch(layout: str, estimator: str, assets, model: str, tmp_path_factory) -> None:
    out = tmp_path_factory.mktemp(f"moe_cli_{layout}_{estimator}")
    args = tiny_overrides(
        assets, **{"actor_rollout_ref.model.path": model, "algorithm.adv_estimator": estimator,
                   "actor_rollout_ref.actor.ppo_mini_batch_size": 4, "trainer.total_training_steps": 1,
                   "trainer.test_freq": -1, "trainer.val_before_train": False, "trainer.output_dir": str(out),
                   "actor_rollout_ref.actor.entropy_coeff": 0.01}
    ) + [f"+{M}.override_transformer_config.moe_aux_loss_coeff=0.05",
         f"+{M}.override_transformer_config.moe_z_loss_coeff=0.001", *LAYOUTS[layout]]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "verl_lite.trainer.main_ppo", *args], cwd=out, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    lines = [json.loads(x) for x in next(out.rglob("metrics.jsonl")).read_text().splitlines()]
    trained = [s for s in lines if "actor/grad_norm" in s]
    assert len(trained) == 1, lines
    _runs[layout, estimator] = trained[0]


@pytest.mark.parametrize("layout", ["ep2_pp2", "pp2_vpp2", "r3_ep2"])
def test_moe_grpo_first_update_is_the_same_in_other_layouts(tiny_assets, moe_model, tmp_path_factory, layout):
    ref = first_update("1", tiny_assets, moe_model, tmp_path_factory)
    other = first_update(layout, tiny_assets, moe_model, tmp_path_factory)
    for k in ("reward/mean", "response_length/mean"):
        assert other[k] == ref[k], k  # the same rollouts
    for k in ("actor/loss", "actor/router_loss", "actor/router_aux_loss", "actor/router_z_loss", "actor/grad_norm"):
        print(f"{k}: 1 worker {ref.get(k)!r}, {layout} {other.get(k)!r}")
        assert k in ref and k in other, (k, sorted(ref))
        assert abs(other[k] - ref[k]) <= 1e-5 * max(abs(ref[k]), 1e-12), (k, other[k], ref[k])
    assert ref["actor/router_loss"] > 1e-4 and ref["actor/grad_norm"] > 1e-6, "the check needs a non-trivial update"
    replayed = "actor/routing_mismatch" in other
    assert replayed == (layout == "r3_ep2"), sorted(other)
    if replayed:  # every layer's tokens compared, none routed otherwise by the trainer than by the rollout
        assert [other[f"actor/routing_mismatch/layer_{layer}"] for layer in range(4)] == [0.0] * 4


def test_routing_replay_r2_replays_the_old_log_prob_pass_routing(tiny_assets, moe_model, tmp_path_factory):
    row = first_update("r2_ep2", tiny_assets, moe_model, tmp_path_factory)
    assert row["actor/old_log_prob_recomputed"] == 1.0 and row["actor/num_updates"] == 2, sorted(row)
    assert "rollout/routing_mismatch" not in row  # R2 replays nothing of the rollout's
    for layer in range(4):  # the update's routers against the recorded pass: the same weights at the first step
        assert 0.0 <= row[f"actor/routing_mismatch/layer_{layer}"] <= 0.05, row
    assert math.isfinite(row["actor/grad_norm"]) and row["actor/grad_norm"] > 0


def test_routing_replay_r3_streams(tiny_assets, moe_model, tmp_path_factory):
    """R3 with streamed partial rollouts (the rollout pool's agent-loop stream, trajectories carrying their routing
    per segment): trains, replaying every recorded token (the mismatch of the update's routers is reported)."""
    row = first_update("r3_stream", tiny_assets, moe_model, tmp_path_factory)
    assert all(0.0 <= row[f"actor/routing_mismatch/layer_{layer}"] <= 0.05 for layer in range(4)), row
    assert math.isfinite(row["actor/grad_norm"]) and row["actor/grad_norm"] > 0


def test_moe_grpo_trains_in_bf16(tiny_assets, moe_model, tmp_path_factory):
    ref = first_update("1", tiny_assets, moe_model, tmp_path_factory)
    bf16 = first_update("bf16", tiny_assets, moe_model, tmp_path_factory)
    for k in ("actor/router_loss", "actor/grad_norm"):
        print(f"{k}: fp32 {ref[k]!r}, bf16 {bf16[k]!r}")
        assert bf16[k] != ref[k], f"{k}: bf16 equals fp32 bit for bit; the dtype did not reach the engine"
        assert abs(bf16[k] - ref[k]) <= BF16_TOL * abs(ref[k]), (k, bf16[k], ref[k])


def test_moe_ppo_with_a_moe_critic_is_the_same_with_expert_parallelism(tiny_assets, moe_model, tmp_path_factory):
    """PPO: the critic is built from the same MoE checkpoint (a value head on the MoE body); with EP2 both
    the actor's and the critic's first updates equal the 1-worker run's."""
    ref = first_update("1", tiny_assets, moe_model, tmp_path_factory, estimator="gae")
    other = first_update("ep2", tiny_assets, moe_model, tmp_path_factory, estimator="gae")
    for k in ("actor/loss", "actor/router_loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm"):
        print(f"{k}: 1 worker {ref.get(k)!r}, EP2 {other.get(k)!r}")
        assert k in ref and k in other, (k, sorted(ref))
        assert abs(other[k] - ref[k]) <= 1e-5 * max(abs(ref[k]), 1e-12), (k, other[k], ref[k])
