"""compute_policy_loss: every loss vs an independent NumPy re-derivation (float64; all aggregation modes, every
clipping regime, padded masks) and vs verl's formulas transcribed to torch on identical inputs (loss to 1e-5
relative, gradient w.r.t. the log-probs to 1e-4); both selection scopes of clip_cov / kl_cov; micro-batch
accumulation; sharded (8 fake devices) == single device; bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from stare_jax.rl.losses import (
    AGG_MODES,
    POLICY_LOSSES,
    clip_cov_key,
    clip_cov_mask,
    compute_policy_loss,
    kl_cov_mask,
    policy_loss_normalizer,
)
from support.params import representative
from support.rl import np_agg

B, T = 8, 12
LO, HI, C = 0.2, 0.28, 4.0  # no ratio of the test data sits on a clip boundary
OPTS = {  # options per loss for the comparisons (cov ratios large enough that the selections are not trivial)
    "vanilla": dict(clip_ratio_low=LO, clip_ratio_high=HI, clip_ratio_c=C),
    "stare": dict(clip_ratio_low=LO, clip_ratio_high=HI, clip_ratio_c=C),
    "clip_cov": dict(clip_ratio_low=LO, clip_ratio_high=HI, clip_cov_ratio=0.5, clip_cov_lb=0.05, clip_cov_ub=5.0),
    "kl_cov": dict(kl_cov_ratio=0.1, ppo_kl_coef=0.3),
    "gspo": dict(clip_ratio_low=LO, clip_ratio_high=HI),
    "cispo": dict(clip_ratio_low=LO, clip_ratio_high=HI),
    "gpg": {},
    "geo_mean": dict(clip_ratio_low=LO, clip_ratio_high=HI),
    "sapo": dict(tau_pos=1.0, tau_neg=1.05),
}


def _batch(seed, b=B, t=T, gspo_scale=False):
    """log-probs with ratios in every clipping regime, token-level advantages A_b * mask, padded rows (one empty),
    omega, and finite garbage at the masked positions (as verl would see it)."""
    rng = np.random.default_rng(seed)
    ratios = rng.choice([0.05, 0.5, 0.79, 0.95, 1.0, 1.1, 1.27, 1.5, 3.0, 50.0], size=(b, t))
    if gspo_scale:  # sequence ratios (geometric means) on both sides of GSPO's clip range and inside it
        ratios = rng.choice([0.6, 0.9, 1.0, 1.1, 1.5], size=(b, 1)) * rng.choice([0.9, 1.0, 1.1], size=(b, t))
    lp = -rng.gamma(1.0, 1.0, size=(b, t))
    old = lp - np.log(ratios)
    adv_b = rng.choice([-2.0, -0.5, 0.4, 1.5], size=b)
    adv_b[0], adv_b[1] = 1.0, -1.0
    lengths = rng.integers(2, t + 1, size=b)
    lengths[2] = 0
    mask = (np.arange(t)[None] < lengths[:, None]).astype(np.float32)
    lp = np.where(mask > 0, lp, -3.0)
    old = np.where(mask > 0, old, -1.0)
    omega = rng.choice([1.0, 1.1, 0.9, 1.5], size=(b, t))
    adv = adv_b[:, None] * mask
    return [x.astype(np.float32) for x in (lp, old, adv, mask, omega)]


# ---------------------------------------------------------------------------------------------------------------
# Independent NumPy re-derivation (float64, per sequence)


def _np_cov(lp, adv, v):
    a, x = adv[v], lp[v]
    cov = np.full(lp.shape, np.nan)
    cov[v] = (a - a.mean()) * (x - x.mean())
    return cov


def _np_loss(name, lp, old, adv, mask, mode, o, omega=None, detach=None):
    """(loss, clipfrac, clipfrac_lower, approx_kl) in float64. detach: clip_cov's chosen set (from the jax side
    when the choice is random; None = all eligible tokens, the deterministic case)."""
    lp, old, adv = (np.asarray(x, np.float64) for x in (lp, old, adv))
    v = mask > 0
    nk = lp - old
    r = np.exp(np.clip(nk, -20, 20))
    zero = np.zeros(lp.shape, bool)
    if name in ("vanilla", "stare"):
        l1, l2 = -adv * r, -adv * np.clip(r, 1 - o["clip_ratio_low"], 1 + o["clip_ratio_high"])
        lc, l3 = np.maximum(l1, l2), -adv * o["clip_ratio_c"]
        tok = np.where(adv < 0, np.minimum(l3, lc), lc) * (omega if name == "stare" else 1.0)
        clip, lower, kl = l2 > l1, (lc > l3) & (adv < 0), -np.clip(nk, -20, 20)
    elif name == "clip_cov":
        r = np.exp(nk)
        l1, l2 = -adv * r, -adv * np.clip(r, 1 - o["clip_ratio_low"], 1 + o["clip_ratio_high"])
        cov = _np_cov(lp, adv, v)
        elig = v & ~(l2 > l1) & (cov > o["clip_cov_lb"]) & (cov < o["clip_cov_ub"])
        num = max(int(o["clip_cov_ratio"] * v.sum()), 1)
        if detach is None:
            assert elig.sum() <= num, "deterministic case needs every eligible token chosen"
            detach = elig
        else:
            assert (detach <= elig).all() and detach.sum() == min(num, elig.sum())
        tok = np.where(detach, 0.0, np.maximum(l1, l2))
        clip, lower, kl = detach, zero, -nk
    elif name == "kl_cov":
        cov = _np_cov(lp, adv, v)
        k = max(1, int(v.sum() * o["kl_cov_ratio"])) if v.any() else 0
        flat = np.where(v.ravel(), cov.ravel(), -np.inf)
        sel = np.zeros(flat.shape, bool)
        sel[np.argsort(-flat, kind="stable")[:k]] = True
        tok = -adv * np.exp(nk) + np.where(sel.reshape(lp.shape), o["ppo_kl_coef"] * np.abs(nk), 0.0)
        clip, lower, kl = zero, zero, np.abs(nk)
    elif name == "gspo":
        tok = np.zeros(lp.shape)
        clip = zero.copy()
        for i in range(len(lp)):
            s = np.exp(min(nk[i][v[i]].mean(), 10.0)) if v[i].any() else 1.0
            l1, l2 = -adv[i] * s, -adv[i] * np.clip(s, 1 - o["clip_ratio_low"], 1 + o["clip_ratio_high"])
            tok[i], clip[i] = np.maximum(l1, l2), l2 > l1
        lower, kl, mode = zero, -nk, "seq-mean-token-mean"
    elif name == "cispo":
        c = np.clip(r, 1 - o["clip_ratio_low"], 1 + o["clip_ratio_high"])
        tok, clip, lower, kl = -c * adv * lp, r != c, zero, -np.clip(nk, -20, 20)
    elif name == "gpg":
        tok, clip, lower, kl = -adv * lp, zero, zero, -nk
    elif name == "sapo":
        tau = np.where(adv > 0, o["tau_pos"], o["tau_neg"])
        tok = -adv * 4.0 / tau / (1.0 + np.exp(-tau * (r - 1.0)))
        clip, lower, kl, mode = zero, zero, -np.clip(nk, -20, 20), "seq-mean-token-mean"
    elif name == "geo_mean":
        per_seq = []
        for i in range(len(lp)):
            a = adv[i][v[i]]
            x = nk[i][v[i]]
            if not len(x):
                per_seq.append(0.0)
                continue
            # token-level clip in the direction that helps the objective: upper for A > 0, lower for A < 0
            xc = np.where(
                a > 0, np.minimum(x, o["clip_ratio_high"]), np.where(a < 0, np.maximum(x, -o["clip_ratio_low"]), 0.0)
            )
            per_seq.append(-a.mean() * np.exp(xc.mean()))
        cl = (nk < -o["clip_ratio_low"]) | (nk > o["clip_ratio_high"])
        n = max(v.sum(), 1)
        return np.mean(per_seq), (cl & (adv > 0) & v).sum() / n, (cl & (adv < 0) & v).sum() / n, (-nk)[v].sum() / n
    n = max(v.sum(), 1)
    return np_agg(tok, mask, mode), (clip & v).sum() / n, (lower & v).sum() / n, kl[v].sum() / n


def _key():
    return clip_cov_key(0, 3)


def _call(name, lp, old, adv, mask, mode, omega=None, **extra):
    o = dict(OPTS[name], **extra)
    if name == "stare":
        o["omega_BxT"] = omega
    if name == "clip_cov":
        o.setdefault("key", _key())
    return compute_policy_loss(name, old, lp, adv, mask, loss_agg_mode=mode, **o)


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_matches_numpy(name, mode):
    lp, old, adv, mask, omega = _batch(0, gspo_scale=name == "gspo")
    loss, met = _call(name, lp, old, adv, mask, mode, omega)
    ref = _np_loss(name, lp, old, adv, mask, mode, OPTS[name], omega=omega)
    np.testing.assert_allclose(float(loss), ref[0], rtol=2e-5, atol=1e-7)
    for k, want in zip(("clipfrac", "clipfrac_lower", "approx_kl"), ref[1:]):
        np.testing.assert_allclose(float(met[k]), want, rtol=2e-5, atol=1e-7, err_msg=k)
    assert np.isfinite(float(loss))


@pytest.mark.parametrize("name", ["vanilla", "gspo", "clip_cov", "geo_mean"])
def test_regimes_are_exercised(name):
    lp, old, adv, mask, _ = _batch(0, gspo_scale=name == "gspo")
    _, met = _call(name, lp, old, adv, mask, "token-mean")
    assert float(met["clipfrac"]) > 0
    if name in ("vanilla", "geo_mean"):
        assert float(met["clipfrac_lower"]) > 0


def test_clip_cov_random_choice_is_a_uniform_subset_of_the_eligible():
    lp, old, adv, mask, _ = _batch(1, b=16, t=16)
    o = dict(OPTS["clip_cov"], clip_cov_ratio=0.02, clip_cov_lb=0.0)
    valid = jnp.asarray(mask > 0)
    ratio = np.exp(lp - old)
    clipped = valid & jnp.asarray(-adv * np.clip(ratio, 1 - LO, 1 + HI) > -adv * ratio)
    sels = [
        np.asarray(
            clip_cov_mask(
                jnp.where(valid, lp, 0.0),
                adv,
                valid,
                clipped,
                clip_cov_ratio=0.02,
                clip_cov_lb=0.0,
                clip_cov_ub=5.0,
                key=clip_cov_key(0, s),
            )
        )
        for s in range(4)
    ]
    num = max(int(0.02 * mask.sum()), 1)
    assert num >= 2 and all(s.sum() == num for s in sels)
    assert len({s.tobytes() for s in sels}) > 1  # different steps draw different subsets
    for s, step in zip(sels, range(4)):
        loss, _ = compute_policy_loss("clip_cov", old, lp, adv, mask, key=clip_cov_key(0, step), **o)
        ref = _np_loss("clip_cov", lp, old, adv, mask, "token-mean", o, detach=s)
        np.testing.assert_allclose(float(loss), ref[0], rtol=2e-5)


# ---------------------------------------------------------------------------------------------------------------
# verl's formulas, transcribed to torch (core_algos.py at the STARE authors' fork of v0.7.0)


def _t_masked_mean(x, m):
    return (x * m).sum() / (m.sum() + 1e-8)


def _t_agg(mat, m, mode, num_tokens=None, num_seqs=None):
    if mode == "token-mean":
        return (mat * m).sum() / (m.sum() if num_tokens is None else num_tokens)
    if mode == "seq-mean-token-sum":
        seq, has = (mat * m).sum(-1), (m.sum(-1) > 0).float()
        return (seq * has).sum() / (has.sum() if num_seqs is None else num_seqs)
    if mode == "seq-mean-token-mean":
        cnt = m.sum(-1)
        seq, has = (mat * m).sum(-1) / (cnt + 1e-8), (cnt > 0).float()
        return (seq * has).sum() / (has.sum() if num_seqs is None else num_seqs)
    return (mat * m).sum(-1).sum() / m.shape[-1]


def _t_cov_idx(lp, adv, m):
    v = m > 0
    a, x = adv[v].detach(), lp[v].detach()
    return (a - a.mean()) * (x - x.mean()), torch.nonzero(v.reshape(-1), as_tuple=True)[0]


def verl_loss(name, old, lp, adv, m, mode, o, omega=None, is_w=None, **agg_kw):
    def agg(mat, m, mode):  # verl: pg_losses * rollout_is_weights, then agg_loss
        return _t_agg(mat if is_w is None else mat * is_w, m, mode, **agg_kw)

    nk = lp - old
    if name in ("vanilla", "stare"):
        nkc = torch.clamp(nk, -20.0, 20.0)
        r = torch.exp(nkc)
        l1, l2 = -adv * r, -adv * torch.clamp(r, 1 - o["clip_ratio_low"], 1 + o["clip_ratio_high"])
        c1 = torch.maximum(l1, l2)
        l3 = -adv * o["clip_ratio_c"]
        pg = torch.where(adv < 0, torch.min(l3, c1), c1)
        if omega is not None:
            pg = pg * omega
        return agg(pg, m, mode)
    if name == "clip_cov":  # deterministic case: every eligible token is chosen (clip_num >= eligible)
        r = torch.exp(nk)
        l1, l2 = -adv * r, -adv * torch.clamp(r, 1 - o["clip_ratio_low"], 1 + o["clip_ratio_high"])
        by_origin = (l2 > l1) & (m > 0)
        cov = (adv - _t_masked_mean(adv, m)) * (lp - _t_masked_mean(lp.detach(), m))
        cov = cov.masked_fill(m == 0, -torch.inf).masked_fill(by_origin, -torch.inf)
        num = max(int(o["clip_cov_ratio"] * m.sum().item()), 1)
        idx = torch.nonzero((cov < o["clip_cov_ub"]) & (cov > o["clip_cov_lb"]) & (m > 0))
        assert len(idx) <= num
        corr = torch.ones_like(adv)
        corr[idx[:, 0], idx[:, 1]] = 0
        return agg(torch.maximum(l1, l2) * corr, m, mode)
    if name == "kl_cov":
        pg = -adv * torch.exp(nk)
        pg_kl = pg + o["ppo_kl_coef"] * nk.abs()
        cov, valid_idx = _t_cov_idx(lp, adv, m)
        if len(cov):
            top = valid_idx[torch.topk(cov, max(1, int(len(cov) * o["kl_cov_ratio"]))).indices]
            rows, cols = top // adv.shape[1], top % adv.shape[1]
            pg = pg.clone()
            pg[rows, cols] = pg_kl[rows, cols]
        return agg(pg, m, mode)
    if name == "gspo":
        seq = (nk * m).sum(-1) / m.sum(-1).clamp(min=1)
        r = torch.exp(torch.clamp(lp - lp.detach() + seq.detach().unsqueeze(-1), max=10.0))
        l1, l2 = -adv * r, -adv * torch.clamp(r, 1 - o["clip_ratio_low"], 1 + o["clip_ratio_high"])
        return agg(torch.maximum(l1, l2), m, "seq-mean-token-mean")
    if name == "cispo":
        r = torch.exp(torch.clamp(nk, -20.0, 20.0))
        c = torch.clamp(r, 1 - o["clip_ratio_low"], 1 + o["clip_ratio_high"]).detach()
        return agg(-c * adv * lp, m, mode)
    if name == "gpg":
        return agg(-lp * adv, m, mode)
    if name == "sapo":
        r = torch.exp(torch.clamp(nk, -20.0, 20.0))
        tau = torch.where(adv > 0, torch.tensor(o["tau_pos"]), torch.tensor(o["tau_neg"]))
        return agg(-torch.sigmoid(tau * (r - 1.0)) * (4.0 / tau) * adv, m, "seq-mean-token-mean")
    if name == "geo_mean":
        sgn = torch.sign(adv)
        nkc = torch.clamp(nk, -o["clip_ratio_low"], o["clip_ratio_high"])
        nmin = sgn * torch.min(sgn * nk, sgn * nkc)
        cnt = m.sum(-1)
        ratio = torch.exp((nmin * m).sum(-1) / (cnt + 1e-8))
        a = (adv * m).sum(-1) / (cnt + 1e-8)
        pg = -a * ratio
        if is_w is not None:  # the weights' geometric mean per sequence
            pg = pg * torch.exp((torch.log(is_w + 1e-10) * m).sum(-1) / (cnt + 1e-8))
        return torch.mean(pg)
    raise AssertionError(name)


def _torch_value_and_grad(name, lp, old, adv, mask, mode, omega):
    t = {k: torch.tensor(v) for k, v in dict(lp=lp, old=old, adv=adv, m=mask, om=omega).items()}
    x = t["lp"].clone().requires_grad_(True)
    loss = verl_loss(name, t["old"], x, t["adv"], t["m"], mode, OPTS[name], omega=t["om"] if name == "stare" else None)
    loss.backward()
    return float(loss.detach()), x.grad.numpy()


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_matches_verl_torch(name, mode):
    lp, old, adv, mask, omega = _batch(5, gspo_scale=name == "gspo")
    want, want_g = _torch_value_and_grad(name, lp, old, adv, mask, mode, omega)
    loss, _ = _call(name, lp, old, adv, mask, mode, omega)
    g = jax.grad(lambda x: _call(name, x, old, adv, mask, mode, omega)[0])(jnp.asarray(lp))
    np.testing.assert_allclose(float(loss), want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(g), want_g, rtol=1e-4, atol=1e-6)
    assert np.abs(want_g).sum() > 0


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_rollout_is_weights_match_verl_torch(name, mode):
    """rollout correction's IS weights inside every loss, as verl applies them (pg_losses * rollout_is_weights before
    agg_loss; geo_mean: their per-sequence geometric mean), omega included for stare; no gradient through w."""
    lp, old, adv, mask, omega = _batch(7, gspo_scale=name == "gspo")
    w = np.random.default_rng(8).choice([0.0, 0.3, 1.0, 1.7, 2.0], size=lp.shape).astype(np.float32) * mask
    t = {k: torch.tensor(v) for k, v in dict(lp=lp, old=old, adv=adv, m=mask, om=omega, w=w).items()}
    x = t["lp"].clone().requires_grad_(True)
    om = t["om"] if name == "stare" else None
    want = verl_loss(name, t["old"], x, t["adv"], t["m"], mode, OPTS[name], omega=om, is_w=t["w"])
    want.backward()
    loss, _ = _call(name, lp, old, adv, mask, mode, omega, rollout_is_weights=w)
    g = jax.grad(lambda z: _call(name, z, old, adv, mask, mode, omega, rollout_is_weights=w)[0])(jnp.asarray(lp))
    np.testing.assert_allclose(float(loss), float(want.detach()), rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(np.asarray(g), x.grad.numpy(), rtol=1e-4, atol=1e-6)
    unweighted, _ = _call(name, lp, old, adv, mask, mode, omega)
    assert abs(float(loss) - float(unweighted)) > 1e-4  # the weights act
    with pytest.raises(ValueError, match="rollout_is_weights must have shape"):
        _call(name, lp, old, adv, mask, mode, omega, rollout_is_weights=w[:, :-1])


@pytest.mark.parametrize("name", representative(["clip_cov", "kl_cov"]))
@pytest.mark.parametrize("mode", representative(["token-mean", "seq-mean-token-mean"]))
def test_micro_batch_scope_is_verl_per_micro_batch(name, mode):
    """scope micro_batch: each group of micro_batch_size sequences is what verl computes on one GPU micro-batch
    (its own means, counts and choice), aggregated with the global denominator (verl's global_batch_info)."""
    lp, old, adv, mask, _ = _batch(6, b=16)
    g = 4
    loss, _ = _call(name, lp, old, adv, mask, mode, scope="micro_batch", micro_batch_size=g)
    glob = dict(num_tokens=float(mask.sum()), num_seqs=float((mask.sum(1) > 0).sum()))
    total, grad = 0.0, np.zeros_like(lp)
    for s in range(0, 16, g):
        sl = slice(s, s + g)
        t = [torch.tensor(a[sl]) for a in (old, lp, adv, mask)]
        x = t[1].clone().requires_grad_(True)
        part = verl_loss(name, t[0], x, t[2], t[3], mode, OPTS[name], **glob)
        part.backward()
        total += float(part.detach())
        grad[sl] = x.grad.numpy()
    np.testing.assert_allclose(float(loss), total, rtol=1e-5)
    jg = jax.grad(lambda z: _call(name, z, old, adv, mask, mode, scope="micro_batch", micro_batch_size=g)[0])(lp)
    np.testing.assert_allclose(np.asarray(jg), grad, rtol=1e-4, atol=1e-6)
    # the global scope ranks the whole batch at once: a different selection on this batch
    assert float(_call(name, lp, old, adv, mask, mode)[0]) != pytest.approx(total, rel=1e-6)


def test_kl_cov_mask_ties_by_lowest_index_and_empty():
    valid = jnp.ones((2, 4), bool)
    adv = jnp.array([[1.0] * 4, [-1.0] * 4])
    lp = jnp.array([[-1.0, -1.0, -1.0, -1.0], [-2.0, -2.0, -2.0, -2.0]])
    sel = np.asarray(kl_cov_mask(lp, adv, valid, kl_cov_ratio=0.25))  # k = 2 of 8 equal covariances
    assert sel.sum() == 2 and sel[0, 0] and sel[0, 1]
    assert not np.asarray(kl_cov_mask(lp, adv, ~valid, kl_cov_ratio=0.25)).any()


# ---------------------------------------------------------------------------------------------------------------
# Micro-batch accumulation, sharding, bad input


@pytest.mark.parametrize("name", [n for n in POLICY_LOSSES if n not in ("clip_cov", "kl_cov")])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"])
def test_micro_batch_accumulation_equals_full_batch(name, mode):
    lp, old, adv, mask, omega = _batch(2, gspo_scale=name == "gspo")
    norm = policy_loss_normalizer(name, mask, mode)

    def f(x, sl, nm=None):
        extra = {"normalizer": nm} if nm is not None else {}
        return _call(name, x, old[sl], adv[sl], mask[sl], mode, omega[sl], **extra)[0]

    full = f(lp, slice(None))
    gfull = jax.grad(lambda x: f(x, slice(None)))(lp)
    parts = [slice(2 * k, 2 * k + 2) for k in range(4)]
    np.testing.assert_allclose(sum(float(f(lp[sl], sl, norm)) for sl in parts), float(full), rtol=1e-5, atol=1e-8)
    gacc = np.concatenate([np.asarray(jax.grad(lambda x, sl=sl: f(x, sl, norm))(lp[sl])) for sl in parts])
    np.testing.assert_allclose(gacc, np.asarray(gfull), rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_sharded_equals_single_device(name):
    lp, old, adv, mask, omega = _batch(3, gspo_scale=name == "gspo")
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    sh = NamedSharding(mesh, P("data"))

    def f(lp, old, adv, mask, omega):
        loss, met = _call(name, lp, old, adv, mask, "token-mean", omega)
        return loss, met["clipfrac"], met["approx_kl"]

    vg = jax.jit(jax.value_and_grad(lambda *a: f(*a)[0]))
    single = jax.jit(f)(lp, old, adv, mask, omega), vg(lp, old, adv, mask, omega)
    args = [jax.device_put(a, sh) for a in (lp, old, adv, mask, omega)]
    sharded = jax.jit(f)(*args), vg(*args)
    assert args[0].sharding.num_devices == 8
    for a, b in zip(jax.tree.leaves(single), jax.tree.leaves(sharded)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-8)


def test_jitted_step_count_traced_key():
    """The clip_cov key may be derived from a traced step inside jit (no retrace per step)."""
    lp, old, adv, mask, _ = _batch(4)
    f = jax.jit(
        lambda step: compute_policy_loss("clip_cov", old, lp, adv, mask, key=clip_cov_key(0, step), **OPTS["clip_cov"])[
            0
        ]
    )
    assert np.isfinite(float(f(jnp.int32(1)))) and np.isfinite(float(f(jnp.int32(2))))
    assert f._cache_size() == 1


@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_all_masked_is_zero_not_nan(name):
    lp, old, adv, mask, omega = _batch(4)
    lp[:, -1] = np.nan
    loss, met = _call(name, lp, old, adv, np.zeros_like(mask), "token-mean", omega)
    assert float(loss) == 0.0 and all(np.isfinite(float(v)) for v in met.values())
    mask[:, -1] = 0
    g = jax.grad(lambda x: _call(name, x, old, adv, mask, "token-mean", omega)[0])(lp)
    assert np.isfinite(np.asarray(g)).all()


def test_bad_input():
    lp, old, adv, mask, omega = _batch(4)
    with pytest.raises(ValueError, match="'vanila' is unknown; did you mean 'vanilla'"):
        compute_policy_loss("vanila", old, lp, adv, mask)
    with pytest.raises(ValueError, match="clip_cov_ratio, omega_BxT do not belong to policy loss 'vanilla'"):
        compute_policy_loss("vanilla", old, lp, adv, mask, clip_cov_ratio=0.1, omega_BxT=omega)
    with pytest.raises(ValueError, match="clip_ratio_c do not belong to policy loss 'gspo'"):
        compute_policy_loss("gspo", old, lp, adv, mask, clip_ratio_c=3.0)
    with pytest.raises(ValueError, match="needs key="):
        compute_policy_loss("clip_cov", old, lp, adv, mask)
    with pytest.raises(ValueError, match="micro_batch_size"):
        compute_policy_loss("kl_cov", old, lp, adv, mask, scope="micro_batch")
    with pytest.raises(ValueError, match="clip_ratio_c=1.0 must be > 1"):
        compute_policy_loss("vanilla", old, lp, adv, mask, clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="loss_agg_mode='mean'"):
        compute_policy_loss("gpg", old, lp, adv, mask, loss_agg_mode="mean")
    with pytest.raises(ValueError, match="advantages_BxT"):
        compute_policy_loss("gpg", old, lp, adv[:3], mask)


@pytest.mark.parametrize("name", ["clip_cov", "kl_cov", "gspo", "cispo", "gpg", "sapo"])
def test_omega_weights_every_token_level_loss_after_it_is_computed(name):
    """STARE's omega (or the 80/20 filter) composes with the token-level losses: loss_tok * omega, stop-gradient."""
    lp, old, adv, mask, omega = _batch(7, gspo_scale=name == "gspo")
    unit, _ = _call(name, lp, old, adv, mask, "token-mean", omega_BxT=np.ones_like(omega))
    np.testing.assert_allclose(float(unit), float(_call(name, lp, old, adv, mask, "token-mean")[0]), rtol=1e-6)
    two, _ = _call(name, lp, old, adv, mask, "token-mean", omega_BxT=2 * np.ones_like(omega))
    np.testing.assert_allclose(float(two), 2 * float(unit), rtol=1e-6)
    g1 = jax.grad(lambda x: _call(name, x, old, adv, mask, "token-mean")[0])(lp)
    gw = jax.grad(lambda x: _call(name, x, old, adv, mask, "token-mean", omega_BxT=omega)[0])(lp)
    np.testing.assert_allclose(np.asarray(gw), omega * np.asarray(g1), rtol=1e-5, atol=1e-8)  # token-local
    with pytest.raises(ValueError, match="omega_BxT do not belong to policy loss 'geo_mean'"):
        compute_policy_loss("geo_mean", old, lp, adv, mask, omega_BxT=omega)
