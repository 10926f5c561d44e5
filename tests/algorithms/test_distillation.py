"""On-policy distillation losses (algorithms/distillation.py) inside ``actor_loss``, against float64 loop references
written out here from the formulas (verl's meanings): the per-token divergences, the objective in every aggregation
mode with the task reward on and off, both ways to learn (per-token reward / loss), the gradient w.r.t. the student's
log-probs, and that any split of the mini-batch into micro-batches sums to the same value and gradient (verl #7200)."""

import math
import random

import pytest
import torch

from algo_reference import MODES, loss_config, make_batch, ref_weights
from verl_lite.algorithms import NormalizationPlan, actor_loss
from verl_lite.algorithms.config import DistillationLossConfig
from verl_lite.algorithms.distillation import STUDENT_TOPK_LOG_PROBS_KEY, forward_kl_topk, reverse_kl_estimate

ESTIMATORS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")
TOL = dict(rel_tol=1e-12, abs_tol=1e-13)
K = 4
MIN_CLAMP = -6.0


# ----------------------------------------------------------------------------- loop references


def ref_estimator(s, t, mode):
    """(d, dd/ds) of a sampled-token reverse-KL estimator at student log-prob s, teacher log-prob t."""
    if mode in ("k1", "kl"):
        return s - t, 1.0
    if mode == "abs":
        return abs(s - t), (1.0 if s > t else -1.0 if s < t else 0.0)
    if mode in ("k2", "mse"):
        return 0.5 * (s - t) ** 2, s - t
    x = t - s
    grad = 0.0
    if -20.0 < x < 20.0:
        grad = 1.0 - math.exp(x)  # d/ds of e^x - x - 1
    x = min(max(x, -20.0), 20.0)
    value = math.exp(x) - x - 1.0
    if not -10.0 < value < 10.0:
        grad = 0.0
    return min(max(value, -10.0), 10.0), grad


def ref_topk(student_k, teacher_k, clamp):
    """(d, [dd/ds_k]) of the truncated forward KL on the teacher's top k (verl: clamp both below, drop the mass
    outside the top k, clamp the sum at 0)."""
    total, grads = 0.0, []
    for s, t in zip(student_k, teacher_k):
        sc, tc = max(s, clamp), max(t, clamp)
        total += math.exp(tc) * (tc - sc)
        grads.append(-math.exp(tc) if s > clamp else 0.0)
    if total <= 0.0:
        return 0.0, [0.0] * len(grads)
    return total, grads


def ref_vanilla(s, old, adv, eps_lo, eps_hi, clip_c=3.0):
    """(loss, dloss/ds) of verl's vanilla PPO-clip at one token (ratio exp(s - old))."""
    r = math.exp(min(max(s - old, -20.0), 20.0))
    l1, l2 = -adv * r, -adv * min(max(r, 1 - eps_lo), 1 + eps_hi)
    g1 = -adv * r
    g2 = g1 if 1 - eps_lo < r < 1 + eps_hi else 0.0
    c1, gc1 = (l1, g1) if l1 >= l2 else (l2, g2)
    if adv < 0 and -adv * clip_c < c1:
        return -adv * clip_c, 0.0
    return c1, gc1


# ----------------------------------------------------------------------------- problems


def _teacher(b, seed):
    g = torch.Generator().manual_seed(seed)
    teacher = b.logp + 0.6 * torch.randn(b.logp.shape, generator=g, dtype=torch.float64)
    teacher[0, 0] = b.logp[0, 0] - 25.0  # beyond k3's clamps somewhere
    return teacher


def _topk(b, seed):
    """Student / teacher top-k log-probs [n, W, K]: a teacher top k holding most of the mass; the student's at
    those ids (some below the clamp, a token whose truncated sum is negative)."""
    g = torch.Generator().manual_seed(seed)
    n, w = b.mask.shape
    teacher = torch.log_softmax(torch.randn(n, w, K + 3, generator=g, dtype=torch.float64) * 2.0, dim=-1)[..., :K]
    student = torch.log_softmax(torch.randn(n, w, K + 3, generator=g, dtype=torch.float64) * 2.0, dim=-1)[..., :K]
    student[0, 0, 1] = -9.0  # below log_prob_min_clamp
    student[0, 1] = teacher[0, 1] + 0.5  # the student holds more of the top k: truncated sum < 0, clamped to 0
    return student, teacher


def _cfg(mode, **kw):
    return loss_config(loss_agg_mode=mode, use_kl_loss=False, entropy_coeff=0.0, **kw)


