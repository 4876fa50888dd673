"""Clipped policy-gradient loss (verl `compute_policy_loss_vanilla` with dual clip) with STARE token weights.

    log_ratio = clamp(lp - old_lp, -20, 20); ratio = exp(log_ratio)
    L1 = -A ratio; L2 = -A clamp(ratio, 1 - clip_low, 1 + clip_high); Lclip = max(L1, L2)
    L3 = -A clip_c; Ldual = min(L3, Lclip); loss_tok = where(A < 0, Ldual, Lclip)
    loss_tok = omega * loss_tok          (omega multiplies AFTER clipping; omega is stop-gradient)

Aggregation over the WHOLE training batch; when called per micro-batch pass `normalizer` = the global count
(tokens for token-mean, sequences with >= 1 token for the seq-mean-* modes, the fixed constant for
seq-mean-token-sum-norm) so that summing micro-batch losses gives exactly the full-batch loss.
"""
from __future__ import annotations

import jax.numpy as jnp
from jax import lax

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def loss_normalizer(mask_BxT, agg: str = "token-mean"):
    """The denominator `policy_loss` uses for a (global) batch: token count, count of sequences with >= 1 token,
    or, for seq-mean-token-sum-norm, the fixed constant T (max response length = the mask's time length)."""
    m = jnp.asarray(mask_BxT, jnp.float32)
    if agg == "token-mean":
        return jnp.sum(m)
    if agg in ("seq-mean-token-sum", "seq-mean-token-mean"):
        return jnp.sum(jnp.sum(m, axis=1) > 0).astype(jnp.float32)
    if agg == "seq-mean-token-sum-norm":
        return jnp.asarray(float(m.shape[1]), jnp.float32)
    raise ValueError(f"loss aggregation agg={agg!r} is not supported; accepted values: {list(AGG_MODES)}")


def policy_loss(logprobs_BxT, old_logprobs_BxT, advantages_B, mask_BxT, *, omega_BxT=None, clip_low: float = 0.2,
                clip_high: float = 0.28, clip_c: float = 10.0, agg: str = "token-mean", normalizer=None):
    """Returns (loss, metrics). metrics: clipfrac, clipfrac_lower, approx_kl (means over this call's valid tokens)
    and their *_sum plus token_count so micro-batch metrics can be reduced exactly; an all-masked batch gives
    loss 0 and metrics 0 (never NaN)."""
    if agg not in AGG_MODES:
        raise ValueError(f"loss aggregation agg={agg!r} is not supported; accepted values: {list(AGG_MODES)}")
    if clip_c <= 1.0:
        raise ValueError(f"dual-clip constant clip_c={clip_c} must be > 1")
    if not (0.0 <= clip_low < 1.0) or clip_high < 0.0:
        raise ValueError(f"clip ranges must satisfy 0 <= clip_low < 1 and clip_high >= 0, got "
                         f"clip_low={clip_low}, clip_high={clip_high}")
    lp = jnp.asarray(logprobs_BxT, jnp.float32)
    if lp.ndim != 2:
        raise ValueError(f"logprobs_BxT must be 2-D [batch, time], got shape {lp.shape}")
    for name, arr in (("old_logprobs_BxT", old_logprobs_BxT), ("mask_BxT", mask_BxT)):
        if jnp.shape(arr) != lp.shape:
            raise ValueError(f"{name} must have shape {lp.shape}, got {jnp.shape(arr)}")
    if jnp.shape(advantages_B) != lp.shape[:1]:
        raise ValueError(f"advantages_B must have shape {lp.shape[:1]}, got {jnp.shape(advantages_B)}")
    valid = jnp.asarray(mask_BxT) > 0
    m = valid.astype(jnp.float32)
    # Sanitise masked positions first so padding garbage can't leak NaN into values or gradients.
    lp = jnp.where(valid, lp, 0.0)
    old = jnp.where(valid, lax.stop_gradient(jnp.asarray(old_logprobs_BxT, jnp.float32)), 0.0)
    adv = lax.stop_gradient(jnp.asarray(advantages_B, jnp.float32))[:, None]

    log_ratio = jnp.clip(lp - old, -20.0, 20.0)
    ratio = jnp.exp(log_ratio)
    l1 = -adv * ratio
    l2 = -adv * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    lclip = jnp.maximum(l1, l2)
    l3 = -adv * clip_c
    ldual = jnp.minimum(l3, lclip)
    loss_tok = jnp.where(adv < 0, ldual, lclip)
    if omega_BxT is not None:
        if jnp.shape(omega_BxT) != lp.shape:
            raise ValueError(f"omega_BxT must have shape {lp.shape}, got {jnp.shape(omega_BxT)}")
        loss_tok = lax.stop_gradient(jnp.asarray(omega_BxT, jnp.float32)) * loss_tok
    loss_tok = jnp.where(valid, loss_tok, 0.0)

    seq_sum_B = jnp.sum(loss_tok, axis=1)
    seq_cnt_B = jnp.sum(m, axis=1)
    if agg == "token-mean":
        numer = jnp.sum(seq_sum_B)
    elif agg == "seq-mean-token-sum":
        numer = jnp.sum(seq_sum_B)
    elif agg == "seq-mean-token-mean":
        numer = jnp.sum(seq_sum_B / jnp.maximum(seq_cnt_B, 1.0))
    else:
        numer = jnp.sum(seq_sum_B)
    denom = loss_normalizer(mask_BxT, agg) if normalizer is None else jnp.asarray(normalizer, jnp.float32)
    loss = numer / jnp.maximum(denom, 1e-8) if agg == "seq-mean-token-sum-norm" else numer / jnp.maximum(denom, 1.0)

    count = jnp.sum(m)
    clip_sum = jnp.sum(jnp.where(valid & (l2 > l1), 1.0, 0.0))
    lower_sum = jnp.sum(jnp.where(valid & (lclip > l3) & (adv < 0), 1.0, 0.0))
    kl_sum = jnp.sum(jnp.where(valid, -log_ratio, 0.0))
    safe = jnp.maximum(count, 1.0)
    metrics = {
        "clipfrac": clip_sum / safe, "clipfrac_lower": lower_sum / safe, "approx_kl": kl_sum / safe,
        "clipfrac_sum": clip_sum, "clipfrac_lower_sum": lower_sum, "approx_kl_sum": kl_sum,
        "token_count": count, "loss_numerator": numer,
    }
    return loss, metrics
