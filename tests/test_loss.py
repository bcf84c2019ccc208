"""The PPO loss against a float64 reference written out token by token in plain Python."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pipeline.consumer.loss import LOG_RATIO_CLAMP, LossConfig, add_stats, finalize_stats, ppo_loss

CL, CH, C = 0.2, 0.28, 3.0
CLAMP = LOG_RATIO_CLAMP


def ref_token(lp, old, a, prox=None, cap=0.0, dual=C):
    """(loss, d loss / d lp) of one token, float64, straight from the formula in loss.py's docstring."""
    anchor = old if prox is None else prox
    r = math.exp(min(max(lp - anchor, -CLAMP), CLAMP))
    pg1, pg2 = -a * r, -a * min(max(r, 1 - CL), 1 + CH)
    loss, grad = (pg1, -a * r) if pg1 >= pg2 else (pg2, 0.0)
    if abs(lp - anchor) > CLAMP:
        grad = 0.0  # the clamp binds: no gradient through rho
    if dual > 0 and a < 0 and loss > -dual * a:
        loss, grad = -dual * a, 0.0
    if prox is not None:
        w = math.exp(min(max(prox - old, -CLAMP), CLAMP))
        w = min(w, cap) if cap > 0 else w
        loss, grad = loss * w, grad * w
    return loss, grad


def ref_loss(lp, old, adv, mask, denom=None, **kw):
    total, grads, n = 0.0, np.zeros_like(lp, dtype=np.float64), 0
    for b in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if mask[b, t]:
                prox = kw.get("prox")[b, t] if kw.get("prox") is not None else None
                loss, g = ref_token(float(lp[b, t]), float(old[b, t]), float(adv[b]), prox=prox,
                                    cap=kw.get("cap", 0.0), dual=kw.get("dual", C))
                total += loss
                grads[b, t] = g
                n += 1
    denom = denom or max(n, 1)
    return total / denom, grads / denom


def case():
    """Hand-picked tokens: clipped and unclipped ratios under both signs, the dual clip, and padding."""
    # log ratios: 0.5 (r=1.65 > 1.28), -0.5 (r=0.61 < 0.8), 0.1 (inside), 3.0 (r=20: dual clip for A<0)
    lr = np.array([[0.5, -0.5, 0.1, 3.0, 0.0, 0.0],
                   [0.5, -0.5, 0.1, 3.0, -0.05, 0.0],
                   [0.2, 0.0, 0.0, 0.0, 0.0, 0.0]])
    old = np.array([[-1.0, -2.0, -0.5, -4.0, 0.0, 0.0],
                    [-1.5, -0.7, -2.0, -5.0, -0.3, 0.0],
                    [-0.9, 0.0, 0.0, 0.0, 0.0, 0.0]])
    mask = np.array([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0], [1, 0, 0, 0, 0, 0]], dtype=bool)
    lp = old + lr
    lp[~mask] = 80.0  # garbage in padding: exp(80 - old) would overflow float32 if it leaked
    old[~mask] = -80.0
    adv = np.array([1.0, -0.7, -0.3])
    return lp, old, adv, mask


def run(lp, old, adv, mask, dual_clip=0.0, tis_cap=0.0, clamp=CLAMP, **kw):
    lp_t = torch.tensor(lp, dtype=torch.float32, requires_grad=True)
    cfg = LossConfig(CL, CH, dual_clip=dual_clip, tis_cap=tis_cap, log_ratio_clamp=clamp)
    loss, stats = ppo_loss(lp_t, torch.tensor(old, dtype=torch.float32), torch.tensor(adv, dtype=torch.float32),
                           torch.tensor(mask), cfg, **kw)
    loss.backward()
    return loss, stats, lp_t.grad


