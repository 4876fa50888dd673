"""Policy losses with verl's names and option names (verl/trainer/ppo/core_algos.py, v0.7.0 as forked by the STARE
authors), one entry point: `compute_policy_loss(name, old_logprobs_BxT, logprobs_BxT, advantages_BxT,
response_mask_BxT, *, loss_agg_mode, **options) -> (loss, metrics)`.

    name      verl function                       per-token loss (r = exp(lp - old), A = advantage)
    vanilla   compute_policy_loss_vanilla         dual clip: where(A<0, min(-A c, Lclip), Lclip), Lclip =
                                                  max(-A r, -A clip(r, 1-lo, 1+hi)), log r clamped to [-20, 20]
    stare     compute_policy_loss_stare           omega * vanilla (omega stop-gradient, multiplies AFTER clipping;
                                                  every token-level loss but vanilla accepts omega_BxT the same way)
    clip_cov  compute_policy_loss_clip_cov        max(-A r, -A clip(r)) * corr; corr = 0 (detached) on a random
                                                  clip_cov_ratio of the tokens whose covariance lies in (lb, ub)
    kl_cov    compute_policy_loss_kl_cov          -A r, plus ppo_kl_coef |lp - old| on the top kl_cov_ratio of
                                                  tokens by covariance
    gspo      compute_policy_loss_gspo            clipped surrogate on the sequence ratio (token-level gradient)
    cispo     compute_policy_loss_cispo           -sg(clip(r)) A lp
    gpg       compute_policy_loss_gpg             -A lp
    geo_mean  compute_policy_loss_geo_mean        -A_seq exp(mean_t sign-clipped log r), mean over sequences
    sapo      compute_policy_loss_sapo            -A sigmoid(tau (r - 1)) 4 / tau, tau = tau_pos (A>0) / tau_neg

Aggregation (verl `agg_loss`) over the WHOLE training batch: when called per micro-batch, pass
`normalizer=policy_loss_normalizer(name, global_mask, mode)` so that the micro-batch losses sum to the full-batch
loss. As in verl, gspo and sapo always aggregate with seq-mean-token-mean and geo_mean takes the mean over all
sequences, whatever loss_agg_mode says.

Deviations from verl (decisions):
- clip_cov / kl_cov choose their tokens over the whole array passed in (scope "batch", the default: with the
  global batch that is the global selection); verl selects per GPU micro-batch, which scope="micro_batch" with
  micro_batch_size reproduces (each consecutive group of that many sequences: its own means, count and choice).
- clip_cov's random choice: the clip_num eligible tokens with the smallest uniform draws of `key` (a
  jax.random key; derive it from (seed, step) with `clip_cov_key`). A uniform random subset like verl's
  torch.randperm, but it cannot reproduce torch's draws. kl_cov's top-k breaks ties by lowest flat index
  (torch.topk leaves them unspecified). Counts floor(ratio * n) use ratio as the nearest fraction with
  denominator <= 10^4 (exact for verl's 2e-4), so the integer arithmetic is exact at any token count.
- Masked positions are sanitised (their log-probs may be garbage or NaN) and never reach values or gradients.
- Rollout correction (stare_jax.rl.rollout_correction): every loss accepts `rollout_is_weights` [B, T] (verl's name
  and placement): a token-level loss multiplies its per-token loss by them before aggregation (after clipping, as
  omega); geo_mean multiplies each sequence's loss by the geometric mean of its weights, exp(mean_t log(w + 1e-10)).
- Every loss returns the same metric keys (clipfrac, clipfrac_lower, approx_kl = verl's ppo_kl, their *_sum,
  token_count, loss_numerator; 0 where verl reports nothing, e.g. gpg), so the train step reduces them alike.
"""

from __future__ import annotations

import difflib
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from stare_jax.rl.stare.select import mul_div_floor, p_fraction, top_k_mask

AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")
POLICY_LOSSES = ("vanilla", "stare", "clip_cov", "kl_cov", "gspo", "cispo", "gpg", "geo_mean", "sapo")
SCOPES = ("batch", "micro_batch")

