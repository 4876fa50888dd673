"""Clipped (dual-clip) policy loss with omega, 4 aggregation modes, metrics, micro-batch accumulation."""

import jax
import numpy as np
import pytest

from stare_jax.rl.losses import AGG_MODES, loss_normalizer, policy_loss

CL, CH, CC = 0.2, 0.28, 10.0


def _np_loss(lp, old, adv, mask, omega, agg, const=None):
    lr = np.clip(lp.astype(np.float64) - old, -20, 20)
    ratio = np.exp(lr)
    A = adv.astype(np.float64)[:, None]
    L1 = -A * ratio
    L2 = -A * np.clip(ratio, 1 - CL, 1 + CH)
    Lc = np.maximum(L1, L2)
    L3 = -A * CC
    tok = np.where(A < 0, np.minimum(L3, Lc), Lc) * omega
    v = mask > 0
    seq_sums = np.array([tok[i][v[i]].sum() for i in range(len(tok))])
    has = v.sum(1) > 0
    if agg == "token-mean":
        loss = seq_sums.sum() / max(v.sum(), 1)
    elif agg == "seq-mean-token-sum":
        loss = seq_sums[has].mean() if has.any() else 0.0
    elif agg == "seq-mean-token-mean":
        loss = np.mean([tok[i][v[i]].mean() for i in range(len(tok)) if has[i]]) if has.any() else 0.0
    else:
        loss = seq_sums.sum() / (const if const is not None else lp.shape[1])
    n = max(v.sum(), 1)
    metrics = {
        "clipfrac": ((L2 > L1) & v).sum() / n,
        "clipfrac_lower": ((Lc > L3) & (A < 0) & v).sum() / n,
        "approx_kl": (-lr)[v].sum() / n,
    }
    return loss, metrics


def _batch(seed, B=8, T=12):
    rng = np.random.default_rng(seed)
    # ratios that cover every regime: below 1-clip_low, inside, above 1+clip_high, huge (dual clip), tiny
    ratios = rng.choice([0.05, 0.5, 0.79, 0.95, 1.0, 1.1, 1.27, 1.5, 3.0, 50.0, 1e4], size=(B, T))
    lp = -rng.gamma(1.0, 1.0, size=(B, T))
    old = lp - np.log(ratios)
    adv = rng.choice([-2.0, -0.5, 0.0, 0.4, 1.5], size=B)
    adv[0], adv[1] = 1.0, -1.0
    lengths = rng.integers(1, T + 1, size=B)
    lengths[2] = 0
    mask = (np.arange(T)[None] < lengths[:, None]).astype(np.float32)
    omega = rng.choice([1.0, 1.1, 0.9, 1.5], size=(B, T))
    return [x.astype(np.float32) for x in (lp, old, adv, mask, omega)]


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("with_omega", [False, True])
def test_policy_loss_matches_numpy(agg, with_omega):
    lp, old, adv, mask, omega = _batch(0)
    om = omega if with_omega else None
    loss, met = policy_loss(lp, old, adv, mask, omega_BxT=om, agg=agg)
    ref, rmet = _np_loss(lp, old, adv, mask, omega if with_omega else 1.0, agg)
    np.testing.assert_allclose(float(loss), ref, rtol=2e-5)
    for k, v in rmet.items():
        np.testing.assert_allclose(float(met[k]), v, rtol=2e-5, atol=1e-7)
    assert float(met["clipfrac"]) > 0 and float(met["clipfrac_lower"]) > 0  # regimes are exercised


