"""verl's ``algorithm.rollout_correction`` vocabulary with verl's meaning: every option against verl 0.9.1's own
``compute_rollout_correction_and_rejection_mask`` (the golden fixture written by
scripts/make_rollout_corr_fixture.py in a venv with verl itself), every preset accepted or refused with its
reason, the bound direction of k1, the denominators, and bypass mode's loss."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from verl_lite.algorithms.config import RolloutCorrectionConfig
from verl_lite.algorithms.rollout_correction import rollout_correction

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "rollout_corr_golden.json").read_text())
INPUTS = {seed: {k: torch.tensor(v, dtype=torch.float64) for k, v in t.items()} for seed, t in FIXTURE["inputs"].items()}
RC = "algorithm.rollout_correction"


def _ours(case):
    t = INPUTS[str(case["seed"])]
    return rollout_correction(t["old_log_probs"], t["rollout_log_probs"], t["response_mask"], **case["settings"])


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def test_the_fixture_is_verls_and_covers_every_option():
    assert FIXTURE["verl_version"] == "0.9.1" and FIXTURE["made_by"] == "scripts/make_rollout_corr_fixture.py"
    seen = {c["settings"]["rollout_rs"] for c in FIXTURE["cases"]}
    options = {o.strip() for rs in seen if rs for o in rs.split(",")}
    from verl_lite.algorithms.rollout_correction import RS_OPTIONS

    assert options == set(RS_OPTIONS)
    assert {c["settings"]["rollout_is"] for c in FIXTURE["cases"]} == {None, "token", "sequence"}
    assert any("_" in str(c["settings"]["rollout_is_threshold"]) for c in FIXTURE["cases"])  # IcePop
    assert any(c["settings"]["rollout_is_batch_normalize"] for c in FIXTURE["cases"])


@pytest.mark.parametrize("case", [c for c in FIXTURE["cases"] if "verl_raises" not in c],
                         ids=lambda c: f"{c['name']}-seed{c['seed']}")
def test_every_option_matches_verls_own_functions(case):
    """IS weights, the modified response mask and every metric verl logs (its names) within 1e-9 relative."""
    out = _ours(case)
    if case["is_weights"] is None:
        assert out.is_weights is None
    else:
        want = torch.tensor(case["is_weights"], dtype=torch.float64)
        assert torch.allclose(out.is_weights, want, rtol=1e-9, atol=1e-12), (out.is_weights - want).abs().max()
    assert torch.equal(out.keep, torch.tensor(case["modified_response_mask"], dtype=torch.float64))
    missing = sorted(set(case["metrics"]) - set(out.metrics))
    assert not missing, missing
    wrong = {k: (float(out.metrics[k]), v) for k, v in case["metrics"].items() if not _close(float(out.metrics[k]), v)}
    assert not wrong, wrong
    verl_named = {k for k in out.metrics if k.startswith(("rollout_corr/rollout_is", "rollout_corr/rollout_rs"))}
    assert verl_named <= set(case["metrics"]), sorted(verl_named - set(case["metrics"]))


@pytest.mark.parametrize("case", [c for c in FIXTURE["cases"] if "verl_raises" in c],
                         ids=lambda c: f"{c['name']}-seed{c['seed']}")
def test_where_verl_divides_by_zero_ours_reports_no_effective_sample(case):
    """IcePop zeroing every weight: verl's effective sample size raises ZeroDivisionError; ours is 0."""
    assert case["verl_raises"].startswith("ZeroDivisionError")
    out = _ours(case)
    assert float(out.is_weights.abs().sum()) == 0.0
    assert out.metrics["rollout_corr/rollout_is_eff_sample_size"] == 0.0


def _validate(overrides):
    from verl_lite.config import load_config
    from verl_lite.config.validate import validate_config

    cfg = load_config(overrides)
    validate_config(cfg)
    return cfg


def _overrides(fields: dict) -> list[str]:
    out = []
    for k, v in fields.items():
        text = "null" if v is None else str(v).lower() if isinstance(v, bool) else f"'{v}'" if isinstance(v, str) else v
        out.append(f"{RC}.{k}={text}")
    return out