def _reference(b, student, teacher, agg_mode, dcfg):
    """(objective, d objective / d student) from the loops; student / teacher [n, W] (the sampled token's
    log-probs: the student's are the policy's) or [n, W, K] (top-k; the policy's log-probs are b.logp)."""
    w = ref_weights(b.mask, agg_mode)
    topk = dcfg.loss_mode == "forward_kl_topk"
    coef = dcfg.distillation_loss_coef if dcfg.use_task_rewards else 1.0
    total, grad = 0.0, torch.zeros_like(student)
    for i in range(len(w)):
        for t in range(len(w[i])):
            if w[i][t] == 0.0:
                continue
            s = b.logp[i, t].item() if topk else student[i, t].item()
            if topk:
                d, dd = ref_topk(student[i, t].tolist(), teacher[i, t].tolist(), dcfg.log_prob_min_clamp)
            else:
                d, dd = ref_estimator(s, teacher[i, t].item(), dcfg.loss_mode)
                dd = [dd]
            c = dcfg.loss_max_clamp
            if c is not None and not -c < d < c:
                d, dd = min(max(d, -c), c), [0.0] * len(dd)
            if dcfg.use_policy_gradient:  # advantage -d, a constant: the gradient goes through the ratio only
                d, g = ref_vanilla(s, b.old[i, t].item(), -d, dcfg.clip_ratio_low, dcfg.clip_ratio_high)
                dd = [g]
            task, task_grad = ref_vanilla(s, b.old[i, t].item(), b.adv[i, t].item(), 0.2, 0.2)
            if not dcfg.use_task_rewards:
                task, task_grad = 0.0, 0.0
            total += w[i][t] * (task + coef * d)
            if topk:
                grad[i, t] = torch.tensor([w[i][t] * coef * gk for gk in dd], dtype=grad.dtype)
            else:
                grad[i, t] = w[i][t] * (task_grad + coef * dd[0])
    return total, grad


# ----------------------------------------------------------------------------- per-token values


@pytest.mark.parametrize("mode", ESTIMATORS)
def test_reverse_kl_estimators_per_token(mode):
    b = make_batch(3)
    teacher = _teacher(b, 4)
    got = reverse_kl_estimate(b.logp, teacher, mode).tolist()
    for row_s, row_t, row_g in zip(b.logp.tolist(), teacher.tolist(), got):
        for s, t, g in zip(row_s, row_t, row_g):
            assert math.isclose(g, ref_estimator(s, t, mode)[0], **TOL)


def test_forward_kl_topk_per_token_and_masses():
    b = make_batch(5)
    student, teacher = _topk(b, 6)
    loss, student_mass, teacher_mass = forward_kl_topk(student, teacher, MIN_CLAMP)
    for i in range(student.shape[0]):
        for t in range(student.shape[1]):
            d, _ = ref_topk(student[i, t].tolist(), teacher[i, t].tolist(), MIN_CLAMP)
            assert math.isclose(loss[i, t].item(), d, **TOL)
            assert math.isclose(student_mass[i, t].item(), sum(math.exp(x) for x in student[i, t].tolist()), **TOL)
            assert math.isclose(teacher_mass[i, t].item(), sum(math.exp(x) for x in teacher[i, t].tolist()), **TOL)
    assert loss[0, 1].item() == 0.0  # the truncated sum was negative: clamped, as verl
    assert 0.0 < teacher_mass.max().item() < 1.0  # the mass outside the top k is dropped, not renormalized


# ----------------------------------------------------------------------------- the objective and its gradient


def _run(b, agg_mode, dcfg, student, teacher, rows=None, old=True):
    """actor_loss with distillation on rows ``rows`` (all by default): (total, metrics, grad w.r.t. the student)."""
    rows = torch.arange(b.mask.shape[0]) if rows is None else rows
    student = student.detach().clone().requires_grad_(True)
    topk = dcfg.loss_mode == "forward_kl_topk"
    logp = b.logp.detach().clone().requires_grad_(not topk)
    outputs = {"log_probs": logp[rows]}
    data = {"response_mask": b.mask[rows], "advantages": b.adv[rows]}
    if old:
        data["old_log_probs"] = b.old[rows]
    if topk:
        outputs[STUDENT_TOPK_LOG_PROBS_KEY] = student[rows]
        data["teacher_topk_log_probs"] = teacher[rows]
    else:
        outputs["log_probs"] = student[rows]
        data["teacher_log_probs"] = teacher[rows]
    plan = NormalizationPlan.from_mask(b.mask, agg_mode)  # the WHOLE mini-batch's plan
    total, metrics = actor_loss(outputs, data, plan, _cfg(agg_mode), distillation=dcfg)
    total.backward()
    return total, metrics, student.grad


SETUPS = [  # (loss_mode, use_policy_gradient, use_task_rewards)
    ("k3", False, False), ("k3", True, True), ("k1", True, False), ("k2", False, True),
    ("abs", True, True), ("forward_kl_topk", False, False), ("forward_kl_topk", False, True),
]


def _problem(loss_mode, use_pg, use_task, seed=11):
    b = make_batch(seed)
    dcfg = DistillationLossConfig(loss_mode=loss_mode, use_policy_gradient=use_pg, use_task_rewards=use_task,
                                  distillation_loss_coef=0.37, loss_max_clamp=2.5, log_prob_min_clamp=MIN_CLAMP,
                                  clip_ratio_low=0.18, clip_ratio_high=0.27)
    assert dcfg.problems() == []
    if loss_mode == "forward_kl_topk":
        student, teacher = _topk(b, seed + 1)
    else:
        student, teacher = b.logp.clone(), _teacher(b, seed + 1)
    return b, dcfg, student, teacher


