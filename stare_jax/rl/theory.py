"""Entropy-sensitivity theory of the STARE paper (Section 3), vectorised over leading axes.

For a next-token distribution pi (last axis, V) with entropy H and a sampled token of probability p:
    S2 = sum_v pi_v^2 (ln pi_v + H);  Phi(p) = p (ln p + H) - S2
Theorem 3.1: under dz_v = eta A (delta_va - pi_v), dH/deta|0 = -A Phi(p_a).  Theorem 3.4: sum_v pi_v Phi(pi_v) = 0.
Proposition 3.2: unique p* in (e^-H, 1) with Phi(p*) = 0, Phi > 0 iff p > p*; critical surprisal s* = -ln p*.
Because Phi depends on pi only through (H, S2), s* is a scalar bisection per position (cheap inside a chunked pass).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_BISECT_ITERS = 40


def _xlogx(p):
    return jnp.where(p > 0, p * jnp.log(jnp.where(p > 0, p, 1.0)), 0.0)


def entropy_and_s2(probs_V):
    """(H, S2) of distributions on the last axis (0 ln 0 = 0)."""
    probs_V = jnp.asarray(probs_V, jnp.float32)
    h = -jnp.sum(_xlogx(probs_V), axis=-1)
    logp = jnp.log(jnp.where(probs_V > 0, probs_V, 1.0))
    s2 = jnp.sum(jnp.where(probs_V > 0, probs_V**2 * (logp + h[..., None]), 0.0), axis=-1)
    return h, s2


def entropy_and_s2_from_logprobs(logp_V):
    """(H, S2) from log-probabilities on the last axis (numerically safe for large vocabularies)."""
    logp_V = jnp.asarray(logp_V, jnp.float32)
    p = jnp.exp(logp_V)
    finite = jnp.isfinite(logp_V)
    lp = jnp.where(finite, logp_V, 0.0)
    h = -jnp.sum(jnp.where(finite, p * lp, 0.0), axis=-1)
    s2 = jnp.sum(jnp.where(finite, p * p * (lp + h[..., None]), 0.0), axis=-1)
    return h, s2


def phi_from_stats(p, h, s2):
    """Phi(p) given the distribution's entropy h and S2."""
    p = jnp.asarray(p, jnp.float32)
    return _xlogx(p) + p * h - s2


def phi(probs_V, p):
    """Entropy sensitivity Phi(p) = p (ln p + H) - S2 of distribution(s) probs_V (last axis V) at probability p
    (p broadcasts against the leading axes; it may carry an extra trailing axis to evaluate many p at once)."""
    h, s2 = entropy_and_s2(probs_V)
    p = jnp.asarray(p, jnp.float32)
    extra = p.ndim - h.ndim
    if extra > 0:
        h = h.reshape(h.shape + (1,) * extra)
        s2 = s2.reshape(s2.shape + (1,) * extra)
    return phi_from_stats(p, h, s2)


def critical_surprisal_from_stats(h, s2, iters: int = _BISECT_ITERS):
    """s* = -ln p* with Phi(p*) = 0, p* in (e^-H, 1), by bisection on s in [0, H] (Phi is increasing in p there).
    Degenerate H = 0 (one-hot): s* = 0."""
    h = jnp.asarray(h, jnp.float32)
    s2 = jnp.asarray(s2, jnp.float32)

    def body(_, lo_hi):
        lo, hi = lo_hi  # surprisal bracket: Phi(e^-lo) >= 0 >= Phi(e^-hi)
        mid = 0.5 * (lo + hi)
        f = phi_from_stats(jnp.exp(-mid), h, s2)
        return jnp.where(f > 0, mid, lo), jnp.where(f > 0, hi, mid)

    lo, hi = jax.lax.fori_loop(0, iters, body, (jnp.zeros_like(h), jnp.maximum(h, 0.0)))
    return 0.5 * (lo + hi)


def critical_surprisal(probs_V):
    """Critical surprisal s* of distribution(s) probs_V (last axis V)."""
    h, s2 = entropy_and_s2(probs_V)
    return critical_surprisal_from_stats(h, s2)


def batch_entropy_terms(phi_BxT, advantages_B, mask_BxT, *, omega_BxT=None, pos_set_BxT=None, neg_set_BxT=None):
    """Batch quantities of Section 3.3/4.2 with signs kept (the quantile proxy set need not be exact):
    Lambda = sum A Phi; Gamma+ = -sum_{L+} A Phi; Gamma- = sum_{L-} A Phi; W* = 1 + Lambda / Gamma+ (NaN when
    Gamma+ <= 0); predicted first-order entropy change per unit step, -(1/N) sum omega A Phi (omega = 1 if None);
    and grpo_predicted_dH = -(1/N) Lambda."""
    m = jnp.asarray(mask_BxT) > 0
    a_phi = jnp.where(m, jnp.asarray(advantages_B, jnp.float32)[:, None] * jnp.asarray(phi_BxT, jnp.float32), 0.0)
    n = jnp.maximum(jnp.sum(m), 1).astype(jnp.float32)
    lam = jnp.sum(a_phi)
    gamma_pos = -jnp.sum(jnp.where(pos_set_BxT, a_phi, 0.0)) if pos_set_BxT is not None else jnp.float32(0.0)
    gamma_neg = jnp.sum(jnp.where(neg_set_BxT, a_phi, 0.0)) if neg_set_BxT is not None else jnp.float32(0.0)
    w_star = jnp.where(gamma_pos > 0, 1.0 + lam / jnp.where(gamma_pos > 0, gamma_pos, 1.0), jnp.nan)
    omega = jnp.ones_like(a_phi) if omega_BxT is None else jnp.asarray(omega_BxT, jnp.float32)
    return {
        "lambda": lam,
        "gamma_pos": gamma_pos,
        "gamma_neg": gamma_neg,
        "w_star": w_star,
        "predicted_dH": -jnp.sum(omega * a_phi) / n,
        "grpo_predicted_dH": -lam / n,
    }
