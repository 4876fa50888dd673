"""Rollout correction: the sampler/trainer mismatch measured and corrected, with verl's names and semantics
(verl/trainer/ppo/rollout_corr_helper.py, docs/algo/rollout_corr.md; decoupled mode).

The rollout's log-probs (the sampler's own program: paged attention, its compute dtype) and the trainer's
recomputed "old" log-probs of the same tokens differ by rounding, most in the low-probability tail - the
high-surprisal tokens STARE selects. With log_ratio = log pi_train - log pi_rollout per response token:

- IS weights (`rollout_is`): "token" w_t = exp(log_ratio_t); "sequence" w = exp(sum_t log_ratio_t) broadcast over
  the sequence; both with log-space clamps at +-20, zero on padding, truncated at `rollout_is_threshold` (TIS),
  optionally normalised to mean 1 over the batch (`rollout_is_batch_normalize`; over tokens, or over sequences),
  never differentiated. The policy loss multiplies its per-token loss by w before aggregation (verl's
  `pg_losses * rollout_is_weights`): STARE's omega scales the advantage inside the clipped surrogate, w scales
  the clipped term itself.
- Rejection (`rollout_rs`, comma-separated options, all must pass): per-token divergences k1 = -log_ratio,
  k2 = log_ratio^2 / 2, k3 = exp(log_ratio) - 1 - log_ratio, at token level ("token_k1|k2|k3") or aggregated per
  sequence ("seq_sum_k*", "seq_mean_k*", "seq_max_k2|k3"); a rejected token (or every token of a rejected
  sequence) leaves the loss mask. Thresholds (`rollout_rs_threshold`): one shared value or one per option; a k1
  option takes "lower_upper" ratio bounds or one upper bound U (lower 1/U), compared in log space.
- Diagnostics (`offpolicy_metrics`, always with rollout log-probs): KL(rollout || train) by k1 and k3, both
  perplexities, the log-perplexity difference, chi-square at token and sequence level, max |log_ratio|, and the
  same k1/k3/chi-square restricted to a token subset (STARE's selected high-surprisal tokens vs the rest).

Everything here is a pure jnp function over the global [B, T] arrays (jit- and sharding-friendly); the option
parsing is static (config time: stare_jax.config.rollout_correction). Means over "valid" tokens use the response mask.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from stare_jax.config.rollout_correction import IS_LEVELS, RS_OPTIONS, RejectionOption, parse_rejection

__all__ = [
    "IS_LEVELS",
    "RS_OPTIONS",
    "RejectionOption",
    "SAFETY_BOUND",
    "is_weights",
    "offpolicy_metrics",
    "parse_rejection",
    "rejection_mask",
]

SAFETY_BOUND = 20.0  # verl's clamp of log-ratios before exp: exp(20) ~ 4.9e8


def _float(x):
    """At least float32 (bf16 log-probs are upcast; float64 stays, for the tests' references)."""
    return x.astype(jnp.promote_types(x.dtype, jnp.float32))


def _masked_sum(x, mask, axis=None):
    """verl_F.masked_sum: values outside the mask (even inf/nan) count as 0."""
    return jnp.sum(jnp.where(mask > 0, x, 0.0) * mask, axis=axis)


def _masked_mean(x, mask, axis=None):
    """verl_F.masked_mean: masked sum / (mask count + 1e-8)."""
    return _masked_sum(x, mask, axis) / (jnp.sum(mask, axis=axis) + 1e-8)


def is_weights(log_ratio_BxT, mask_BxT, *, level: str, threshold: float, batch_normalize: bool = False):
    """Truncated IS weights [B, T] (zero on padding, no gradient) and their metrics (verl's names, before
    truncation where verl takes them so)."""
    if level not in IS_LEVELS:
        raise ValueError(f"rl.rollout_correction.rollout_is: {level!r} not in {IS_LEVELS} (or null: off)")
    m = _float(mask_BxT)
    lr = _float(log_ratio_BxT)
    if level == "token":
        w = jnp.exp(jnp.clip(lr, -SAFETY_BOUND, SAFETY_BOUND))
        lr_for_metrics = lr
    else:
        seq = _masked_sum(lr, m, axis=-1)[:, None]
        w = jnp.broadcast_to(jnp.exp(jnp.clip(seq, -SAFETY_BOUND, SAFETY_BOUND)), lr.shape)
        lr_for_metrics = seq
    w = w * m
    metrics = _is_metrics(w, lr_for_metrics, m, level, threshold)
    w = jax.lax.stop_gradient(jnp.minimum(w, threshold))
    if batch_normalize:
        if level == "token":
            mean = _masked_mean(w, m)
        else:
            seq_valid = (jnp.sum(m, axis=-1) > 0).astype(jnp.float32)
            mean = jnp.sum(_masked_mean(w, m, axis=-1) * seq_valid) / jnp.maximum(jnp.sum(seq_valid), 1e-8)
        ok = mean > 1e-8
        w = jnp.where(ok, w / jnp.where(ok, mean, 1.0), w)
        metrics["rollout_is_batch_norm_factor"] = jnp.where(ok, mean, 1.0)
    return w, metrics


def _is_metrics(w_BxT, lr_for_metrics, m, level: str, threshold: float) -> dict:
    lower = 1.0 / threshold
    out = {"rollout_is_mean": _masked_mean(w_BxT, m)}
    if level == "sequence":
        out["rollout_is_max"] = jnp.exp(jnp.minimum(jnp.max(lr_for_metrics), SAFETY_BOUND))
        out["rollout_is_min"] = jnp.exp(jnp.min(lr_for_metrics))
        out["rollout_is_ratio_fraction_high"] = jnp.mean((lr_for_metrics > math.log(threshold)).astype(jnp.float32))
        out["rollout_is_ratio_fraction_low"] = jnp.mean((lr_for_metrics < math.log(lower)).astype(jnp.float32))
    else:
        out["rollout_is_max"] = jnp.max(jnp.where(m > 0, w_BxT, -jnp.inf))
        out["rollout_is_min"] = jnp.min(jnp.where(m > 0, w_BxT, jnp.inf))
        out["rollout_is_ratio_fraction_high"] = _masked_mean((w_BxT > threshold).astype(jnp.float32), m)
        out["rollout_is_ratio_fraction_low"] = _masked_mean((w_BxT < lower).astype(jnp.float32), m)
    clamped = jnp.clip(w_BxT, lower, threshold)
    mean_c = _masked_mean(clamped, m)
    out["rollout_is_std"] = jnp.sqrt(jnp.maximum(_masked_mean(clamped**2, m) - mean_c**2, 0.0))
    normalized = clamped / (mean_c + 1e-8)
    out["rollout_is_eff_sample_size"] = 1.0 / _masked_mean(normalized**2, m)
    seq_w = _masked_mean(w_BxT, m, axis=-1)
    out["rollout_is_seq_mean"] = jnp.mean(seq_w)
    out["rollout_is_seq_max"] = jnp.max(seq_w)
    out["rollout_is_seq_min"] = jnp.min(seq_w)
    out["rollout_is_seq_max_deviation"] = jnp.max(jnp.abs(seq_w - 1.0))
    out["rollout_is_seq_fraction_high"] = jnp.mean((seq_w > threshold).astype(jnp.float32))
    out["rollout_is_seq_fraction_low"] = jnp.mean((seq_w < lower).astype(jnp.float32))
    return out


def _token_divergences(lr):
    safe = jnp.clip(lr, -SAFETY_BOUND, SAFETY_BOUND)
    return {"k1": -safe, "k2": 0.5 * safe**2, "k3": jnp.exp(safe) - 1.0 - safe}


def rejection_mask(log_ratio_BxT, mask_BxT, options: tuple[RejectionOption, ...]):
    """keep_BxT in {0, 1} (every option must pass; padding stays 0) and per-option masked fractions (verl's
    rollout_rs_<option>_masked_fraction / _seq_masked_fraction, rollout_rs_masked_fraction,
    rollout_rs_seq_masked_fraction)."""
    m = _float(mask_BxT)
    div = _token_divergences(_float(log_ratio_BxT))
    seq_valid = (jnp.sum(m, axis=-1) > 0).astype(jnp.float32)
    combined = jnp.ones_like(m)
    metrics = {}
    for opt in options:
        level, _, k = opt.name.rpartition("_")
        stat = div[k]
        if level == "seq_sum":
            stat = _masked_sum(stat, m, axis=-1)[:, None]
        elif level == "seq_mean":
            stat = _masked_mean(stat, m, axis=-1)[:, None]
        elif level == "seq_max":
            mx = jnp.max(jnp.where(m > 0, stat, -jnp.inf), axis=-1)
            stat = jnp.where(jnp.isneginf(mx), 0.0, mx)[:, None]
        keep = stat <= opt.upper
        if opt.lower is not None:
            keep = keep & (stat >= opt.lower)
        keep = jnp.broadcast_to(keep, m.shape).astype(jnp.float32)
        combined = combined * keep
        seq_keep = jnp.all((keep > 0) | (m == 0), axis=-1).astype(jnp.float32)
        metrics[f"rollout_rs_{opt.name}_masked_fraction"] = _masked_mean(1.0 - keep, m)
        metrics[f"rollout_rs_{opt.name}_seq_masked_fraction"] = jnp.sum((1.0 - seq_keep) * seq_valid) / jnp.maximum(
            jnp.sum(seq_valid), 1e-8
        )
    metrics["rollout_rs_masked_fraction"] = _masked_mean(1.0 - combined, m)
    seq_has_masked = jnp.any((combined <= 0.5) & (m > 0), axis=-1)
    metrics["rollout_rs_seq_masked_fraction"] = jnp.mean(seq_has_masked.astype(jnp.float32))
    return combined * m, metrics


def offpolicy_metrics(train_logp_BxT, rollout_logp_BxT, mask_BxT, subsets: dict | None = None) -> dict:
    """verl's off-policy diagnostics (training_ppl, training_log_ppl, kl, k3_kl, rollout_ppl, rollout_log_ppl,
    log_ppl_diff, log_ppl_abs_diff, log_ppl_diff_max/min, ppl_ratio, chi2_token, chi2_seq), plus
    max_abs_log_ratio and, per named token subset ({name: mask_BxT}, e.g. STARE's selected tokens), its kl,
    k3_kl and chi2_token."""
    m = _float(mask_BxT)
    old, roll = _float(train_logp_BxT), _float(rollout_logp_BxT)
    mean_old = _masked_mean(old, m, axis=-1)
    mean_roll = _masked_mean(roll, m, axis=-1)
    lr = old - roll
    log_ppl_diff = mean_roll - mean_old
    out = {
        "training_ppl": jnp.mean(jnp.exp(-mean_old)),
        "training_log_ppl": jnp.mean(-mean_old),
        "rollout_ppl": jnp.mean(jnp.exp(-mean_roll)),
        "rollout_log_ppl": jnp.mean(-mean_roll),
        "log_ppl_diff": jnp.mean(log_ppl_diff),
        "log_ppl_abs_diff": jnp.mean(jnp.abs(log_ppl_diff)),
        "log_ppl_diff_max": jnp.max(log_ppl_diff),
        "log_ppl_diff_min": jnp.min(log_ppl_diff),
        "ppl_ratio": jnp.mean(jnp.exp(log_ppl_diff)),
        "chi2_seq": jnp.mean(jnp.exp(2.0 * jnp.clip(_masked_sum(lr, m, axis=-1), -SAFETY_BOUND, SAFETY_BOUND))) - 1.0,
        "max_abs_log_ratio": jnp.max(jnp.where(m > 0, jnp.abs(lr), 0.0)),
    }
    for name, sub in {"": m, **{f"{k}_": v.astype(jnp.float32) * m for k, v in (subsets or {}).items()}}.items():
        out[f"{name}kl"] = _masked_mean(roll - old, sub)
        out[f"{name}k3_kl"] = _masked_mean(jnp.exp(lr) - lr - 1.0, sub)
        out[f"{name}chi2_token"] = _masked_mean(jnp.exp(jnp.clip(lr, -SAFETY_BOUND, SAFETY_BOUND)) ** 2, sub) - 1.0
    return out
