"""Independent references for tests/algorithms: plain Python loops over floats, written from
the formulas in docs/algorithms.md (no code shared with verl_lite.algorithms), plus the random
batch generator the tests use (ragged masks with holes, a fully masked row, singleton groups).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
LOSSES = ("vanilla", "gspo", "gpg", "cispo", "sapo", "geo_mean", "clip_cov", "kl_cov")


# ----------------------------------------------------------------------------- random batches


@dataclass
class Batch:
    mask: torch.Tensor  # float64 [n, W] of 0/1
    old: torch.Tensor
    logp: torch.Tensor
    adv: torch.Tensor
    ref: torch.Tensor
    is_weights: torch.Tensor
    entropy: torch.Tensor
    rewards: torch.Tensor
    values: torch.Tensor
    index: list


def make_batch(seed: int, n: int = 8, width: int = 9, row_constant_adv: bool = False) -> Batch:
    """Ragged masks: a random prefix length per row with observation holes; row 1 fully masked.
    Padding positions hold finite garbage so that any leak shows up."""
    g = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    lengths = torch.randint(1, width + 1, (n,), generator=g)
    pos = torch.arange(width).unsqueeze(0)
    mask = (pos < lengths.unsqueeze(1)) & (torch.rand(n, width, generator=g) > 0.2)
    mask[:, 0] |= lengths > 0
    if n > 1:
        mask[1] = False
    mask = mask.to(f64)
    old = -3.0 * torch.rand(n, width, generator=g, dtype=f64) - 0.05
    logp = old + 0.35 * torch.randn(n, width, generator=g, dtype=f64)
    jumps = (torch.rand(n, width, generator=g) < 0.15).to(f64) * 1.3  # ratios beyond the dual clip
    logp = logp + jumps * torch.sign(torch.randn(n, width, generator=g, dtype=f64))
    garbage = 4.0 * torch.randn(n, width, generator=g, dtype=f64)
    logp = torch.where(mask > 0, logp, garbage)
    if row_constant_adv:
        adv = torch.randn(n, 1, generator=g, dtype=f64).expand(n, width).clone()
    else:
        adv = torch.randn(n, width, generator=g, dtype=f64)
    adv[0, 0] = 0.0  # a zero advantage somewhere
    ref = old + 0.3 * torch.randn(n, width, generator=g, dtype=f64)
    is_weights = 0.5 + torch.rand(n, width, generator=g, dtype=f64)
    entropy = 2.0 * torch.rand(n, width, generator=g, dtype=f64)
    rewards = torch.randn(n, width, generator=g, dtype=f64) * mask
    values = torch.randn(n, width, generator=g, dtype=f64)
    # groups: sizes 3, 1 (singleton), 2, 2, ... assigned in shuffled order
    uids = []
    sizes = [3, 1, 2]
    k = 0
    while len(uids) < n:
        size = sizes[k] if k < len(sizes) else 2
        uids += [f"uid{k}"] * size
        k += 1
    uids = uids[:n]
    perm = torch.randperm(n, generator=g).tolist()
    index = [uids[p] for p in perm]
    return Batch(mask, old, logp, adv, ref, is_weights, entropy, rewards, values, index)


# ----------------------------------------------------------------------------- aggregation


def ref_weights(mask, mode, horizon=None, num_tokens=None, num_seqs=None):
    """w_i,t from the table of Contract 1 (N, B, H default to this batch's)."""
    m = mask.tolist()
    rows = len(m)
    width = len(m[0]) if rows else 0
    N = sum(sum(1 for x in row if x != 0) for row in m) if num_tokens is None else num_tokens
    B = rows if num_seqs is None else num_seqs
    H = width if horizon is None else horizon
    out = []
    for row in m:
        n_i = sum(1 for x in row if x != 0)
        wrow = []
        for x in row:
            v = 1.0 if x != 0 else 0.0
            if mode == "token-mean":
                w = v / N
            elif mode == "token-sum":
                w = v
            elif mode == "seq-mean-token-sum":
                w = v / B
            elif mode == "seq-mean-token-mean":
                w = v / (B * n_i) if n_i > 0 else 0.0
            elif mode == "seq-mean-token-sum-norm":
                w = v / (B * H)
            else:
                raise AssertionError(mode)
            wrow.append(w)
        out.append(wrow)
    return out


def ref_aggregate(per_token, mask, mode, **kw):
    w = ref_weights(mask, mode, **kw)
    l = per_token.tolist()
    total = 0.0
    for i in range(len(w)):
        for t in range(len(w[i])):
            if w[i][t] != 0.0:
                total += w[i][t] * l[i][t]
    return total


# ----------------------------------------------------------------------------- policy losses


def _clip(x, lo, hi):
    return min(max(x, lo), hi)


def _sign(x):
    return (x > 0) - (x < 0)


def _sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def ref_policy_loss(name, b: Batch, cfg, use_is=False, cov=None):
    """Per-token loss, d loss / d logp (for per-token losses; geo_mean: d L_i / d logp_t) and
    per-token metrics, as nested lists. Only valid positions are filled (others 0)."""
    m, old, lp, A = b.mask.tolist(), b.old.tolist(), b.logp.tolist(), b.adv.tolist()
    w_is = b.is_weights.tolist()
    sel = cov.tolist() if cov is not None else None
    lo, hi = cfg.eps_low, cfg.eps_high
    rows, width = len(m), len(m[0])
    loss = [[0.0] * width for _ in range(rows)]
    grad = [[0.0] * width for _ in range(rows)]
    metrics: dict[str, list] = {}

    def metric(key, i, t, v):
        metrics.setdefault(key, [[0.0] * width for _ in range(rows)])[i][t] = float(v)

    for i in range(rows):
        valid = [t for t in range(width) if m[i][t] != 0]
        n_i = len(valid)
        if name == "geo_mean":
            if n_i == 0:
                continue
            dmins, dgrads = [], []
            for t in valid:
                d = lp[i][t] - old[i][t]
                s = _sign(A[i][t])
                dc = _clip(d, -lo, hi)
                if s == 0:
                    dmin, dg = 0.0, 0.0
                elif s * d <= s * dc:
                    dmin, dg = d, 1.0
                else:
                    dmin, dg = dc, 0.0
                dmins.append(dmin)
                dgrads.append(dg)
                metric("pg_clipfrac", i, t, d != dc and A[i][t] > 0)
                metric("pg_clipfrac_lower", i, t, d != dc and A[i][t] < 0)
                metric("ppo_kl", i, t, -d)
            abar = sum(A[i][t] for t in valid) / n_i
            L = -abar * math.exp(sum(dmins) / n_i)
            if use_is:
                L *= math.exp(sum(math.log(w_is[i][t] + 1e-10) for t in valid) / n_i)
            for k, t in enumerate(valid):
                loss[i][t] = L
                grad[i][t] = L * dgrads[k] / n_i
            continue
        seq_mean = sum(lp[i][t] - old[i][t] for t in valid) / max(n_i, 1)
        for t in valid:
            a = A[i][t]
            raw = lp[i][t] - old[i][t]
            d = _clip(raw, -20.0, 20.0)
            dr = 1.0 if abs(raw) < 20.0 else 0.0  # d(clamped delta)/d logp
            r = math.exp(d)
            metric("ppo_kl", i, t, -d if name != "gspo" and name != "gpg" else -raw)
            if name in ("vanilla", "clip_cov"):
                l1, l2 = -a * r, -a * _clip(r, 1 - lo, 1 + hi)
                c1 = max(l1, l2)
                g = 0.0 if l2 > l1 else -a * r * dr
                metric("pg_clipfrac", i, t, l2 > l1)
                if name == "vanilla":
                    l3 = -a * cfg.clip_ratio_c
                    metric("pg_clipfrac_lower", i, t, c1 > l3 and a < 0)
                    if a < 0 and l3 < c1:
                        val, g = l3, 0.0
                    else:
                        val = c1
                else:
                    keep = 1.0 - sel[i][t]
                    val, g = c1 * keep, g * keep
                    metric("cov_selected_frac", i, t, sel[i][t])
            elif name == "gspo":
                log_s = min(seq_mean, 10.0)
                ds = 1.0 if seq_mean < 10.0 else 0.0
                s = math.exp(log_s)
                l1, l2 = -a * s, -a * _clip(s, 1 - lo, 1 + hi)
                val = max(l1, l2)
                g = 0.0 if l2 > l1 else -a * s * ds
                metric("pg_clipfrac", i, t, l2 > l1)
            elif name == "gpg":
                val, g = -lp[i][t] * a, -a
            elif name == "cispo":
                c = _clip(r, 1 - lo, 1 + hi)
                val, g = -c * a * lp[i][t], -c * a
                metric("pg_clipfrac", i, t, c != r)
            elif name == "sapo":
                tau = cfg.policy_loss.tau_pos if a > 0 else cfg.policy_loss.tau_neg
                sg = _sigmoid(tau * (r - 1.0))
                val = -a * sg * 4.0 / tau
                g = -a * 4.0 * sg * (1.0 - sg) * r * dr
            elif name == "kl_cov":
                s_ = sel[i][t]
                val = -a * r + s_ * cfg.policy_loss.ppo_kl_coef * abs(d)
                g = -a * r * dr + s_ * cfg.policy_loss.ppo_kl_coef * _sign(d) * dr
                metric("cov_selected_frac", i, t, s_)
                metric("ppo_kl_abs", i, t, abs(d))
            else:
                raise AssertionError(name)
            if use_is:
                val, g = val * w_is[i][t], g * w_is[i][t]
            loss[i][t] = val
            grad[i][t] = g
    return loss, grad, metrics


def ref_policy_grad(name, b: Batch, cfg, mode, use_is=False, cov=None, **plan_kw):
    """d L / d logp with L = sum w l (mode's weights), as nested lists."""
    _, g, _ = ref_policy_loss(name, b, cfg, use_is, cov)
    w = ref_weights(b.mask, mode, **plan_kw)
    out = []
    for i in range(len(w)):
        if name == "geo_mean":
            row_w = sum(w[i])
            out.append([row_w * g[i][t] for t in range(len(w[i]))])
        else:
            out.append([w[i][t] * g[i][t] for t in range(len(w[i]))])
    return out


def ref_select_kl_cov(b: Batch, ratio):
    m, A, lp = b.mask.tolist(), b.adv.tolist(), b.old.tolist()
    cells = [(i, t) for i in range(len(m)) for t in range(len(m[0])) if m[i][t] != 0]
    ma = sum(A[i][t] for i, t in cells) / len(cells)
    ml = sum(lp[i][t] for i, t in cells) / len(cells)
    cov = [((A[i][t] - ma) * (lp[i][t] - ml), k) for k, (i, t) in enumerate(cells)]
    k = max(1, int(len(cells) * ratio))
    top = sorted(cov, key=lambda x: (-x[0], x[1]))[:k]
    return {cells[k_] for _, k_ in top}


def ref_clip_cov_candidates(b: Batch, lb, ub):
    m, A, lp = b.mask.tolist(), b.adv.tolist(), b.old.tolist()
    cells = [(i, t) for i in range(len(m)) for t in range(len(m[0])) if m[i][t] != 0]
    ma = sum(A[i][t] for i, t in cells) / len(cells)
    ml = sum(lp[i][t] for i, t in cells) / len(cells)
    return {(i, t) for i, t in cells if lb < (A[i][t] - ma) * (lp[i][t] - ml) < ub}, len(cells)


def ref_select_kl_cov_current(b: Batch, ratio):
    """verl's kl_cov selection: the covariance uses the CURRENT log-probs (b.logp)."""
    return ref_select_kl_cov(Batch(b.mask, b.logp, b.logp, b.adv, b.ref, b.is_weights, b.entropy, b.rewards,
                                   b.values, b.index), ratio)


def ref_verl_clip_cov(b: Batch, cfg, seed: int):
    """verl 0.9.1's compute_policy_loss_clip_cov over the whole batch, written out as loops, with its
    global-RNG torch.randperm replaced by one seeded with `seed`. Returns (selected cells,
    per-token loss, d token-mean(loss) / d logp), nested lists.

    verl: r = exp(logp - old); l1 = -A r; l2 = -A clip(r, 1-lo, 1+hi); a token is clipped by the
    range when l2 > l1; cov = (A - mean A)(logp - mean logp) (means over valid tokens, CURRENT
    logp); candidates: valid, not clipped, lb < cov < ub, in row-major order; pick the first
    min(max(1, int(ratio N)), #candidates) of a random permutation; loss = max(l1, l2) (1 - picked).
    """
    m, old, lp, A = b.mask.tolist(), b.old.tolist(), b.logp.tolist(), b.adv.tolist()
    lo, hi = cfg.eps_low, cfg.eps_high
    rows, width = len(m), len(m[0])
    cells = [(i, t) for i in range(rows) for t in range(width) if m[i][t] != 0]
    ma = sum(A[i][t] for i, t in cells) / len(cells)
    ml = sum(lp[i][t] for i, t in cells) / len(cells)
    l1 = {(i, t): -A[i][t] * math.exp(lp[i][t] - old[i][t]) for i, t in cells}
    l2 = {(i, t): -A[i][t] * _clip(math.exp(lp[i][t] - old[i][t]), 1 - lo, 1 + hi) for i, t in cells}
    candidates = [(i, t) for i, t in cells
                  if not l2[i, t] > l1[i, t] and cfg.policy_loss.clip_cov_lb < (A[i][t] - ma) * (lp[i][t] - ml) < cfg.policy_loss.clip_cov_ub]
    clip_num = max(int(cfg.policy_loss.clip_cov_ratio * len(cells)), 1)
    perm = torch.randperm(len(candidates), generator=torch.Generator().manual_seed(seed)).tolist()
    picked = {candidates[k] for k in perm[:min(clip_num, len(candidates))]}
    loss = [[0.0] * width for _ in range(rows)]
    grad = [[0.0] * width for _ in range(rows)]
    for i, t in cells:
        keep = 0.0 if (i, t) in picked else 1.0
        loss[i][t] = max(l1[i, t], l2[i, t]) * keep
        unclipped = not l2[i, t] > l1[i, t]
        grad[i][t] = (l1[i, t] if unclipped else 0.0) * keep / len(cells)  # d(-A e^(logp-old))/d logp = l1
    return picked, loss, grad


def ref_clipped_by_range(b: Batch, cfg):
    """Valid cells whose PPO term is clipped (l2 > l1), from the current log-probs."""
    m, old, lp, A = b.mask.tolist(), b.old.tolist(), b.logp.tolist(), b.adv.tolist()
    out = set()
    for i in range(len(m)):
        for t in range(len(m[0])):
            if m[i][t] != 0:
                r = math.exp(lp[i][t] - old[i][t])
                if -A[i][t] * _clip(r, 1 - cfg.eps_low, 1 + cfg.eps_high) > -A[i][t] * r:
                    out.add((i, t))
    return out


# ----------------------------------------------------------------------------- KL


def ref_kl(logp, ref, kind):
    d = logp - ref
    if kind in ("kl", "k1"):
        return d
    if kind == "abs":
        return abs(d)
    if kind in ("mse", "k2"):
        return 0.5 * d * d
    if kind in ("low_var_kl", "k3"):
        x = _clip(ref - logp, -20.0, 20.0)
        return _clip(math.exp(x) - x - 1.0, -10.0, 10.0)
    raise AssertionError(kind)


# ----------------------------------------------------------------------------- advantages


def _groups(index):
    groups: dict = {}
    for i, u in enumerate(index):
        groups.setdefault(u, []).append(i)
    return groups


def _mean(xs):
    return sum(xs) / len(xs)


def _std_unbiased(xs):
    mu = _mean(xs)
    return math.sqrt(sum((x - mu) ** 2 for x in xs) / (len(xs) - 1))


def ref_whiten(vals, mask):
    cells = [(i, t) for i in range(len(mask)) for t in range(len(mask[0])) if mask[i][t] != 0]
    xs = [vals[i][t] for i, t in cells]
    mu = _mean(xs)
    var = sum((x - mu) ** 2 for x in xs) / (len(xs) - 1)
    return [[(vals[i][t] - mu) / math.sqrt(var + 1e-8) for t in range(len(mask[0]))] for i in range(len(mask))]


def ref_advantage(name, b: Batch, gamma=1.0, lam=1.0, norm=True, baselines=None):
    m = b.mask.tolist()
    r = b.rewards.tolist()
    V = b.values.tolist()
    rows, width = len(m), len(m[0])
    scores = [sum(r[i]) for i in range(rows)]
    groups = _groups(b.index)
    zeros = [[0.0] * width for _ in range(rows)]

    def outcome(a):
        adv = [[a[i] if m[i][t] != 0 else 0.0 for t in range(width)] for i in range(rows)]
        return adv, adv

    if name == "gae":
        adv = [[0.0] * width for _ in range(rows)]
        ret = [[0.0] * width for _ in range(rows)]
        for i in range(rows):
            nextv, last = 0.0, 0.0
            for t in reversed(range(width)):
                if m[i][t] != 0:
                    delta = r[i][t] + gamma * nextv - V[i][t]
                    last = delta + gamma * lam * last
                    nextv = V[i][t]
                adv[i][t] = last
            for t in range(width):
                ret[i][t] = adv[i][t] + V[i][t] if m[i][t] != 0 else 0.0
        wh = ref_whiten(adv, m)
        return [[wh[i][t] if m[i][t] != 0 else 0.0 for t in range(width)] for i in range(rows)], ret
    if name in ("grpo", "rloo", "gpg", "reinforce_plus_plus_baseline"):
        a = [0.0] * rows
        nonzero = sum(1 for s in scores if s != 0)
        alpha = rows / max(nonzero, 1)
        for members in groups.values():
            ss = [scores[i] for i in members]
            k = len(ss)
            for i in members:
                if name == "grpo":
                    mu, sd = (0.0, 1.0) if k == 1 else (_mean(ss), _std_unbiased(ss))
                    a[i] = (scores[i] - mu) / (sd + 1e-6) if norm else scores[i] - mu
                elif name == "rloo":
                    a[i] = scores[i] if k == 1 else k / (k - 1) * (scores[i] - _mean(ss))
                elif name == "gpg":
                    mu = 0.0 if k == 1 else _mean(ss)
                    a[i] = alpha * (scores[i] - mu)
                else:
                    mu = 0.0 if k == 1 else _mean(ss)
                    a[i] = scores[i] - mu
        if name != "reinforce_plus_plus_baseline":
            return outcome(a)
        tiled = [[a[i] if m[i][t] != 0 else 0.0 for t in range(width)] for i in range(rows)]
        wh = ref_whiten(tiled, m)
        adv = [[wh[i][t] if m[i][t] != 0 else 0.0 for t in range(width)] for i in range(rows)]
        return adv, adv
    if name == "grpo_passk":
        a = [0.0] * rows
        for members in groups.values():
            ss = [scores[i] for i in members]
            best = max(range(len(ss)), key=lambda k: ss[k])
            second = max(ss[k] for k in range(len(ss)) if k != best)
            v = ss[best] - second
            if norm:
                v /= _std_unbiased(ss) + 1e-6
            a[members[best]] = v
        return outcome(a)
    if name == "opo":
        a = [0.0] * rows
        lens = [sum(1 for x in m[i] if x != 0) for i in range(rows)]
        for members in groups.values():
            tot = sum(lens[i] for i in members)
            base = 0.0 if len(members) == 1 or tot == 0 else sum(lens[i] * scores[i] for i in members) / tot
            for i in members:
                a[i] = scores[i] - base
        return outcome(a)
    if name == "reinforce_plus_plus":
        ret = [[0.0] * width for _ in range(rows)]
        for i in range(rows):
            G = 0.0
            for t in reversed(range(width)):
                if m[i][t] != 0:
                    G = r[i][t] + gamma * G
                    ret[i][t] = G
        wh = ref_whiten(ret, m)
        adv = [[wh[i][t] if m[i][t] != 0 else 0.0 for t in range(width)] for i in range(rows)]
        return adv, ret
    if name == "remax":
        bl = baselines.tolist()
        ret = [[0.0] * width for _ in range(rows)]
        adv = [[0.0] * width for _ in range(rows)]
        for i in range(rows):
            for t in range(width):
                if m[i][t] != 0:
                    ret[i][t] = sum(r[i][u] for u in range(t, width) if m[i][u] != 0)
                    adv[i][t] = ret[i][t] - bl[i]
        return adv, ret
    del zeros
    raise AssertionError(name)


def loss_config(policy_loss: str = "vanilla", **keys):
    """The actor section's loss keys (``algorithms.ActorLossConfig``) from its keys and ``policy_loss.*``'s, named
    flat here for the tables of the tests: ``policy_loss`` is ``policy_loss.loss_mode``."""
    import dataclasses

    from verl_lite.algorithms import ActorLossConfig, PolicyLossConfig

    sub = {f.name for f in dataclasses.fields(PolicyLossConfig)}
    nested = PolicyLossConfig(loss_mode=policy_loss, **{k: v for k, v in keys.items() if k in sub})
    return ActorLossConfig(policy_loss=nested, **{k: v for k, v in keys.items() if k not in sub})