_CLIP = ("clip_ratio", "clip_ratio_low", "clip_ratio_high")
_COV_SCOPE = ("scope", "micro_batch_size")
# the options each loss accepts (verl's actor-config names; scope / micro_batch_size / key / omega_BxT are ours)
# omega_BxT (STARE's token weights, or the 80/20 filter's 0/1) multiplies the per-token loss after clipping; every
# token-level loss takes it ("vanilla" with omega is "stare"); geo_mean has no per-token loss to weight.
_W = ("omega_BxT",)
LOSS_OPTIONS = {
    "vanilla": _CLIP + ("clip_ratio_c",),
    "stare": _CLIP + ("clip_ratio_c",) + _W,
    "clip_cov": _CLIP + ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "key") + _COV_SCOPE + _W,
    "kl_cov": ("kl_cov_ratio", "ppo_kl_coef") + _COV_SCOPE + _W,
    "gspo": _CLIP + _W,
    "cispo": _CLIP + _W,
    "gpg": _W,
    "geo_mean": _CLIP,
    "sapo": ("tau_pos", "tau_neg") + _W,
}
COMMON_OPTIONS = ("normalizer", "rollout_is_weights")
# verl's ActorConfig / PolicyLossConfig defaults (clip_ratio_low / _high fall back to clip_ratio)
DEFAULTS = {
    "clip_ratio": 0.2,
    "clip_ratio_low": None,
    "clip_ratio_high": None,
    "clip_ratio_c": 3.0,
    "clip_cov_ratio": 0.0002,
    "clip_cov_lb": 1.0,
    "clip_cov_ub": 5.0,
    "kl_cov_ratio": 0.0002,
    "ppo_kl_coef": 0.1,
    "tau_pos": 1.0,
    "tau_neg": 1.05,
    "key": None,
    "scope": "batch",
    "micro_batch_size": None,
    "omega_BxT": None,
    "normalizer": None,
    "rollout_is_weights": None,
}
# losses whose aggregation verl fixes regardless of loss_agg_mode ("seq-mean-all": mean over every sequence)
FIXED_AGG = {"gspo": "seq-mean-token-mean", "sapo": "seq-mean-token-mean", "geo_mean": "seq-mean-all"}


def _check_agg(mode: str) -> None:
    if mode not in AGG_MODES:
        raise ValueError(f"loss_agg_mode={mode!r} is not supported; accepted values: {list(AGG_MODES)}")


def loss_normalizer(mask_BxT, agg: str = "token-mean"):
    """The denominator of `agg` for a (global) batch: token count, count of sequences with >= 1 token, or, for
    seq-mean-token-sum-norm, the fixed constant T (max response length = the mask's time length)."""
    m = jnp.asarray(mask_BxT, jnp.float32)
    if agg == "token-mean":
        return jnp.sum(m)
    if agg in ("seq-mean-token-sum", "seq-mean-token-mean"):
        return jnp.sum(jnp.sum(m, axis=1) > 0).astype(jnp.float32)
    if agg == "seq-mean-token-sum-norm":
        return jnp.asarray(float(m.shape[1]), jnp.float32)
    if agg == "seq-mean-all":
        return jnp.asarray(float(m.shape[0]), jnp.float32)
    raise ValueError(f"loss aggregation agg={agg!r} is not supported; accepted values: {list(AGG_MODES)}")


def effective_agg(name: str, loss_agg_mode: str) -> str:
    """The aggregation loss `name` really uses (verl fixes it for gspo, sapo and geo_mean)."""
    return FIXED_AGG.get(name, loss_agg_mode)


def policy_loss_normalizer(name: str, mask_BxT, loss_agg_mode: str = "token-mean"):
    """The global `normalizer` to pass to per-micro-batch compute_policy_loss calls of loss `name`."""
    return loss_normalizer(mask_BxT, effective_agg(name, loss_agg_mode))


