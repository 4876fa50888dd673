"""RolloutCorrectionConfig: the run config's `rl.rollout_correction` section - verl's rollout correction options
(algorithm.rollout_correction: rollout_is, rollout_is_threshold, rollout_is_batch_normalize, rollout_rs,
rollout_rs_threshold), decoupled mode: the trainer's recomputed log-probs are the old policy, the sampler's are the
behaviour policy. No jax here: the run config imports it. Semantics: stare_jax.rl.rollout_correction.

Off by default (every option null): the sampler's log-probs are still kept (rollout_log_probs) and the mismatch
diagnostics logged every step (rollout_corr/* metrics); corrections act only when rollout_is or rollout_rs is set.
A bare train step (rl.step.TrainStepConfig's default) takes no sampler log-probs: `rollout_log_probs` False there.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal, NamedTuple

from stare_jax.config.options import ConfigError, option, validate_fields

RS_OPTIONS = (
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
)
IS_LEVELS = ("token", "sequence")


class RejectionOption(NamedTuple):
    """One parsed `rollout_rs` option: its name and thresholds (k1: log-space lower/upper; else an upper bound)."""

    name: str
    lower: float | None
    upper: float


def parse_rejection(rollout_rs: str, threshold: str | float | None) -> tuple[RejectionOption, ...]:
    """verl's `rollout_rs` / `rollout_rs_threshold` -> options (ValueError naming the key and the accepted values)."""
    names: list[str] = []
    for opt in (o.strip() for o in rollout_rs.split(",")):
        if not opt:
            continue
        if opt not in RS_OPTIONS:
            raise ValueError(
                f"rl.rollout_correction.rollout_rs: unknown option {opt!r}; accepted (comma-separated): "
                f"{', '.join(RS_OPTIONS)}"
            )
        if opt not in names:
            names.append(opt)
    if not names:
        raise ValueError("rl.rollout_correction.rollout_rs: give at least one option, e.g. token_k1")
    if threshold is None:
        raise ValueError("rl.rollout_correction.rollout_rs_threshold must be set when rollout_rs is")
    specs = (
        [str(threshold)]
        if isinstance(threshold, (int, float))
        else [s.strip() for s in str(threshold).split(",") if s.strip()]
    )
    if len(specs) not in (1, len(names)):
        raise ValueError(
            f"rl.rollout_correction.rollout_rs_threshold: one value for all options or one per option "
            f"({len(names)}), got {len(specs)}"
        )
    specs = specs * len(names) if len(specs) == 1 else specs
    out = []
    for name, spec in zip(names, specs):
        try:
            if name.endswith("k1"):
                lo_s, hi_s = spec.split("_", 1) if "_" in spec else ("", spec)
                hi = float(hi_s)
                lo = float(lo_s) if lo_s else 1.0 / hi
                if lo <= 0 or hi <= 0:
                    raise ValueError
                out.append(RejectionOption(name, math.log(lo), math.log(hi)))
            else:
                if "_" in spec:
                    raise ValueError
                hi = float(spec)
                if hi <= 0:
                    raise ValueError
                out.append(RejectionOption(name, None, hi))
        except ValueError:
            form = "a positive upper ratio bound or 'lower_upper'" if name.endswith("k1") else "one positive number"
            raise ValueError(
                f"rl.rollout_correction.rollout_rs_threshold {spec!r} for option {name}: need {form}"
            ) from None
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class RolloutCorrectionConfig:
    """Importance weights and rejection for the sampler/trainer mismatch (verl's rollout correction)."""

    rollout_log_probs: bool = option(
        True,
        "keep the sampler's log-prob of each sampled token in the train batch (verl: rollout.calculate_log_probs): "
        "the rollout_corr/* mismatch metrics every step; needed by rollout_is, rollout_rs and "
        "rl.stare.surprisal_source: rollout",
    )
    rollout_is: Literal["token", "sequence"] | None = option(
        None, "IS weight level: token (per-token ratio) or sequence (product over the response); null = off"
    )
    rollout_is_threshold: float = option(
        2.0, "upper truncation of the IS weights (TIS; verl's default 2.0)", lo=0.0, lo_open=True
    )
    rollout_is_batch_normalize: bool = option(False, "normalise the truncated IS weights to mean 1 over the batch")
    rollout_rs: str | None = option(
        None,
        "rejection options, comma-separated, all must pass: token_k1|k2|k3, seq_sum_k1|k2|k3, "
        "seq_mean_k1|k2|k3, seq_max_k2|k3; null = off",
    )
    rollout_rs_threshold: str | float | None = option(
        None,
        "one threshold for all rollout_rs options or one per option (comma-separated); k1 options take "
        "'lower_upper' ratio bounds or an upper bound U (lower 1/U)",
    )

    def __post_init__(self):
        validate_fields(self, "rl.rollout_correction")
        if self.corrects and not self.rollout_log_probs:
            key = "rollout_is" if self.rollout_is is not None else "rollout_rs"
            raise ConfigError(
                f"rl.rollout_correction.{key} is set but rl.rollout_correction.rollout_log_probs is false: the "
                f"correction compares the trainer's log-probs with the sampler's; set rollout_log_probs: true"
            )
        if self.rollout_is is not None and self.rollout_is_threshold <= 1.0:
            raise ConfigError(
                f"rl.rollout_correction.rollout_is_threshold = {self.rollout_is_threshold}: the upper truncation "
                f"of the IS weights must be > 1 (verl's default 2.0)"
            )
        if self.rollout_rs is not None:
            self.rejection_options  # noqa: B018 - parses: a bad option or threshold is a ConfigError here
        elif self.rollout_rs_threshold is not None:
            raise ConfigError(
                "rl.rollout_correction.rollout_rs_threshold is set but rollout_rs is null: set "
                "rollout_rs (e.g. token_k1) or drop the threshold"
            )

    @functools.cached_property
    def rejection_options(self) -> tuple:
        """The parsed rollout_rs options, () when off (parsed once: at construction)."""
        if self.rollout_rs is None:
            return ()
        try:
            return parse_rejection(self.rollout_rs, self.rollout_rs_threshold)
        except ValueError as e:
            raise ConfigError(str(e)) from None

    @property
    def corrects(self) -> bool:
        """IS weights or rejection act on the loss (else: diagnostics only)."""
        return self.rollout_is is not None or self.rollout_rs is not None