def test_clip_regimes_and_omega_after_clipping():
    # one token per row: (ratio, A) -> expected per-token loss before omega
    cases = [
        (0.5, 1.0, -0.5),
        (0.5, -1.0, 0.8),
        (1.5, 1.0, -1.28),
        (1.5, -1.0, 1.5),
        (50.0, -1.0, 10.0),
        (50.0, 1.0, -1.28),
        (1.0, 2.0, -2.0),
    ]
    r = np.array([c[0] for c in cases], np.float32)[:, None]
    adv = np.array([c[1] for c in cases], np.float32)
    want = np.array([c[2] for c in cases])
    lp = np.zeros_like(r)
    old = -np.log(r)
    mask = np.ones_like(r)
    omega = np.full_like(r, 1.3)
    loss, _ = policy_loss(lp, old, adv, mask, agg="seq-mean-token-sum")
    np.testing.assert_allclose(float(loss), want.mean(), rtol=1e-5)
    loss_w, _ = policy_loss(lp, old, adv, mask, omega_BxT=omega, agg="seq-mean-token-sum")
    np.testing.assert_allclose(float(loss_w), 1.3 * want.mean(), rtol=1e-5)
    # gradient wrt lp: omega * dL/dlp where unclipped, 0 where the clip binds (omega never revives a clipped token)
    g = jax.grad(lambda x: policy_loss(x, old, adv, mask, omega_BxT=omega, agg="seq-mean-token-sum")[0])(lp)
    n = len(cases)
    want_g = np.array([-0.5, 0.0, 0.0, 1.5, 0.0, 0.0, -2.0]) * 1.3 / n
    np.testing.assert_allclose(np.asarray(g)[:, 0], want_g, rtol=1e-5, atol=1e-7)


def test_on_policy_gradient_is_minus_omega_a():
    lp, _, adv, mask, omega = _batch(1)
    g = jax.grad(lambda x: policy_loss(x, lp, adv, mask, omega_BxT=omega)[0])(lp)
    np.testing.assert_allclose(np.asarray(g), -omega * adv[:, None] * mask / mask.sum(), rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_micro_batch_accumulation_equals_full_batch(agg):
    lp, old, adv, mask, omega = _batch(2, B=8)
    norm = loss_normalizer(mask, agg)

    def f(x, sl, nm):
        return policy_loss(x, old[sl], adv[sl], mask[sl], omega_BxT=omega[sl], agg=agg, normalizer=nm)

    full, fmet = f(lp, slice(None), None)
    gfull = jax.grad(lambda x: f(x, slice(None), None)[0])(lp)
    tot, gacc, sums = 0.0, np.zeros_like(lp), {"clipfrac_sum": 0.0, "approx_kl_sum": 0.0, "token_count": 0.0}
    for k in range(4):
        sl = slice(2 * k, 2 * k + 2)
        loss, met = f(lp[sl], sl, norm)
        tot += float(loss)
        gacc[sl] = np.asarray(jax.grad(lambda x: f(x, sl, norm)[0])(lp[sl]))
        for key in sums:
            sums[key] += float(met[key])
    np.testing.assert_allclose(tot, float(full), rtol=1e-5)
    np.testing.assert_allclose(gacc, np.asarray(gfull), rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(sums["clipfrac_sum"] / sums["token_count"], float(fmet["clipfrac"]), rtol=1e-6)
    np.testing.assert_allclose(sums["approx_kl_sum"] / sums["token_count"], float(fmet["approx_kl"]), rtol=1e-5)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_all_masked_is_zero_not_nan(agg):
    lp, old, adv, mask, _ = _batch(3)
    lp[:, -1] = np.nan  # garbage at a masked position must not leak
    loss, met = policy_loss(lp, old, adv, np.zeros_like(mask), agg=agg)
    assert float(loss) == 0.0 and all(np.isfinite(float(v)) for v in met.values())
    mask[:, -1] = 0
    loss, _ = policy_loss(lp, old, adv, mask, agg=agg)
    g = jax.grad(lambda x: policy_loss(x, old, adv, mask, agg=agg)[0])(lp)
    assert np.isfinite(float(loss)) and np.isfinite(np.asarray(g)).all()


def test_bad_options():
    lp, old, adv, mask, _ = _batch(4)
    with pytest.raises(ValueError, match="agg='mean'"):
        policy_loss(lp, old, adv, mask, agg="mean")
    with pytest.raises(ValueError, match="clip_c"):
        policy_loss(lp, old, adv, mask, clip_c=1.0)
    with pytest.raises(ValueError, match="advantages_B"):
        policy_loss(lp, old, adv[:3], mask)