def test_matches_reference_with_clips_dual_clip_and_padding():
    lp, old, adv, mask = case()
    loss, stats, grad = run(lp, old, adv, mask, dual_clip=C)
    ref, ref_grad = ref_loss(lp, old, adv, mask)
    assert loss.item() == pytest.approx(ref, rel=1e-5, abs=1e-6)
    np.testing.assert_allclose(grad.numpy(), ref_grad, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(grad).all()
    s = finalize_stats(stats)
    assert s["num_tokens"] == mask.sum()
    assert s["dual_clip_frac"] == pytest.approx(1 / 10)  # row 1 (A<0), log ratio 3.0
    # clipped (gradient-free) tokens: row 0 lr 0.5 (A>0); row 1 lr -0.5 (A<0); the dual-clipped one too
    assert s["clip_frac"] == pytest.approx(3 / 10)
    r = np.exp((lp - old)[mask])
    assert s["ratio_mean"] == pytest.approx(r.mean(), rel=1e-5)
    assert s["ratio_max"] == pytest.approx(r.max(), rel=1e-5)
    k3 = (r - 1 - np.log(r)).mean()
    assert s["kl_behaviour"] == pytest.approx(k3, rel=1e-5)


def test_dual_clip_off_and_on_differ_only_on_that_token():
    lp, old, adv, mask = case()
    off, _, grad_off = run(lp, old, adv, mask, dual_clip=0.0)
    ref_off, ref_grad = ref_loss(lp, old, adv, mask, dual=0.0)
    assert off.item() == pytest.approx(ref_off, rel=1e-5)
    np.testing.assert_allclose(grad_off.numpy(), ref_grad, rtol=1e-5, atol=1e-6)
    assert grad_off[1, 3] != 0  # without the dual clip the huge ratio keeps pushing


def test_decoupled_weight_and_truncation():
    lp, old, adv, mask = case()
    rng = np.random.default_rng(0)
    prox = old + rng.normal(0, 0.8, old.shape)  # some behaviour weights above the cap of 1.5
    prox[~mask] = 80.0
    for cap in (0.0, 1.5):
        loss, stats, grad = run(lp, old, adv, mask, dual_clip=C, tis_cap=cap,
                                prox_logp_BT=torch.tensor(prox, dtype=torch.float32))
        ref, ref_grad = ref_loss(lp, old, adv, mask, prox=prox, cap=cap)
        assert loss.item() == pytest.approx(ref, rel=1e-5, abs=1e-6)
        np.testing.assert_allclose(grad.numpy(), ref_grad, rtol=1e-4, atol=1e-6)
        w = np.exp((prox - old)[mask])
        w = np.minimum(w, cap) if cap else w
        assert finalize_stats(stats)["behaviour_weight"] == pytest.approx(w.mean(), rel=1e-5)


def test_entropy_bonus_and_per_token_advantages():
    lp, old, adv, mask = case()
    ent = np.abs(np.random.default_rng(1).normal(2, 1, lp.shape))
    ent_t = torch.tensor(ent, dtype=torch.float32, requires_grad=True)
    lp_t = torch.tensor(lp, dtype=torch.float32, requires_grad=True)
    adv_bt = torch.tensor(np.repeat(adv[:, None], lp.shape[1], 1), dtype=torch.float32)
    loss, _ = ppo_loss(lp_t, torch.tensor(old, dtype=torch.float32), adv_bt, torch.tensor(mask),
                       LossConfig(CL, CH, dual_clip=C, entropy_coef=0.01), entropy_BT=ent_t)
    loss.backward()
    ref, _ = ref_loss(lp, old, adv, mask)
    assert loss.item() == pytest.approx(ref - 0.01 * ent[mask].sum() / mask.sum(), rel=1e-5, abs=1e-6)
    np.testing.assert_allclose(ent_t.grad.numpy(), np.where(mask, -0.01 / mask.sum(), 0.0), rtol=1e-5)


def test_micro_batches_with_global_count_equal_one_batch():
    rng = np.random.default_rng(2)
    B, T = 6, 9
    old = -rng.random((B, T)) * 3
    lp = old + rng.normal(0, 0.4, (B, T))
    adv = rng.normal(0, 1, B)
    mask = rng.random((B, T)) < 0.7
    big, stats_big, grad_big = run(lp, old, adv, mask, dual_clip=C)
    n = int(mask.sum())
    total, acc, grads = 0.0, None, []
    for rows in (slice(0, 2), slice(2, 3), slice(3, 6)):
        loss, stats, grad = run(lp[rows], old[rows], adv[rows], mask[rows], dual_clip=C, num_tokens=n)
        total += loss.item()
        acc = add_stats(acc, stats)
        grads.append(grad)
    assert total == pytest.approx(big.item(), rel=1e-6, abs=1e-7)
    torch.testing.assert_close(torch.cat(grads), grad_big)
    assert finalize_stats(acc) == pytest.approx(finalize_stats(stats_big), rel=1e-6)


def test_shape_errors_name_the_problem():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="same shape"):
        ppo_loss(x, torch.zeros(2, 4), torch.zeros(2), torch.ones(2, 3, dtype=torch.bool), LossConfig(CL, CH))
    with pytest.raises(ValueError, match="advantages"):
        ppo_loss(x, x, torch.zeros(3), torch.ones(2, 3, dtype=torch.bool), LossConfig(CL, CH))