@pytest.mark.parametrize("name", sorted(FIXTURE["presets"]))
def test_every_verl_preset_is_accepted_with_its_meaning(name):
    """verl's preset factories (their fields as keys), the REINFORCE ones (bypass_mode with loss_type=reinforce)
    included: accepted, every field as verl set it."""
    fields = FIXTURE["presets"][name]
    cfg = _validate(_overrides(fields))
    rc = cfg.algorithm.rollout_correction
    assert (rc.rollout_is, rc.rollout_rs, rc.bypass_mode, rc.loss_type) == (
        fields["rollout_is"], fields["rollout_rs"], fields["bypass_mode"], fields["loss_type"])
    assert str(rc.rollout_is_threshold) == str(fields["rollout_is_threshold"])


@pytest.mark.parametrize("overrides, key, words", [
    ([f"{RC}.rollout_rs=token_k4"], "rollout_rs", "unknown option(s) ['token_k4']"),
    ([f"{RC}.rollout_rs='token_k1,seq_mean_k9'"], "rollout_rs", "unknown option(s) ['seq_mean_k9']"),
    ([f"{RC}.rollout_rs=seq_mean_k3", f"{RC}.rollout_rs_threshold='0.1_0.5'"], "rollout_rs_threshold",
     "seq_mean_k3 takes one upper bound"),
    ([f"{RC}.rollout_rs='token_k1,seq_max_k2'", f"{RC}.rollout_rs_threshold='0.5_2.0,1,2'"], "rollout_rs_threshold",
     "one per option (2)"),
    ([f"{RC}.rollout_rs=token_k1", f"{RC}.rollout_rs_threshold='2.0_0.5'"], "rollout_rs_threshold", "lower <= upper"),
    ([f"{RC}.rollout_rs=token_k1", f"{RC}.rollout_rs_threshold=null"], "rollout_rs_threshold", "threshold is needed"),
    ([f"{RC}.rollout_rs=token_k2", f"{RC}.rollout_rs_threshold_lower=0.5"], "rollout_rs_threshold_lower",
     "rollout_rs_threshold='lower_upper'"),
    ([f"{RC}.rollout_rs=geometric", f"{RC}.rollout_rs_threshold='0.5_2.0'"], "rollout_rs_threshold", "a number > 1"),
    ([f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold='5.0_0.5'"], "rollout_is_threshold", "(0, upper]"),
    ([f"{RC}.rollout_is=token", f"{RC}.rollout_is_threshold=abc"], "rollout_is_threshold", "'lower_upper' pair"),
    ([f"{RC}.rejected_in_denominator=true"], "rejected_in_denominator", "read only with rollout_rs"),
    ([f"{RC}.bypass_mode=true", f"{RC}.loss_type=ppo"], "loss_type", "is unknown"),
    ([f"{RC}.bypass_mode=true", "actor_rollout_ref.actor.policy_loss.loss_mode=gspo"], "loss_mode", "set it vanilla"),
    ([f"{RC}.bypass_mode=true", f"{RC}.rollout_is=token", f"{RC}.rollout_is_batch_normalize=true"],
     "rollout_is_batch_normalize", "per micro-batch"),
])
def test_what_is_not_verls_meaning_is_refused_before_start(overrides, key, words):
    """Each refusal is one line naming the key and the reason, from validation (no worker)."""
    from verl_lite.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        _validate(overrides)
    lines = [line for line in str(err.value).splitlines() if words in line]
    assert len(lines) == 1, str(err.value)
    assert key in lines[0]


def test_k1_bounds_are_on_pi_rollout_over_pi_old_and_ours_on_the_inverse():
    """verl's token_k1 '0.5_1.0' keeps a token whose pi_rollout / pi_old = 0.8 and rejects 1.25; ours
    (rollout_rs=token, bounds on pi_old / pi_rollout) with [1.0, 2.0] keeps the same token (ratio 1.25)."""
    old = torch.log(torch.tensor([[0.5, 0.4]], dtype=torch.float64))
    rollout = torch.log(torch.tensor([[0.4, 0.5]], dtype=torch.float64))  # pi_rollout / pi_old: 0.8, 1.25
    mask = torch.ones(1, 2, dtype=torch.float64)
    off = dict(rollout_is=None, rollout_is_threshold=2.0)
    verl = rollout_correction(old, rollout, mask, **off, rollout_rs="token_k1", rollout_rs_threshold="0.5_1.0")
    ours = rollout_correction(old, rollout, mask, **off, rollout_rs="token", rollout_rs_threshold=2.0,
                              rollout_rs_threshold_lower=1.0)
    assert verl.keep.tolist() == [[1.0, 0.0]] == ours.keep.tolist()


@pytest.mark.parametrize("fields, drops", [
    ({"rollout_rs": "token_k1"}, True), ({"rollout_rs": "seq_mean_k3", "rollout_rs_threshold": 0.1}, True),
    ({"rollout_rs": "token_k1", "rejected_in_denominator": True}, False), ({"rollout_rs": "geometric"}, False),
    ({"rollout_rs": "sequence", "rejected_in_denominator": False}, True), ({"rollout_is": "token"}, False),
])
def test_verls_rejection_drops_tokens_from_the_mask_ours_keeps_them_counted(fields, drops):
    """verl's options leave rejected tokens out of the loss's mask (its denominators): the old log-probs are then
    recomputed before the update (the plan needs the rejection), and the recompute path writes the rejected
    tokens out of response_mask; ours (and rejected_in_denominator=true) keep them at weight 0, in the
    update's own forward when the schedule allows."""
    from verl_lite.trainer.update_stage import old_log_probs_from_update

    rc = RolloutCorrectionConfig(**fields)
    assert rc.drops_rejected() is drops
    cfg = _validate(_overrides(fields))
    assert old_log_probs_from_update(cfg) is (not drops)


def test_the_recompute_path_writes_verls_modified_mask_into_the_batch():
    """Updates.old_log_probs_and_correction (the driver path) with seq_mean_k1: response_mask = verl's
    modified mask, is_weights zero on the rejected tokens, verl's metrics reported."""
    from verl_lite.protocol import Batch
    from verl_lite.trainer.update_stage import Updates

    t = INPUTS["0"]
    cfg = _validate(_overrides({"rollout_is": "token", "rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.8_1.25"}))
    updates = Updates(cfg, placement=None)
    updates.compute_old_log_probs = lambda batch: {"log_probs": t["old_log_probs"], "entropy": torch.zeros_like(t["old_log_probs"])}
    batch = Batch.from_dict({"response_mask": t["response_mask"].clone(), "rollout_log_probs": t["rollout_log_probs"]})
    m = {}
    updates.old_log_probs_and_correction(batch, m)
    keep = rollout_correction(t["old_log_probs"], t["rollout_log_probs"], t["response_mask"], rollout_is="token",
                              rollout_is_threshold=2.0, rollout_rs="seq_mean_k1", rollout_rs_threshold="0.8_1.25").keep
    assert 0 < float(keep.sum()) < float(t["response_mask"].sum())  # some rows rejected, some kept
    assert torch.equal(batch["response_mask"], keep)
    assert float((batch["is_weights"] * (1 - keep)).abs().sum()) == 0.0
    assert "rollout_corr/rollout_rs_seq_mean_k1_mean" in m and "rollout_corr/chi2_seq" in m


BYPASS_SETTINGS = dict(rollout_is="sequence", rollout_is_threshold=2.0, rollout_is_batch_normalize=False,
                       rollout_rs="token_k1", rollout_rs_threshold="0.6_1.6", rollout_rs_threshold_lower=None)


def _bypass_case(seed: int, mode: str):
    """verl's inputs with this forward's log-probs 0.1-noised from the old ones, random advantages, the actor's loss
    config and the plan of ``mode``: (mask, rollout log-probs, log-probs, advantages, cfg, plan, rejection's keep)."""
    from verl_lite.algorithms import ActorLossConfig, NormalizationPlan

    t = INPUTS["0"]
    mask, rollout = t["response_mask"], t["rollout_log_probs"]
    g = torch.Generator().manual_seed(seed)
    log_probs = t["old_log_probs"] + 0.1 * torch.randn(mask.shape, generator=g, dtype=torch.float64)
    advantages = torch.randn(mask.shape, generator=g, dtype=torch.float64)
    cfg = ActorLossConfig(loss_agg_mode=mode, entropy_coeff=0.0, use_kl_loss=False)
    keep = rollout_correction(log_probs, rollout, mask, **BYPASS_SETTINGS).keep
    assert 0 < float(keep.sum()) < float(mask.sum())
    return mask, rollout, log_probs, advantages, cfg, NormalizationPlan.from_mask(mask, mode), keep


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_bypass_ppo_clip_is_the_policy_loss_against_the_rollout_with_rejected_tokens_out(mode):
    """bypass_mode (loss_type=ppo_clip): old = the rollout's log-probs; the rejection, from this forward, takes the
    rejected tokens out of the policy loss's mask (verl: token-mean keeps the plan's N, per-row means drop them),
    the IS weights are reported only. Over two shards of whole rows it equals the loss written out on the
    whole mini-batch."""
    from verl_lite.algorithms import actor_loss, get_policy_loss

    mask, rollout, logits, advantages, cfg, plan, keep = _bypass_case(3, mode)
    settings = BYPASS_SETTINGS
    pg, _ = get_policy_loss("vanilla")(rollout, logits, advantages, keep, cfg, None, None)
    want = plan.aggregate(pg, keep)
    total = 0.0
    for rows in (slice(0, 3), slice(3, 6)):
        contribution, metrics = actor_loss(
            {"log_probs": logits[rows]}, {"response_mask": mask[rows], "advantages": advantages[rows],
                                          "old_log_probs": rollout[rows], "rollout_log_probs": rollout[rows]},
            plan, cfg, correction={**settings, "bypass_mode": True})
        total = total + contribution
        assert "rollout_corr/is_weight_mean" in metrics
    assert abs(float(total) - float(want)) < 1e-12


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
def test_bypass_reinforce_is_minus_a_times_the_is_weight_times_log_pi_with_rejected_tokens_out(mode):
    """bypass_mode with loss_type=reinforce (verl's REINFORCE): per token -A sg(w) log pi, w the IS weights of this
    forward against the rollout (here sequence-level, truncated at 2), over the mask the rejection leaves. Written
    out on the whole mini-batch, value and gradient, it equals the sum over two shards of whole rows."""
    from verl_lite.algorithms import actor_loss

    mask, rollout, base, advantages, cfg, plan, keep = _bypass_case(4, mode)
    settings = BYPASS_SETTINGS
    log_pi = base.clone().requires_grad_(True)
    seq_log_ratio = ((base - rollout) * mask).sum(-1, keepdim=True)
    w = torch.exp(seq_log_ratio).clamp(max=2.0) * mask  # sequence TIS, written out
    want = plan.aggregate(-advantages * w * log_pi, keep)
    (want_grad,) = torch.autograd.grad(want, log_pi)

    shards = [base[rows].clone().requires_grad_(True) for rows in (slice(0, 3), slice(3, 6))]
    total = 0.0
    for rows, shard in zip((slice(0, 3), slice(3, 6)), shards):
        contribution, metrics = actor_loss(
            {"log_probs": shard}, {"response_mask": mask[rows], "advantages": advantages[rows],
                                   "old_log_probs": rollout[rows], "rollout_log_probs": rollout[rows]},
            plan, cfg, correction={**settings, "bypass_mode": True, "loss_type": "reinforce"})
        total = total + contribution
        assert "rollout_corr/is_weight_mean" in metrics and "ppo_kl" in metrics
    total.backward()
    assert abs(float(total.detach()) - float(want.detach())) < 1e-12
    assert torch.allclose(torch.cat([s.grad for s in shards]), want_grad, rtol=0, atol=1e-12)
    ppo_clip, _ = actor_loss({"log_probs": base}, {"response_mask": mask, "advantages": advantages,
                                                   "old_log_probs": rollout, "rollout_log_probs": rollout},
                             plan, cfg, correction={**settings, "bypass_mode": True, "loss_type": "ppo_clip"})
    assert abs(float(ppo_clip) - float(want.detach())) > 1e-6  # the two loss types are different objectives