@pytest.mark.parametrize("setup", SETUPS, ids=lambda s: "-".join(map(str, s)))
@pytest.mark.parametrize("agg_mode", MODES)
def test_objective_and_gradient_match_the_loop_reference(setup, agg_mode):
    b, dcfg, student, teacher = _problem(*setup)
    total, metrics, grad = _run(b, agg_mode, dcfg, student, teacher)
    ref_total, ref_grad = _reference(b, student, teacher, agg_mode, dcfg)
    assert math.isclose(total.item(), ref_total, **TOL)
    assert math.isclose(metrics["loss"].item(), ref_total, **TOL)
    assert torch.allclose(grad, ref_grad, rtol=1e-12, atol=1e-14), (grad - ref_grad).abs().max()
    assert grad.abs().sum() > 0
    if not dcfg.use_task_rewards:
        assert math.isclose(metrics["distillation/loss"].item(), ref_total, **TOL)


def test_on_policy_reward_gradient_is_the_divergence():
    """On-policy (no old log-probs: old = sg(current)), the per-token reward's gradient is w * d per token."""
    b, dcfg, student, teacher = _problem("k3", True, False)
    _, _, grad = _run(b, "token-sum", dcfg, student, teacher, old=False)
    for i in range(b.mask.shape[0]):
        for t in range(b.mask.shape[1]):
            d = min(max(ref_estimator(student[i, t].item(), teacher[i, t].item(), "k3")[0], -2.5), 2.5)
            expect = d if b.mask[i, t] else 0.0
            assert math.isclose(grad[i, t].item(), expect, **TOL)


# ----------------------------------------------------------------------------- verl #7200: micro-batch splits


@pytest.mark.parametrize("setup", SETUPS, ids=lambda s: "-".join(map(str, s)))
@pytest.mark.parametrize("agg_mode", MODES)
def test_micro_batch_split_changes_nothing(setup, agg_mode):
    """Any split of the mini-batch into micro-batches of whole rows: the contributions, every metric and the
    gradient sum to the whole mini-batch's (verl #7200 reports the opposite for verl)."""
    b, dcfg, student, teacher = _problem(*setup, seed=23)
    whole_total, whole_metrics, whole_grad = _run(b, agg_mode, dcfg, student, teacher)
    n = b.mask.shape[0]
    for seed in range(3):
        order = list(range(n))
        random.Random(seed).shuffle(order)
        cuts = sorted(random.Random(seed + 100).sample(range(1, n), 2 + seed))
        pieces = [order[a:z] for a, z in zip([0] + cuts, cuts + [n])]
        total, grad, metrics = 0.0, torch.zeros_like(student), {}
        for rows in pieces:
            rows = torch.tensor(rows)
            t, m, g = _run(b, agg_mode, dcfg, student, teacher, rows)
            total += t.item()
            grad += g
            for key, v in m.items():
                metrics[key] = metrics.get(key, 0.0) + v.item()
        assert math.isclose(total, whole_total.item(), **TOL)
        assert torch.allclose(grad, whole_grad, rtol=1e-12, atol=1e-14)
        for key, v in whole_metrics.items():
            assert math.isclose(metrics[key], v.item(), **TOL), key


# ----------------------------------------------------------------------------- refusals


def test_bad_settings_are_refused_naming_the_key():
    bad = DistillationLossConfig(loss_mode="k1", use_policy_gradient=False, distillation_loss_coef=-1.0,
                                 loss_max_clamp=0.0, policy_loss_mode="gspo")
    problems = bad.problems()
    assert any(p.startswith("distillation.distillation_loss.loss_mode=k1 with use_policy_gradient=false") for p in problems)
    assert any(p.startswith("distillation.distillation_loss.distillation_loss_coef=-1.0 must be >= 0") for p in problems)
    assert any(p.startswith("distillation.distillation_loss.loss_max_clamp=0.0 must be > 0") for p in problems)
    assert any(p.startswith("distillation.distillation_loss.policy_loss_mode='gspo' is unknown") for p in problems)
    assert DistillationLossConfig(loss_mode="forward_kl_topk", topk=0).problems() == [
        "distillation.distillation_loss.topk=0 must be an integer >= 1 with loss_mode=forward_kl_topk"]
    assert "loss_mode='jsd' is unknown" in DistillationLossConfig(loss_mode="jsd").problems()[0]


def test_missing_teacher_tensors_are_a_clear_error():
    b, dcfg, student, teacher = _problem("k3", False, False)
    plan = NormalizationPlan.from_mask(b.mask, "token-mean")
    with pytest.raises(ValueError, match="needs data\\['teacher_log_probs'\\]"):
        actor_loss({"log_probs": student}, {"response_mask": b.mask, "advantages": b.adv}, plan,
                   _cfg("token-mean"), distillation=dcfg)
    topk = DistillationLossConfig(loss_mode="forward_kl_topk", use_policy_gradient=False)
    with pytest.raises(ValueError, match="needs 'log_probs_at'"):
        actor_loss({"log_probs": student}, {"response_mask": b.mask, "advantages": b.adv}, plan,
                   _cfg("token-mean"), distillation=topk)