def aggregate(loss_tok_BxT, valid_BxT, agg: str, normalizer=None):
    """(loss, numerator) of a per-token loss already zeroed off `valid_BxT` (verl `agg_loss`); with `normalizer`
    the denominator is that global number instead of this array's own. seq-mean-token-mean divides each sequence
    by max(its count, 1) (verl: count + 1e-8)."""
    m = valid_BxT.astype(jnp.float32)
    seq_sum_B = jnp.sum(loss_tok_BxT, axis=1)
    if agg == "seq-mean-token-mean":
        numer = jnp.sum(seq_sum_B / jnp.maximum(jnp.sum(m, axis=1), 1.0))
    else:
        numer = jnp.sum(seq_sum_B)
    denom = loss_normalizer(m, agg) if normalizer is None else jnp.asarray(normalizer, jnp.float32)
    if agg == "seq-mean-token-sum-norm":
        return numer / jnp.maximum(denom, 1e-8), numer
    return numer / jnp.maximum(denom, 1.0), numer


def abs_sign_grad(x):
    """|x| whose gradient is sign(x), 0 at x == 0, as torch's abs (jnp.abs gives 1 there); the ratio is exactly
    1 on-policy, so kl_cov's and the "abs" KL estimator's gradients depend on it."""
    return jnp.where(x == 0, 0.0, jnp.abs(x))


def clip_cov_key(seed: int, step):
    """The PRNG key of clip_cov's random choice at a step: fold_in(key(seed), step) (step may be traced)."""
    return jax.random.fold_in(jax.random.key(seed), step)


# ---------------------------------------------------------------------------------------------------------------
# Options


def resolve_options(name: str, options: dict) -> dict:
    """Defaults + `options` for loss `name`; ValueError for an unknown name (closest suggested) or options that do
    not belong to it (named, with the ones it accepts)."""
    if name not in LOSS_OPTIONS:
        close = difflib.get_close_matches(str(name), POLICY_LOSSES, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"policy loss {name!r} is unknown{hint} (accepted: {', '.join(POLICY_LOSSES)})")
    allowed = LOSS_OPTIONS[name] + COMMON_OPTIONS
    foreign = sorted(k for k in options if k not in allowed)
    if foreign:
        raise ValueError(
            f"option(s) {', '.join(foreign)} do not belong to policy loss {name!r}; it accepts: {', '.join(allowed)}"
        )
    opts: dict[str, Any] = {k: DEFAULTS[k] for k in allowed}
    opts.update(options)
    if "clip_ratio" in opts:
        for side in ("clip_ratio_low", "clip_ratio_high"):
            if opts[side] is None:
                opts[side] = opts["clip_ratio"]
        if not (0.0 <= opts["clip_ratio_low"] < 1.0) or opts["clip_ratio_high"] < 0.0:
            raise ValueError(
                f"policy loss {name!r}: clip ranges must satisfy 0 <= clip_ratio_low < 1 and "
                f"clip_ratio_high >= 0, got clip_ratio_low={opts['clip_ratio_low']}, "
                f"clip_ratio_high={opts['clip_ratio_high']}"
            )
    if "clip_ratio_c" in opts and not opts["clip_ratio_c"] > 1.0:
        raise ValueError(f"policy loss {name!r}: dual-clip constant clip_ratio_c={opts['clip_ratio_c']} must be > 1")
    for k in ("clip_cov_ratio", "kl_cov_ratio"):
        if k in opts and not 0.0 < opts[k] <= 1.0:
            raise ValueError(f"policy loss {name!r}: {k}={opts[k]} must be in (0, 1]")
    if "scope" in opts:
        if opts["scope"] not in SCOPES:
            raise ValueError(f"policy loss {name!r}: scope={opts['scope']!r} unknown; accepted: {list(SCOPES)}")
        if opts["scope"] == "micro_batch" and not (opts["micro_batch_size"] or 0) >= 1:
            raise ValueError(
                f"policy loss {name!r}: scope='micro_batch' needs micro_batch_size >= 1 (sequences "
                "per selection group, verl's per-GPU micro-batch)"
            )
    if name == "clip_cov" and opts["key"] is None:
        raise ValueError(
            "policy loss 'clip_cov' needs key= a jax PRNG key for its random choice (clip_cov_key(seed, step))"
        )
    if name == "sapo" and not (opts["tau_pos"] > 0 and opts["tau_neg"] > 0):
        raise ValueError(f"policy loss 'sapo': tau_pos={opts['tau_pos']} and tau_neg={opts['tau_neg']} must be > 0")
    return opts


