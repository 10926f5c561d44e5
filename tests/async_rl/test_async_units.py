"""Pure units of the asynchronous pipeline (no Ray): the rollout-correction math against verl's formulas
written out independently in float64, and the pipeline's staleness accounting with stub generate/load."""

import math
import threading

import pytest
import torch

from verl_lite.algorithms.rollout_correction import rollout_correction
from verl_lite.algorithms.config import RolloutCorrectionConfig
from verl_lite.controller.pipeline import PipelineError, RolloutPipeline


# algorithm.rollout_correction's defaults (from the schema) as the math's keyword arguments, the starting point of
# each case's settings
OFF = {k: v for k, v in vars(RolloutCorrectionConfig()).items()
       if k not in ("bypass_mode", "loss_type", "rejected_in_denominator")}


def _case():
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(3, 5, generator=g, dtype=torch.float64) * 2
    roll = old + (torch.rand(3, 5, generator=g, dtype=torch.float64) - 0.5) * 2.0
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 1, 1, 0]], dtype=torch.float64)
    return old, roll, mask


def test_token_and_sequence_is_match_verl_formulas():
    old, roll, mask = _case()
    C = 2.0
    out = rollout_correction(old, roll, mask, **{**OFF, "rollout_is": "token", "rollout_is_threshold": C})
    for i in range(3):
        for t in range(5):
            want = min(math.exp(max(-20.0, min(20.0, float(old[i, t] - roll[i, t])))), C) if mask[i, t] else 0.0
            assert abs(float(out.weights[i, t]) - want) < 1e-12
    out = rollout_correction(old, roll, mask, **{**OFF, "rollout_is": "sequence", "rollout_is_threshold": C})
    for i in range(3):
        s = sum(float(old[i, t] - roll[i, t]) for t in range(5) if mask[i, t])
        want = min(math.exp(max(-20.0, min(20.0, s))), C)
        for t in range(5):
            assert abs(float(out.weights[i, t]) - (want if mask[i, t] else 0.0)) < 1e-12
    k1 = sum(float(roll[i, t] - old[i, t]) for i in range(3) for t in range(5) if mask[i, t]) / (float(mask.sum()) + 1e-8)
    assert abs(out.metrics["rollout_corr/kl"] - k1) < 1e-12


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_rejection_matches_verl_formulas(level):
    old, roll, mask = _case()
    up, lo = 1.5, 0.7
    out = rollout_correction(old, roll, mask, **{**OFF, "rollout_rs": level, "rollout_rs_threshold": up,
                                                   "rollout_rs_threshold_lower": lo})
    for i in range(3):
        lr = [float(old[i, t] - roll[i, t]) for t in range(5) if mask[i, t]]
        for t in range(5):
            if not mask[i, t]:
                want = 0.0
            else:
                r = {"token": math.exp(float(old[i, t] - roll[i, t])), "sequence": math.exp(sum(lr)),
                     "geometric": math.exp(sum(lr) / len(lr))}[level]
                want = 1.0 if lo <= r <= up else 0.0
            assert float(out.keep[i, t]) == want
    assert out.metrics["rollout_corr/rs_masked_fraction"] == pytest.approx(1 - float(out.keep.sum() / mask.sum()))


@pytest.mark.parametrize("k", [0, 1, 2])
def test_no_batch_older_than_the_bound_trains(k):
    """A stub trainer: each step takes its batch, 'trains' (version + 1) and publishes; every batch's
    version must be exactly max(0, b - k) and its lag <= k, and no load ever overlaps a generation."""
    busy = threading.Lock()
    loaded = {"v": 0}
    rows = iter(range(1000))

    def generate(r, b):
        assert busy.acquire(blocking=False), "a generation overlapped a weight load"
        v = loaded["v"]
        busy.release()
        return {"rows": r, "sampled_by": v}

    def load(w, v):
        assert busy.acquire(blocking=False), "a weight load overlapped a generation"
        loaded["v"] = w
        busy.release()

    pipe = RolloutPipeline(generate, load, lambda: next(rows), staleness=k, queue_timeout_s=10, end_index=8)
    pipe.start()
    try:
        for s in range(8):
            item = pipe.next(s)
            assert item.version == max(0, s - k) == item.batch["sampled_by"]
            assert 0 <= item.metrics["async/staleness"] <= k
            pipe.publish(s + 1, s + 1)
    finally:
        pipe.close()


