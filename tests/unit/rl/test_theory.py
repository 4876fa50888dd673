"""Theory quantities: Theorem 3.1 by finite differences, Theorem 3.4, Proposition 3.2 (s*), batch terms."""

import numpy as np
import pytest

from stare_jax.rl.theory import batch_entropy_terms, critical_surprisal, entropy_and_s2_from_logprobs, phi


def _softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _H(p):
    return -(p * np.log(p)).sum(-1)


def _dists(seed, V=40, n=4):
    rng = np.random.default_rng(seed)
    z = rng.normal(size=(n, V)) * np.array([0.5, 1.5, 3.0, 6.0])[:, None]  # flat ... peaked
    return z, _softmax(z)


@pytest.mark.parametrize("A", [1.3, -0.7])
def test_theorem_3_1_finite_differences(A):
    z, pi = _dists(0)
    eta = 1e-5
    for i in range(len(pi)):
        for a in (int(np.argmax(pi[i])), int(np.argmin(pi[i])), 7):
            d = A * (np.eye(pi.shape[1])[a] - pi[i])
            dH = (_H(_softmax(z[i] + eta * d)) - _H(_softmax(z[i] - eta * d))) / (2 * eta)
            got = -A * float(phi(pi[i].astype(np.float32), np.float32(pi[i, a])))
            np.testing.assert_allclose(got, dH, rtol=2e-3, atol=2e-5)


def test_theorem_3_4_entropy_neutrality():
    _, pi = _dists(1)
    vals = np.asarray(phi(pi.astype(np.float32), pi.astype(np.float32)))  # Phi at every vocabulary entry
    np.testing.assert_allclose((pi * vals).sum(-1), 0.0, atol=2e-6)


def test_critical_surprisal_properties():
    _, pi = _dists(2)
    s_star = np.asarray(critical_surprisal(pi.astype(np.float32)))
    H = _H(pi)
    p_star = np.exp(-s_star)
    assert np.all(p_star > np.exp(-H)) and np.all(p_star < 1)
    S2 = (pi**2 * (np.log(pi) + H[:, None])).sum(-1)
    np.testing.assert_allclose(p_star * (np.log(p_star) + H) - S2, 0.0, atol=1e-6)
    grid = np.linspace(1e-4, 1 - 1e-4, 2001)
    f = grid[None] * (np.log(grid[None]) + H[:, None]) - S2[:, None]
    sel = grid[None] > np.exp(-H)[:, None]
    far = np.abs(grid[None] - p_star[:, None]) > 1e-4
    assert np.all(((f > 0) == (grid[None] > p_star[:, None]))[sel & far])
    # from log-probs: same H, S2
    h2, s22 = entropy_and_s2_from_logprobs(np.log(pi).astype(np.float32))
    np.testing.assert_allclose(np.asarray(h2), H, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(s22), S2, rtol=1e-4, atol=1e-7)


def test_batch_terms_match_numpy():
    rng = np.random.default_rng(3)
    B, T = 5, 9
    ph = rng.normal(size=(B, T)).astype(np.float32)
    adv = np.array([1.0, -1.0, 0.5, 0.0, -2.0], np.float32)
    mask = (rng.uniform(size=(B, T)) < 0.8).astype(np.float32)
    pos = (rng.uniform(size=(B, T)) < 0.3) & (adv[:, None] > 0) & (mask > 0)
    neg = (rng.uniform(size=(B, T)) < 0.3) & (adv[:, None] < 0) & (mask > 0)
    om = np.where(pos, 1.2, np.where(neg, 0.8, 1.0)).astype(np.float32)
    out = batch_entropy_terms(ph, adv, mask, omega_BxT=om, pos_set_BxT=pos, neg_set_BxT=neg)
    aphi = adv[:, None] * ph * mask
    lam, gp, gn = aphi.sum(), -aphi[pos].sum(), aphi[neg].sum()
    N = mask.sum()
    np.testing.assert_allclose(float(out["lambda"]), lam, rtol=1e-5)
    np.testing.assert_allclose(float(out["gamma_pos"]), gp, rtol=1e-5)
    np.testing.assert_allclose(float(out["gamma_neg"]), gn, rtol=1e-5)
    # the paper's decomposition: -(1/N)[Lambda - (W-1) Gamma+ - (1-M) Gamma-]
    np.testing.assert_allclose(float(out["predicted_dH"]), -(lam - 0.2 * gp - 0.2 * gn) / N, rtol=1e-5)
    np.testing.assert_allclose(float(out["grpo_predicted_dH"]), -lam / N, rtol=1e-5)
    if gp > 0:
        np.testing.assert_allclose(float(out["w_star"]), 1 + lam / gp, rtol=1e-5)
