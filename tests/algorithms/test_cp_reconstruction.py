"""Context parallelism at the math level (Contract 3 + Contract 1).

Rank r of CP holds zig-zag chunks r and 2CP-1-r of each sequence (prompt + response, padded
to a multiple of 2CP). After the gather every rank holds full-row log-probs / entropies, but
autograd flows only through the positions its chunks produced. Each rank evaluates the same
`actor_loss` on full rows. Claim, for every loss x mode and CP in {1, 2, 4}: rank r's gradient
is the reference gradient restricted to its positions, and the ranks' gradients sum to the
reference. Hence no aggregation mode (seq-mean-token-mean included) needs a CP guard.
"""

import pytest
import torch

from algo_reference import LOSSES, MODES, make_batch
from verl_lite.algorithms import COV_SELECTION_LOSSES, NormalizationPlan, actor_loss, select_cov_tokens
from algo_reference import loss_config

TOL = 1e-12


def zigzag_owner(seq_len: int, cp: int) -> list[int]:
    """CP rank owning each position of a sequence padded to a multiple of 2*cp."""
    padded = -(-seq_len // (2 * cp)) * (2 * cp)
    chunk = padded // (2 * cp)
    owners = []
    for pos in range(seq_len):
        c = pos // chunk
        owners.append(c if c < cp else 2 * cp - 1 - c)
    return owners


def response_owners(prompt_lens, response_lens, width, cp):
    """owner[i][t] of response column t of row i: the rank holding position prompt_len + t - 1,
    whose logits produce log p(response[t]) (label shift). Padding columns: -1 (owned by none)."""
    out = []
    for p, r in zip(prompt_lens, response_lens):
        owners = zigzag_owner(p + r, cp)
        out.append([owners[p + t - 1] if t < r else -1 for t in range(width)])
    return torch.tensor(out)


def test_zigzag_helper():
    assert zigzag_owner(8, 2) == [0, 0, 1, 1, 1, 1, 0, 0]
    assert zigzag_owner(7, 2) == [0, 0, 1, 1, 1, 1, 0]  # padded to 8
    assert zigzag_owner(5, 1) == [0] * 5


def _layout(b, cp, seed):
    g = torch.Generator().manual_seed(1000 + seed)
    n, width = b.mask.shape
    valid_cols = [[t for t in range(width) if b.mask[i, t]] for i in range(n)]
    response_lens = [(cols[-1] + 1) if cols else int(torch.randint(0, width + 1, (1,), generator=g)) for cols in valid_cols]
    prompt_lens = []
    for r in response_lens:
        p = int(torch.randint(1, 4, (1,), generator=g))
        if cp > 1 and (p + r) % (2 * cp) == 0:
            p += 1  # lengths not divisible by 2CP
        prompt_lens.append(p)
    return prompt_lens, response_lens


@pytest.mark.parametrize("cp", [1, 2, 4])
@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("mode", MODES)
def test_cp_gradients_reconstruct_reference(cp, name, mode):
    for seed in (0, 1):
        b = make_batch(seed, n=6, width=24)
        prompt_lens, response_lens = _layout(b, cp, seed)
        assert cp == 1 or all((p + r) % (2 * cp) != 0 for p, r in zip(prompt_lens, response_lens))
        owner = response_owners(prompt_lens, response_lens, b.mask.shape[1], cp)
        cfg = loss_config(
            policy_loss=name, loss_agg_mode=mode, clip_ratio_high=0.28, clip_cov_ratio=0.2, clip_cov_lb=-1.0,
            kl_cov_ratio=0.2, use_kl_loss=True, kl_loss_coef=0.05, kl_loss_type="low_var_kl", entropy_coeff=0.01,
        )
        plan = NormalizationPlan.from_mask(b.mask, mode)
        data = {"response_mask": b.mask, "old_log_probs": b.old, "advantages": b.adv, "ref_log_probs": b.ref}
        if name in COV_SELECTION_LOSSES:
            data["cov_mask"] = select_cov_tokens(name, b.adv, b.old, b.mask, cfg, seed=seed)

        logp = b.logp.clone().requires_grad_(True)
        ent = b.entropy.clone().requires_grad_(True)
        reference, _ = actor_loss({"log_probs": logp, "entropy": ent}, data, plan, cfg)
        ref_lp, ref_ent = torch.autograd.grad(reference, (logp, ent))

        sum_lp, sum_ent = torch.zeros_like(ref_lp), torch.zeros_like(ref_ent)
        for rank in range(cp):
            mine = owner == rank
            local_lp = torch.where(mine, logp, logp.detach())  # full row values, local autograd only
            local_ent = torch.where(mine, ent, ent.detach())
            contribution, _ = actor_loss({"log_probs": local_lp, "entropy": local_ent}, data, plan, cfg)
            torch.testing.assert_close(contribution, reference, rtol=0, atol=TOL)  # same value on every rank
            g_lp, g_ent = torch.autograd.grad(contribution, (logp, ent))
            torch.testing.assert_close(g_lp, torch.where(mine, ref_lp, torch.zeros_like(ref_lp)), rtol=0, atol=TOL)
            torch.testing.assert_close(g_ent, torch.where(mine, ref_ent, torch.zeros_like(ref_ent)), rtol=0, atol=TOL)
            sum_lp += g_lp
            sum_ent += g_ent
        torch.testing.assert_close(sum_lp, ref_lp, rtol=0, atol=TOL)
        torch.testing.assert_close(sum_ent, ref_ent, rtol=0, atol=TOL)
        if cp > 1:  # the split is real: every rank owns some valid token
            assert all(((owner == r) & (b.mask > 0)).any() for r in range(cp))
