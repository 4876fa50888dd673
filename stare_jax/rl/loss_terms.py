"""Terms beside the policy loss, as pure functions with verl's semantics and names:

- entropy_bonus:      verl dp_actor's entropy_coeff: loss -= entropy_coeff * agg_loss(entropy, mask, mode)
- kl_penalty:         verl core_algos.kl_penalty estimators of KL(pi || pi_ref) per token: "kl"/"k1", "abs",
                      "mse"/"k2", "low_var_kl"/"k3"
- kl_loss:            verl's use_kl_loss: loss += kl_loss_coef * agg_loss(kl_penalty(lp, ref_lp), mask, mode)
- kl_reward_penalty:  verl ray_trainer.apply_kl_penalty: token rewards = scores - kl_coef * kl_penalty(old, ref) * mask
- high_entropy_mask:  the 80/20 rule (Wang et al. 2025): only the top-rho highest-entropy tokens of the batch keep
                      a policy gradient (TRL's top_entropy_quantile: threshold = quantile of the valid tokens'
                      entropies at 1 - rho, keep entropy >= threshold), chosen globally with STARE's
                      order-statistic machinery (rl.stare.select.top_fraction_mask), no sort.

Aggregation is stare_jax.rl.losses.aggregate (global `normalizer` when called per micro-batch). A reference-model
forward does not exist yet: kl_loss / kl_reward_penalty take the reference log-probs as an input.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from stare_jax.rl.losses import AGG_MODES, abs_sign_grad, aggregate
from stare_jax.rl.stare.select import top_fraction_mask

KL_ESTIMATORS = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
TOKEN_FILTER_RULES = ("quantile", "exact_top_k")


def _masked(x_BxT, mask_BxT):
    valid = jnp.asarray(mask_BxT) > 0
    return jnp.where(valid, jnp.asarray(x_BxT, jnp.float32), 0.0), valid


def _check_agg(mode: str) -> None:
    if mode not in AGG_MODES:
        raise ValueError(f"loss_agg_mode={mode!r} is not supported; accepted values: {list(AGG_MODES)}")


def entropy_bonus(entropy_BxT, mask_BxT, entropy_coeff: float, *, loss_agg_mode: str = "token-mean", normalizer=None):
    """(term to ADD to the loss = -entropy_coeff * H_agg, H_agg) with H_agg = agg_loss(entropy, mask, mode) (verl
    dp_actor). The entropy keeps its gradient (stare_jax's log-prob pass differentiates it)."""
    _check_agg(loss_agg_mode)
    ent, valid = _masked(entropy_BxT, mask_BxT)
    h_agg, _ = aggregate(ent, valid, loss_agg_mode, normalizer)
    return -float(entropy_coeff) * h_agg, h_agg


def kl_penalty(logprobs_BxT, ref_logprobs_BxT, kind: str = "low_var_kl"):
    """Per-token estimate of KL(pi || pi_ref) from the sampled tokens' log-probs (verl kl_penalty_forward;
    Schulman's k1 / k2 / k3): kl|k1 = lp - ref; abs = |lp - ref|; mse|k2 = (lp - ref)^2 / 2; low_var_kl|k3 =
    clip(exp(ref - lp) - (ref - lp) - 1, -10, 10) with ref - lp clamped to [-20, 20]."""
    lp = jnp.asarray(logprobs_BxT, jnp.float32)
    ref = jnp.asarray(ref_logprobs_BxT, jnp.float32)
    if kind in ("kl", "k1"):
        return lp - ref
    if kind == "abs":
        return abs_sign_grad(lp - ref)
    if kind in ("mse", "k2"):
        return 0.5 * jnp.square(lp - ref)
    if kind in ("low_var_kl", "k3"):
        kl = jnp.clip(ref - lp, -20.0, 20.0)
        return jnp.clip(jnp.exp(kl) - kl - 1.0, -10.0, 10.0)
    raise ValueError(f"KL estimator {kind!r} is not supported; accepted values: {list(KL_ESTIMATORS)}")


def kl_loss(
    logprobs_BxT,
    ref_logprobs_BxT,
    mask_BxT,
    kl_loss_coef: float,
    *,
    kind: str = "low_var_kl",
    loss_agg_mode: str = "token-mean",
    normalizer=None,
):
    """(term to ADD to the loss = kl_loss_coef * KL_agg, KL_agg) with KL_agg = agg_loss(kl_penalty(lp, ref), mask,
    mode) (verl dp_actor use_kl_loss; the reference log-probs carry no gradient)."""
    _check_agg(loss_agg_mode)
    valid = jnp.asarray(mask_BxT) > 0
    lp = jnp.where(valid, jnp.asarray(logprobs_BxT, jnp.float32), 0.0)
    ref = jnp.where(valid, lax.stop_gradient(jnp.asarray(ref_logprobs_BxT, jnp.float32)), 0.0)
    kld = jnp.where(valid, kl_penalty(lp, ref, kind), 0.0)
    kl_agg, _ = aggregate(kld, valid, loss_agg_mode, normalizer)
    return float(kl_loss_coef) * kl_agg, kl_agg


def kl_reward_penalty(
    token_scores_BxT, old_logprobs_BxT, ref_logprobs_BxT, mask_BxT, kl_coef: float, *, kind: str = "kl"
):
    """(token-level rewards = scores - kl_coef * kl_penalty(old, ref) * mask, current_kl = mean over sequences of
    each sequence's mean KL over its tokens) (verl ray_trainer.apply_kl_penalty, fixed coefficient; the GRPO
    advantage then sums the token rewards per sequence)."""
    valid = jnp.asarray(mask_BxT) > 0
    old = jnp.where(valid, jnp.asarray(old_logprobs_BxT, jnp.float32), 0.0)
    ref = jnp.where(valid, jnp.asarray(ref_logprobs_BxT, jnp.float32), 0.0)
    kld = jnp.where(valid, kl_penalty(old, ref, kind), 0.0)
    m = valid.astype(jnp.float32)
    current_kl = jnp.mean(jnp.sum(kld, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0))
    return jnp.asarray(token_scores_BxT, jnp.float32) - float(kl_coef) * kld, current_kl


def high_entropy_mask(entropy_BxT, mask_BxT, rho: float = 0.2, *, rule: str = "quantile"):
    """bool [B, T], stop-gradient: the valid tokens among the top-rho by entropy over the whole (possibly sharded)
    batch (the 80/20 rule). Multiply the per-token policy loss by it (after clipping, like omega; the normaliser
    stays the count of all valid tokens, as TRL does), so only these tokens carry a gradient."""
    if not 0.0 < rho <= 1.0:
        raise ValueError(f"80/20 token filter: rho={rho} must be in (0, 1]")
    if rule not in TOKEN_FILTER_RULES:
        raise ValueError(f"80/20 token filter: rule={rule!r} unknown; accepted: {list(TOKEN_FILTER_RULES)}")
    ent = lax.stop_gradient(jnp.asarray(entropy_BxT, jnp.float32))
    return top_fraction_mask(ent, mask_BxT, rho, rule=rule)