def test_starving_queue_is_one_clear_error():
    import time

    pipe = RolloutPipeline(lambda r, b: time.sleep(5), lambda w, v: None, lambda: [], staleness=1, queue_timeout_s=0.3)
    pipe.start()
    t0 = time.monotonic()
    with pytest.raises(PipelineError, match="queue_timeout_s=0.3s"):
        pipe.next(0)
    assert time.monotonic() - t0 < 2
    pipe.close()


def test_in_flight_batches_round_trip_through_a_weights_only_load(tmp_path):
    """A checkpoint's in-flight batches are plain data: ``torch.load(weights_only=True)`` reads them back
    exactly (tensors bit-equal, rows and per-trajectory lists equal), and nothing needs an unpickler."""
    import torch

    from verl_lite.controller.pipeline import RolloutItem
    from verl_lite.protocol import Batch

    batch = Batch.from_dict({"responses": torch.arange(6).view(2, 3), "old_log_probs": torch.randn(2, 3)},
                            {"uid": ["a", "b"], "reward_model": [{"ground_truth": "3"}, {"ground_truth": "4"}]})
    item = RolloutItem(index=4, rows=[{"prompt": "1+2", "extra": [1, 2]}], version=3, batch=batch,
                       generate_s=0.5, metrics={"async/staleness": 1.0})
    torch.save({"policy_version": 5, "in_flight": [item.to_state()]}, tmp_path / "async.pt")
    loaded = torch.load(tmp_path / "async.pt", weights_only=True)
    back = RolloutItem.from_state(loaded["in_flight"][0])
    assert (back.index, back.rows, back.version, back.generate_s, back.metrics) == \
        (4, item.rows, 3, 0.5, {"async/staleness": 1.0})
    for key in ("responses", "old_log_probs"):
        assert torch.equal(back.batch.tensors[key], batch.tensors[key])
    assert back.batch.non_tensors == batch.non_tensors


@pytest.mark.parametrize("overrides, words", [
    (["async_training.staleness_threshold=1"], "hybrid_engine=false"),
    (["actor_rollout_ref.hybrid_engine=false", "async_training.partial_rollout=true"], "partial_rollout=true"),
    (["actor_rollout_ref.hybrid_engine=false", "actor_rollout_ref.rollout.nnodes=2"], "use 1"),
    (["actor_rollout_ref.hybrid_engine=false", "algorithm.adv_estimator=remax"], "set hybrid_engine=true"),
    (["actor_rollout_ref.hybrid_engine=false", "algorithm.filter_groups.enable=true"], "separate_async"),
    (["trainer.v1.trainer_mode=separate_async", "async_training.partial_rollout=false"], "always continues"),
    (["actor_rollout_ref.hybrid_engine=false", "async_training.weight_sync_timeout_s=0"], "must be > 0"),
])
def test_what_split_placement_cannot_do_is_refused_before_start(overrides, words):
    """Each unbuilt combination is one line naming the key and the fix, from validation (no worker)."""
    from verl_lite.config import load_config
    from verl_lite.config.validate import validate_config
    from verl_lite.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        validate_config(load_config(overrides))
    lines = [line for line in str(err.value).splitlines() if words in line]
    assert len(lines) == 1, str(err.value)
    assert overrides[-1].split("=")[0].split(".")[-1] in lines[0]


def test_streaming_states_what_it_does():
    """separate_async runs partial rollouts and DAPO's dynamic sampling: both keys pass validation there."""
    from verl_lite.config import load_config
    from verl_lite.config.validate import validate_config

    validate_config(load_config(["trainer.v1.trainer_mode=separate_async", "async_training.partial_rollout=true",
                                 "algorithm.filter_groups.enable=true"]))


