"""The train step's loss on one micro-batch (stare_jax.rl.step, step 5 of its data flow), as a LossPlan says.

The plan is decided once from the static TrainStepConfig (loss_plan): which policy loss, with which options, whether
STARE's omega / the 80/20 filter weight it, whether omega is recomputed per micro-batch, the entropy bonus and the
KL loss. The traced code (micro_batch_loss) then reads named decisions instead of re-deriving them from the config.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from stare_jax.rl.loss_terms import entropy_bonus, kl_loss
from stare_jax.rl.losses import LOSS_OPTIONS, compute_policy_loss, loss_normalizer, policy_loss, policy_loss_normalizer
from stare_jax.rl.stare import StareConfig, StareState, stare_omega

if TYPE_CHECKING:
    from stare_jax.rl.step import TrainStepConfig

PLAIN_LOSSES = ("vanilla", "stare")  # the GRPO-ds / STARE loss names (which of the two: whether omega weights it)
VERL_NORMALIZED_LOSSES = ("gspo", "sapo", "geo_mean")  # losses whose aggregation verl fixes (policy_loss_normalizer)
UPDATE_SUM_METRICS = ("clipfrac_sum", "clipfrac_lower_sum", "approx_kl_sum", "token_count")  # summed over micro-batches


@dataclasses.dataclass(frozen=True)
class LossPlan:
    """How the step computes its loss, decided once from the static config (loss_plan)."""

    name: str  # compute_policy_loss's loss ("vanilla" / "stare" resolved by omega_weighted)
    options: tuple[tuple[str, Any], ...]  # its keyword options: rl.policy_loss's + the clip ratios it accepts
    # the GRPO-ds / STARE path (losses.policy_loss, kept bit-identical to its original form): vanilla or stare with
    # no entropy bonus, token filter, KL loss or EntroAdv; every other case goes through compute_policy_loss
    plain: bool
    omega_weighted: bool  # omega (STARE's weights and/or the token filter's mask) weights the per-token loss
    omega_per_micro_batch: bool  # STARE scope micro_batch: omega recomputed from each micro-batch's own forward
    on_policy: bool  # one update per batch: outside the plain path old log-probs = stop_gradient(log-probs)
    micro_batch_key: bool  # clip_cov outside the plain path: a random key per micro-batch
    token_filter: bool  # the 80/20 rule's mask multiplies omega
    agg: str  # loss_agg mode
    agg_constant: float | None  # seq-mean-token-sum-norm's divisor; None: the batch's L - 1
    clip_low: float
    clip_high: float
    clip_c: float
    entropy_coeff: float  # loss -= entropy_coeff * agg(entropy)
    kl_loss: bool  # loss += kl_coef * agg(kl(log-probs, reference log-probs))
    kl_coef: float
    kl_kind: str  # the KL estimator
    stare: StareConfig


def loss_plan(cfg: TrainStepConfig) -> LossPlan:
    """The LossPlan of a TrainStepConfig; ValueError when omega must weight a loss that has no per-token weights."""
    stare, token_filter, kl = cfg.stare, cfg.token_filter, cfg.kl
    requested = cfg.policy_loss.name
    plain = (
        requested in PLAIN_LOSSES
        and cfg.entropy_coeff == 0.0
        and not token_filter.enabled
        and not kl.as_loss
        and not cfg.advantage.entropy_adv
    )
    omega_weighted = stare.enabled or token_filter.enabled
    name = ("stare" if omega_weighted else "vanilla") if requested in PLAIN_LOSSES else requested
    if omega_weighted and "omega_BxT" not in LOSS_OPTIONS[name]:
        raise ValueError(f"policy loss {name!r} has no per-token loss for STARE's omega / the token filter")
    options = dict(cfg.policy_loss.options())
    clip = {"clip_ratio_low": cfg.clip_low, "clip_ratio_high": cfg.clip_high, "clip_ratio_c": cfg.clip_c}
    options.update({k: v for k, v in clip.items() if k in LOSS_OPTIONS[name]})
    return LossPlan(
        name=name,
        options=tuple(options.items()),
        plain=plain,
        omega_weighted=omega_weighted,
        omega_per_micro_batch=stare.enabled and stare.scope == "micro_batch",
        on_policy=cfg.num_mini_batches == 1 and cfg.ppo_epochs == 1,
        micro_batch_key=not plain and name == "clip_cov",
        token_filter=token_filter.enabled,
        agg=cfg.loss_agg,
        agg_constant=cfg.loss_agg_constant,
        clip_low=cfg.clip_low,
        clip_high=cfg.clip_high,
        clip_c=cfg.clip_c,
        entropy_coeff=cfg.entropy_coeff,
        kl_loss=kl.as_loss,
        kl_coef=kl.coef,
        kl_kind=kl.kind,
        stare=stare,
    )


class SequenceArrays(NamedTuple):
    """The per-sequence arrays [B, ...] the updates read, sliced per mini-batch and split per micro-batch. The batch
    layouts take them as a tuple with the loss mask first (they restrict it to a micro-batch's sequences)."""

    loss_mask_BxT: jax.Array
    advantages: jax.Array  # [B], or [B, T] with EntroAdv's token-level term
    old_logprobs_BxT: jax.Array
    omega_BxT: jax.Array  # pass 1's omega (times the filter's mask); ones with omega_per_micro_batch
    keep_BxT: jax.Array | None  # the token filter's mask (plan.token_filter), else None
    ref_logprobs_BxT: jax.Array | None  # the frozen reference's log-probs (plan.kl_loss), else None
    is_weights_BxT: jax.Array | None = None  # rollout correction's IS weights (rl.rollout_correction.rollout_is)


class LossNormalizers(NamedTuple):
    """One mini-batch's aggregation divisors: every micro-batch's loss is normalised by the whole mini-batch's, so
    the summed micro-batch gradients are the mini-batch's gradient."""

    policy_loss: jax.Array  # the policy loss's
    token_terms: jax.Array  # the entropy bonus's and the KL loss's (the aggregation mode's own)


def loss_normalizers(plan: LossPlan, loss_mask_BxT) -> LossNormalizers:
    """The LossNormalizers of the mini-batch whose loss mask is loss_mask_BxT."""
    if plan.agg == "seq-mean-token-sum-norm":
        constant = plan.agg_constant if plan.agg_constant is not None else float(loss_mask_BxT.shape[1])
        token_terms = jnp.float32(constant)
    else:
        token_terms = loss_normalizer(loss_mask_BxT, plan.agg)
    if plan.plain or plan.name not in VERL_NORMALIZED_LOSSES:
        return LossNormalizers(policy_loss=token_terms, token_terms=token_terms)
    return LossNormalizers(
        policy_loss=policy_loss_normalizer(plan.name, loss_mask_BxT, plan.agg), token_terms=token_terms
    )


def update_metric_names(plan: LossPlan) -> tuple[str, ...]:
    """The metrics micro_batch_loss returns (summed over an update's micro-batches)."""
    return UPDATE_SUM_METRICS + ("omega_sum",) + (("kl_agg",) if plan.kl_loss else ())


def micro_batch_loss(
    params,
    x,
    normalizers: LossNormalizers,
    key,
    *,
    plan: LossPlan,
    forward: Callable,
    rest,
    micro_fn: Callable,
    stare_state: StareState,
):
    """(loss, metrics) of one micro-batch x under params (the step differentiates it): forward(params, rest,
    *inputs) -> (log-probs, entropy) is the model; micro_fn(model, x) -> (log-probs, entropy, SequenceArrays as a
    tuple) the layout's view of the micro-batch; key: clip_cov's (plan.micro_batch_key, else None)."""
    logprobs_BxT, entropy_BxT, arrays = micro_fn(lambda *inputs: forward(params, rest, *inputs), x)
    seq = SequenceArrays(*arrays)
    omega_BxT = seq.omega_BxT
    if plan.omega_per_micro_batch:
        omega_BxT, _ = stare_omega(
            jax.lax.stop_gradient(logprobs_BxT),
            seq.advantages,
            seq.loss_mask_BxT,
            stare_state,
            plan.stare,
            entropy_BxT=jax.lax.stop_gradient(entropy_BxT),
            scope="micro_batch",
        )
        omega_BxT = omega_BxT * seq.keep_BxT if plan.token_filter else omega_BxT
    kl_agg = None
    if plan.plain:
        loss, terms = policy_loss(
            logprobs_BxT,
            seq.old_logprobs_BxT,
            seq.advantages,
            seq.loss_mask_BxT,
            omega_BxT=omega_BxT,
            rollout_is_weights=seq.is_weights_BxT,
            clip_low=plan.clip_low,
            clip_high=plan.clip_high,
            clip_c=plan.clip_c,
            agg=plan.agg,
            normalizer=normalizers.policy_loss,
        )
    else:
        loss, terms, kl_agg = _composite_loss(plan, logprobs_BxT, entropy_BxT, seq, omega_BxT, normalizers, key)
    metrics = {k: terms[k] for k in UPDATE_SUM_METRICS}
    if plan.kl_loss:
        metrics["kl_agg"] = kl_agg
    metrics["omega_sum"] = jnp.sum(jnp.where(seq.loss_mask_BxT > 0, omega_BxT, 0.0))
    return loss, metrics


def _composite_loss(
    plan: LossPlan, logprobs_BxT, entropy_BxT, seq: SequenceArrays, omega_BxT, normalizers: LossNormalizers, key
):
    """(loss, the policy loss's terms, the KL loss's aggregate or None) outside the plain path:
    compute_policy_loss(plan.name), minus the entropy bonus, plus the KL loss (verl use_kl_loss)."""
    old_logprobs_BxT = seq.old_logprobs_BxT
    if plan.on_policy:  # verl dp_actor: old = log_prob.detach() (|log ratio| is then exactly 0 for kl_cov)
        old_logprobs_BxT = jax.lax.stop_gradient(logprobs_BxT)
    options = dict(plan.options, normalizer=normalizers.policy_loss)
    if plan.omega_weighted:
        options["omega_BxT"] = omega_BxT
    if seq.is_weights_BxT is not None:
        options["rollout_is_weights"] = seq.is_weights_BxT
    if plan.micro_batch_key:
        options["key"] = key
    loss, terms = compute_policy_loss(
        plan.name, old_logprobs_BxT, logprobs_BxT, seq.advantages, seq.loss_mask_BxT, loss_agg_mode=plan.agg, **options
    )
    if plan.entropy_coeff:
        loss = (
            loss
            + entropy_bonus(
                entropy_BxT,
                seq.loss_mask_BxT,
                plan.entropy_coeff,
                loss_agg_mode=plan.agg,
                normalizer=normalizers.token_terms,
            )[0]
        )
    kl_agg = None
    if plan.kl_loss:  # verl use_kl_loss: + kl_loss_coef * agg_loss(kl_penalty(lp, ref_lp), loss_agg_mode)
        kl_term, kl_agg = kl_loss(
            logprobs_BxT,
            seq.ref_logprobs_BxT,
            seq.loss_mask_BxT,
            plan.kl_coef,
            kind=plan.kl_kind,
            loss_agg_mode=plan.agg,
            normalizer=normalizers.token_terms,
        )
        loss = loss + kl_term
    return loss, terms, kl_agg
