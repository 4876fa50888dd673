"""PolicyLossConfig and TokenFilterConfig: the run config's `rl.policy_loss` and `rl.token_filter` sections and the
static parts of the jitted step that choose the loss (stare_jax.rl.losses.compute_policy_loss). No jax here: the
run config imports it.

- policy_loss.name: verl's loss_mode names. "vanilla" (the default) is GRPO / DAPO's dual-clip surrogate, and with
  rl.stare.enabled it is STARE (the omega-weighted vanilla); "stare" names the same thing and needs
  rl.stare.enabled. The clip ranges are rl.clip_low / rl.clip_high / rl.clip_c (verl clip_ratio_low / _high / _c).
- Options are verl's names; an option set away from its default on a loss it does not belong to is an error.
- scope: where clip_cov / kl_cov rank their covariances. In the train step each call sees one global micro-batch
  (rl.micro_batch_size x data shards sequences; the whole mini-batch when there is one micro-batch): "batch" ranks
  that whole micro-batch, "micro_batch" each group of rl.micro_batch_size sequences (verl's per-GPU ranking).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from stare_jax.config.options import ConfigError, option, validate_fields

POLICY_LOSS_NAMES = ("vanilla", "stare", "clip_cov", "kl_cov", "gspo", "cispo", "gpg", "geo_mean", "sapo")
# the section's options each loss takes (its clip ranges come from rl.clip_low / clip_high / clip_c)
SECTION_OPTIONS = {
    "clip_cov": ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub", "scope", "micro_batch_size"),
    "kl_cov": ("kl_cov_ratio", "ppo_kl_coef", "scope", "micro_batch_size"),
    "sapo": ("tau_pos", "tau_neg"),
}
# losses whose per-token loss can be weighted (STARE's omega, the 80/20 filter): all but the sequence-level one
TOKEN_LEVEL = tuple(n for n in POLICY_LOSS_NAMES if n != "geo_mean")


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig:
    """Which policy loss the step minimises, with verl's option names and defaults."""

    name: Literal["vanilla", "stare", "clip_cov", "kl_cov", "gspo", "cispo", "gpg", "geo_mean", "sapo"] = option(
        "vanilla",
        "verl loss_mode; gspo / sapo aggregate seq-mean-token-mean and geo_mean averages over sequences "
        "whatever rl.loss_agg says (as verl)",
    )
    clip_cov_ratio: float = option(0.0002, "clip_cov: fraction of tokens detached", lo=0.0, hi=1.0, lo_open=True)
    clip_cov_lb: float = option(1.0, "clip_cov: covariance lower bound")
    clip_cov_ub: float = option(5.0, "clip_cov: covariance upper bound")
    kl_cov_ratio: float = option(0.0002, "kl_cov: fraction of tokens penalised", lo=0.0, hi=1.0, lo_open=True)
    ppo_kl_coef: float = option(0.1, "kl_cov: coefficient of |log ratio|", lo=0.0)
    tau_pos: float = option(1.0, "sapo: gate temperature for A > 0", lo=0.0, lo_open=True)
    tau_neg: float = option(1.05, "sapo: gate temperature for A <= 0", lo=0.0, lo_open=True)
    scope: Literal["batch", "micro_batch"] = option(
        "batch",
        "clip_cov / kl_cov selection: the step's whole (global) micro-batch, or each rl.micro_batch_size "
        "group (verl's per-GPU micro-batch)",
    )
    micro_batch_size: int | None = option(
        None, "scope micro_batch: sequences per selection group; null = the run's rl.micro_batch_size", lo=1
    )

    def __post_init__(self):
        validate_fields(self, "rl.policy_loss")
        own = SECTION_OPTIONS.get(self.name, ())
        foreign = [
            f.name
            for f in dataclasses.fields(self)
            if f.name != "name" and f.name not in own and getattr(self, f.name) != f.default
        ]
        if foreign:
            keys = ", ".join(f"rl.policy_loss.{k}" for k in foreign)
            raise ConfigError(
                f"rl.policy_loss: {keys} do not belong to policy loss {self.name!r} (its options: "
                f"{', '.join(own) or 'none beyond rl.clip_*'})"
            )
        if self.clip_cov_lb >= self.clip_cov_ub:
            raise ConfigError(
                f"rl.policy_loss: clip_cov_lb={self.clip_cov_lb} must be < clip_cov_ub={self.clip_cov_ub}"
            )

    def options(self) -> dict:
        """compute_policy_loss keywords of this section for the chosen loss."""
        return {k: getattr(self, k) for k in SECTION_OPTIONS.get(self.name, ())}


@dataclasses.dataclass(frozen=True)
class TokenFilterConfig:
    """The 80/20 rule (Wang et al. 2025): only the top-rho highest-entropy tokens of the whole batch keep a policy
    gradient (selected once per step from the no-grad pass, globally, with STARE's order statistics)."""

    enabled: bool = option(False)
    rho: float = option(0.2, "fraction of the batch's valid tokens kept", lo=0.0, hi=1.0, lo_open=True)
    rule: Literal["quantile", "exact_top_k"] = option(
        "quantile",
        "entropy >= the (1 - rho) quantile (TRL's top_entropy_quantile; ties may keep more) or exactly "
        "ceil(rho n) tokens",
    )

    def __post_init__(self):
        validate_fields(self, "rl.token_filter")