CORRECTIONS = [dict(rollout_is="token", rollout_is_threshold=1.5), dict(rollout_is="sequence", rollout_is_threshold=2.0),
               dict(rollout_rs="token", rollout_rs_threshold=1.4), dict(rollout_rs="geometric", rollout_rs_threshold=1.3),
               dict(rollout_is="token", rollout_is_threshold=2.0, rollout_rs="sequence", rollout_rs_threshold=3.0), {},
               # verl's vocabulary (the in-loss path keeps rejected tokens in the denominators: rejected_in_denominator)
               dict(rollout_is="token", rollout_is_threshold="0.5_1.8"),
               dict(rollout_is="sequence", rollout_is_threshold="0.2_5.0", rollout_rs="token_k1,seq_max_k3",
                    rollout_rs_threshold="0.6_1.6,0.8"),
               dict(rollout_rs="seq_mean_k1", rollout_rs_threshold="0.7_1.3"),
               dict(rollout_rs="seq_sum_k2,token_k3", rollout_rs_threshold="1.5,0.3")]


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("settings", CORRECTIONS, ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()) or "metrics")
def test_correction_from_the_update_forward_equals_the_recomputed_one(settings, mode):
    """At one epoch and one mini-batch the old log-probs are the update's own forward: the loss computes the
    rollout correction from it, per shard of whole rows. Its contribution, gradient and metrics (token means,
    maxima, minima, the rejected-row share) combined over shards equal the trainer's path, where the weights
    come from the recomputed old log-probs of the whole step (here: the same values) into ``is_weights``."""
    from verl_lite.algorithms import NormalizationPlan, actor_loss, rollout_correction
    from verl_lite.utils.metric_reduce import combine_all
    from verl_lite.algorithms import ActorLossConfig

    g = torch.Generator().manual_seed(1)
    n, width = 6, 7
    logits = torch.randn(n, width, generator=g, dtype=torch.float64)
    rollout = -torch.rand(n, width, generator=g, dtype=torch.float64) * 2
    mask = (torch.rand(n, width, generator=g) > 0.3).to(torch.float64)
    mask[2] = 0  # a fully masked row
    advantages = torch.randn(n, width, generator=g, dtype=torch.float64)
    full = {**OFF, **settings}
    plan = NormalizationPlan.from_mask(mask, mode)
    cfg = dict(loss_agg_mode=mode, entropy_coeff=0.0, use_kl_loss=False)

    # the trainer's path: old log-probs recomputed (the same values), the weights from the whole step
    leaf = logits.clone().requires_grad_(True)
    log_probs = torch.nn.functional.logsigmoid(leaf)
    corr = rollout_correction(log_probs.detach(), rollout, mask, **full)
    data = {"response_mask": mask, "advantages": advantages, "old_log_probs": log_probs.detach()}
    if settings.get("rollout_is") or settings.get("rollout_rs"):
        data["is_weights"] = corr.weights
        assert not torch.equal(corr.weights, mask), "the case needs weights that change the loss"
    ref_total, ref_metrics = actor_loss({"log_probs": log_probs}, data, plan, ActorLossConfig(**cfg))
    ref_total.backward()
    # the metrics a shard can give (verl's whole-step statistics are the recompute path's only): the whole step's,
    # the same values as the whole-step call's
    want = {k: float(v) for k, v in rollout_correction(log_probs.detach(), rollout, mask, **full,
                                                       num_tokens=plan.num_tokens, num_seqs=plan.num_seqs).metrics.items()}
    for k, v in want.items():
        assert abs(float(corr.metrics[k]) - v) < 1e-12, k

    # the update's forward: two shards of whole rows, one plan for the whole mini-batch
    leaf2 = logits.clone().requires_grad_(True)
    shards, total = [], 0.0
    for rows in (slice(0, 4), slice(4, n)):
        lp = torch.nn.functional.logsigmoid(leaf2[rows])
        contribution, metrics = actor_loss(
            {"log_probs": lp}, {"response_mask": mask[rows], "advantages": advantages[rows],
                                "rollout_log_probs": rollout[rows]}, plan, ActorLossConfig(**cfg), correction=full)
        total = total + contribution
        shards.append({k: float(v) for k, v in metrics.items()})
    total.backward()
    got = combine_all(shards)
    assert abs(float(total.detach()) - float(ref_total.detach())) < 1e-12
    assert torch.allclose(leaf2.grad, leaf.grad, rtol=0, atol=1e-12)
    assert set(want) <= set(got), sorted(set(want) - set(got))
    for k, v in want.items():
        assert abs(got[k] - v) < 1e-12, (k, got[k], v)
    assert abs(got["pg_loss"] - float(ref_metrics["pg_loss"])) < 1e-12