# ---------------------------------------------------------------------------------------------------------------
# Covariance selections (clip_cov / kl_cov)


def _grouped(fn, scope: str, group: int | None, *arrays_BxT):
    """fn over the flattened arrays (scope batch) or over each consecutive group of `group` sequences (vmapped)."""
    B, T = arrays_BxT[0].shape
    if scope == "batch":
        return fn(*(a.reshape(-1) for a in arrays_BxT)).reshape(B, T)
    if B % group:
        raise ValueError(f"scope='micro_batch': batch size {B} is not a multiple of micro_batch_size={group}")
    return jax.vmap(fn)(*(a.reshape(B // group, group * T) for a in arrays_BxT)).reshape(B, T)


def _centred_cov(lp_N, adv_N, valid_N):
    """(A - mean A) (lp - mean lp) with the means over the valid tokens (verl masked_mean), and the valid count."""
    n = jnp.sum(valid_N, dtype=jnp.int32)
    nf = jnp.maximum(n, 1).astype(jnp.float32)
    mean_a = jnp.sum(jnp.where(valid_N, adv_N, 0.0)) / nf
    mean_lp = jnp.sum(jnp.where(valid_N, lp_N, 0.0)) / nf
    return (adv_N - mean_a) * (lp_N - mean_lp), n


def clip_cov_mask(
    logprobs_BxT,
    advantages_BxT,
    valid_BxT,
    clipped_BxT,
    *,
    clip_cov_ratio: float,
    clip_cov_lb: float,
    clip_cov_ub: float,
    key,
    scope: str = "batch",
    micro_batch_size=None,
):
    """bool [B, T]: the tokens clip_cov detaches (verl compute_policy_loss_clip_cov's top_k_idx). Eligible: valid,
    not already clipped by the ratio clip, covariance in (lb, ub); min(max(floor(ratio n), 1), |eligible|) of them
    chosen uniformly at random (the smallest uniform draws of `key`)."""
    num, den = p_fraction(clip_cov_ratio)
    u_BxT = jax.random.uniform(key, jnp.shape(logprobs_BxT), jnp.float32)

    def one(lp_N, adv_N, valid_N, clipped_N, u_N):
        cov_N, n = _centred_cov(lp_N, adv_N, valid_N)
        eligible = valid_N & ~clipped_N & (cov_N > clip_cov_lb) & (cov_N < clip_cov_ub)
        clip_num = jnp.maximum(mul_div_floor(num, n, den)[0], 1)
        return top_k_mask(-u_N, eligible, clip_num)

    lp = lax.stop_gradient(logprobs_BxT)
    return _grouped(one, scope, micro_batch_size, lp, advantages_BxT, valid_BxT, clipped_BxT, u_BxT)


def kl_cov_mask(
    logprobs_BxT, advantages_BxT, valid_BxT, *, kl_cov_ratio: float, scope: str = "batch", micro_batch_size=None
):
    """bool [B, T]: the tokens kl_cov penalises (verl compute_policy_loss_kl_cov's large_cov_idxs): the
    max(1, floor(ratio n)) valid tokens of largest covariance (none when there are no valid tokens)."""
    num, den = p_fraction(kl_cov_ratio)

    def one(lp_N, adv_N, valid_N):
        cov_N, n = _centred_cov(lp_N, adv_N, valid_N)
        return top_k_mask(cov_N, valid_N, jnp.maximum(mul_div_floor(num, n, den)[0], 1))

    lp = lax.stop_gradient(logprobs_BxT)
    return _grouped(one, scope, micro_batch_size, lp, advantages_BxT, valid_BxT)


# ---------------------------------------------------------------------------------------------------------------
# Per-token losses: each returns {"tok": [B, T] or "seq": [B], "clip": bool, "lower": bool, "kl": [B, T]}


def _clipped_surrogate(lp, old, adv, o):
    log_ratio = jnp.clip(lp - old, -20.0, 20.0)
    ratio = jnp.exp(log_ratio)
    l1 = -adv * ratio
    l2 = -adv * jnp.clip(ratio, 1.0 - o["clip_ratio_low"], 1.0 + o["clip_ratio_high"])
    return log_ratio, l1, l2, jnp.maximum(l1, l2)


def _vanilla(lp, old, adv, valid, o):
    log_ratio, l1, l2, lclip = _clipped_surrogate(lp, old, adv, o)
    l3 = -adv * o["clip_ratio_c"]
    tok = jnp.where(adv < 0, jnp.minimum(l3, lclip), lclip)
    if o.get("omega_BxT") is not None:
        omega = jnp.asarray(o["omega_BxT"], jnp.float32)
        if omega.shape != lp.shape:
            raise ValueError(f"omega_BxT must have shape {lp.shape}, got {omega.shape}")
        tok = lax.stop_gradient(omega) * tok
    return {"tok": tok, "clip": l2 > l1, "lower": (lclip > l3) & (adv < 0), "kl": -log_ratio}


def _clip_cov(lp, old, adv, valid, o):
    neg_kl = lp - old  # verl: no clamp here
    ratio = jnp.exp(neg_kl)
    l1 = -adv * ratio
    l2 = -adv * jnp.clip(ratio, 1.0 - o["clip_ratio_low"], 1.0 + o["clip_ratio_high"])
    detach = clip_cov_mask(
        lp,
        adv,
        valid,
        (l2 > l1) & valid,
        clip_cov_ratio=o["clip_cov_ratio"],
        clip_cov_lb=o["clip_cov_lb"],
        clip_cov_ub=o["clip_cov_ub"],
        key=o["key"],
        scope=o["scope"],
        micro_batch_size=o["micro_batch_size"],
    )
    tok = jnp.where(detach, 0.0, jnp.maximum(l1, l2))
    return {"tok": tok, "clip": detach, "lower": jnp.zeros_like(valid), "kl": -neg_kl}


def _kl_cov(lp, old, adv, valid, o):
    neg_kl = lp - old
    l1 = -adv * jnp.exp(neg_kl)
    sel = kl_cov_mask(
        lp, adv, valid, kl_cov_ratio=o["kl_cov_ratio"], scope=o["scope"], micro_batch_size=o["micro_batch_size"]
    )
    abs_kl = abs_sign_grad(neg_kl)
    tok = jnp.where(sel, l1 + o["ppo_kl_coef"] * abs_kl, l1)
    return {"tok": tok, "clip": jnp.zeros_like(valid), "lower": jnp.zeros_like(valid), "kl": abs_kl}


def _gspo(lp, old, adv, valid, o):
    neg_kl = lp - old
    m = valid.astype(jnp.float32)
    seq_B = jnp.sum(neg_kl * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0)
    log_s = lp - lax.stop_gradient(lp) + lax.stop_gradient(seq_B)[:, None]
    ratio = jnp.exp(jnp.minimum(log_s, 10.0))
    l1 = -adv * ratio
    l2 = -adv * jnp.clip(ratio, 1.0 - o["clip_ratio_low"], 1.0 + o["clip_ratio_high"])
    return {"tok": jnp.maximum(l1, l2), "clip": l2 > l1, "lower": jnp.zeros_like(valid), "kl": -neg_kl}


def _cispo(lp, old, adv, valid, o):
    log_ratio = jnp.clip(lp - old, -20.0, 20.0)
    ratio = jnp.exp(log_ratio)
    clipped = jnp.clip(ratio, 1.0 - o["clip_ratio_low"], 1.0 + o["clip_ratio_high"])
    tok = -lax.stop_gradient(clipped) * adv * lp
    return {"tok": tok, "clip": ratio != clipped, "lower": jnp.zeros_like(valid), "kl": -log_ratio}


def _gpg(lp, old, adv, valid, o):
    zeros = jnp.zeros_like(valid)
    return {"tok": -lp * adv, "clip": zeros, "lower": zeros, "kl": old - lp}


def _geo_mean(lp, old, adv, valid, o):
    neg_kl = lp - old  # verl: no clamp
    m = valid.astype(jnp.float32)
    sgn = jnp.sign(adv)
    clamped = jnp.clip(neg_kl, -o["clip_ratio_low"], o["clip_ratio_high"])
    nk_min = sgn * jnp.minimum(sgn * neg_kl, sgn * clamped)
    cnt_B = jnp.sum(m, axis=1) + 1e-8
    ratio_B = jnp.exp(jnp.sum(nk_min * m, axis=1) / cnt_B)
    adv_B = jnp.sum(adv * m, axis=1) / cnt_B
    clipped = neg_kl != clamped
    return {"seq": -adv_B * ratio_B, "clip": clipped & (adv > 0), "lower": clipped & (adv < 0), "kl": -neg_kl}


def _sapo(lp, old, adv, valid, o):
    log_ratio = jnp.clip(lp - old, -20.0, 20.0)
    ratio = jnp.exp(log_ratio)
    tau = jnp.where(adv > 0, o["tau_pos"], o["tau_neg"])
    gate = jax.nn.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    zeros = jnp.zeros_like(valid)
    return {"tok": -gate * adv, "clip": zeros, "lower": zeros, "kl": -log_ratio}


_LOSS_FNS = {
    "vanilla": _vanilla,
    "stare": _vanilla,
    "clip_cov": _clip_cov,
    "kl_cov": _kl_cov,
    "gspo": _gspo,
    "cispo": _cispo,
    "gpg": _gpg,
    "geo_mean": _geo_mean,
    "sapo": _sapo,
}


# ---------------------------------------------------------------------------------------------------------------
# Entry point


def compute_policy_loss(
    name, old_logprobs_BxT, logprobs_BxT, advantages_BxT, response_mask_BxT, *, loss_agg_mode="token-mean", **options
):
    """(loss, metrics) of policy loss `name` (see the module docstring; verl's argument order). advantages_BxT:
    token-level [B, T] (verl) or one per sequence [B] (broadcast). options: verl's option names for that loss
    (LOSS_OPTIONS[name]) plus `normalizer` (the global denominator when called per micro-batch).

    metrics: clipfrac, clipfrac_lower, approx_kl (means over this call's valid tokens) and their *_sum plus
    token_count and loss_numerator, so micro-batch metrics reduce exactly; an all-masked batch gives loss 0 and
    metrics 0 (never NaN)."""
    _check_agg(loss_agg_mode)
    o = resolve_options(name, options)
    lp = jnp.asarray(logprobs_BxT, jnp.float32)
    if lp.ndim != 2:
        raise ValueError(f"logprobs_BxT must be 2-D [batch, time], got shape {lp.shape}")
    for arg, arr in (("old_logprobs_BxT", old_logprobs_BxT), ("response_mask_BxT", response_mask_BxT)):
        if jnp.shape(arr) != lp.shape:
            raise ValueError(f"{arg} must have shape {lp.shape}, got {jnp.shape(arr)}")
    adv = lax.stop_gradient(jnp.asarray(advantages_BxT, jnp.float32))
    if adv.shape == lp.shape[:1]:
        adv = jnp.broadcast_to(adv[:, None], lp.shape)
    elif adv.shape != lp.shape:
        raise ValueError(f"advantages_BxT must have shape {lp.shape} (or {lp.shape[:1]}), got {adv.shape}")
    valid = jnp.asarray(response_mask_BxT) > 0
    # sanitise masked positions first so padding garbage can't leak NaN into values or gradients
    lp = jnp.where(valid, lp, 0.0)
    old = jnp.where(valid, lax.stop_gradient(jnp.asarray(old_logprobs_BxT, jnp.float32)), 0.0)
    adv = jnp.where(valid, adv, 0.0)

    out = _LOSS_FNS[name](lp, old, adv, valid, o)
    if name != "stare" and o.get("omega_BxT") is not None:  # stare applies it inside (the train step's exact path)
        omega = jnp.asarray(o["omega_BxT"], jnp.float32)
        if omega.shape != lp.shape:
            raise ValueError(f"omega_BxT must have shape {lp.shape}, got {omega.shape}")
        out["tok"] = lax.stop_gradient(omega) * out["tok"]
    if o["rollout_is_weights"] is not None:
        out = _apply_is_weights(out, o["rollout_is_weights"], valid)
    agg = effective_agg(name, loss_agg_mode)
    if "seq" in out:  # geo_mean: one loss per sequence, mean over all of them (verl: torch.mean)
        numer = jnp.sum(out["seq"])
        denom = loss_normalizer(valid, agg) if o["normalizer"] is None else jnp.asarray(o["normalizer"], jnp.float32)
        loss = numer / jnp.maximum(denom, 1.0)
    else:
        loss, numer = aggregate(jnp.where(valid, out["tok"], 0.0), valid, agg, o["normalizer"])

    count = jnp.sum(valid.astype(jnp.float32))
    clip_sum = jnp.sum(jnp.where(valid & out["clip"], 1.0, 0.0))
    lower_sum = jnp.sum(jnp.where(valid & out["lower"], 1.0, 0.0))
    kl_sum = jnp.sum(jnp.where(valid, out["kl"], 0.0))
    safe = jnp.maximum(count, 1.0)
    metrics = {
        "clipfrac": clip_sum / safe,
        "clipfrac_lower": lower_sum / safe,
        "approx_kl": kl_sum / safe,
        "clipfrac_sum": clip_sum,
        "clipfrac_lower_sum": lower_sum,
        "approx_kl_sum": kl_sum,
        "token_count": count,
        "loss_numerator": numer,
    }
    return loss, metrics


def _apply_is_weights(out: dict, weights_BxT, valid):
    """verl's `pg_losses * rollout_is_weights` (no gradient through the weights); geo_mean's sequence loss times the
    weights' geometric mean over the sequence's valid tokens."""
    w = lax.stop_gradient(jnp.asarray(weights_BxT, jnp.float32))
    if w.shape != valid.shape:
        raise ValueError(f"rollout_is_weights must have shape {valid.shape}, got {w.shape}")
    if "seq" in out:
        m = valid.astype(jnp.float32)
        log_w = jnp.sum(jnp.log(w + 1e-10) * m, axis=1) / (jnp.sum(m, axis=1) + 1e-8)
        return dict(out, seq=out["seq"] * jnp.exp(log_w))
    return dict(out, tok=out["tok"] * w)


def policy_loss(
    logprobs_BxT,
    old_logprobs_BxT,
    advantages_B,
    mask_BxT,
    *,
    omega_BxT=None,
    rollout_is_weights=None,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    clip_c: float = 10.0,
    agg: str = "token-mean",
    normalizer=None,
):
    """The train step's loss: compute_policy_loss "vanilla" (or "stare" when omega_BxT is given) with the paper's
    clip defaults (0.2 / 0.28 / 10) and one advantage per sequence; rollout_is_weights [B, T]: rollout correction's
    IS weights (None: off). Returns (loss, metrics)."""
    if agg not in AGG_MODES:
        raise ValueError(f"loss aggregation agg={agg!r} is not supported; accepted values: {list(AGG_MODES)}")
    if clip_c <= 1.0:
        raise ValueError(f"dual-clip constant clip_c={clip_c} must be > 1")
    if jnp.shape(advantages_B) != jnp.shape(logprobs_BxT)[:1]:
        raise ValueError(f"advantages_B must have shape {jnp.shape(logprobs_BxT)[:1]}, got {jnp.shape(advantages_B)}")
    opts = {
        "clip_ratio_low": clip_low,
        "clip_ratio_high": clip_high,
        "clip_ratio_c": clip_c,
        "normalizer": normalizer,
        "rollout_is_weights": rollout_is_weights,
    }
    if omega_BxT is not None:
        opts["omega_BxT"] = omega_BxT
    return compute_policy_loss(
        "vanilla" if omega_BxT is None else "stare",
        old_logprobs_BxT,
        logprobs_BxT,
        advantages_B,
        mask_BxT,
        loss_agg_mode=agg,
        **opts,
    )