def test_empty_mask_gives_zero_loss_and_finite_grad():
    lp, old, adv, mask = case()
    loss, stats, grad = run(lp, old, adv, np.zeros_like(mask), dual_clip=C)
    assert loss.item() == 0.0 and torch.all(grad == 0)
    assert finalize_stats(stats)["num_tokens"] == 0


def far_off_policy():
    """Log ratios of +-95 (exp overflows float32 beyond 88.7) under A = +1, -1 and 0."""
    old = np.full((3, 2), -100.0)
    lp = old + np.array([95.0, -95.0])
    return lp, old, np.array([1.0, -1.0, 0.0]), np.ones((3, 2), dtype=bool)


@pytest.mark.parametrize("dual", [0.0, C])
def test_log_ratio_95_gives_finite_loss_and_grads(dual):
    lp, old, adv, mask = far_off_policy()
    loss, stats, grad = run(lp, old, adv, mask, dual_clip=dual)
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    ref, ref_grad = ref_loss(lp, old, adv, mask, dual=dual)
    assert loss.item() == pytest.approx(ref, rel=1e-5)
    assert torch.all(grad == 0)  # the clamp binds on every token: nothing flows through rho
    np.testing.assert_array_equal(grad.numpy(), ref_grad)
    assert all(math.isfinite(v) for v in finalize_stats(stats).values())
    # the test can fail: without the clamp A = 0 tokens give 0 * inf = NaN, and the gradients are NaN
    unclamped, _, grad_unclamped = run(lp, old, adv, mask, dual_clip=dual, clamp=math.inf)
    assert not torch.isfinite(unclamped) and not torch.isfinite(grad_unclamped).all()


def test_decoupled_weight_exponent_is_clamped_too():
    lp, old, adv, mask = far_off_policy()
    prox = old + 95.0  # the proximal policy as far from the behaviour one as the current policy
    for cap in (0.0, 2.0):
        loss, stats, grad = run(prox, old, adv, mask, dual_clip=C, tis_cap=cap,
                                prox_logp_BT=torch.tensor(prox, dtype=torch.float32))
        assert torch.isfinite(loss) and torch.isfinite(grad).all()
        ref, ref_grad = ref_loss(prox, old, adv, mask, prox=prox, cap=cap)
        assert loss.item() == pytest.approx(ref, rel=1e-5)
        np.testing.assert_allclose(grad.numpy(), ref_grad, rtol=1e-5)
        w = min(math.exp(CLAMP), cap) if cap else math.exp(CLAMP)
        assert finalize_stats(stats)["behaviour_weight"] == pytest.approx(w, rel=1e-5)
        if not cap:  # the test can fail: without the clamp the uncapped weight is inf, and inf * (A = 0) is NaN
            unclamped, _, _ = run(prox, old, adv, mask, dual_clip=C, clamp=math.inf,
                                  prox_logp_BT=torch.tensor(prox, dtype=torch.float32))
            assert not torch.isfinite(unclamped)
