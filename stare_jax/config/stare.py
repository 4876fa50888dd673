"""StareConfig: every STARE option, defined once. It is both the run config's `rl.stare` section
(stare_jax/config/loader.py
embeds it; its loader reads the Literal types and the range metadata below for errors that name the dotted key and
the file) and the static config of the jitted train step. No jax here: the run config imports it.

Reconciled from the two classes that existed before (decisions):
- enabled defaults to False (plain GRPO(-ds) until asked for; the run config's default and the authors' code's).
- target_entropy >= 0: H_tgt = 0 is allowed (the batch gate then never opens, which is how the authors' GRPO-ds
  script disables STARE while keeping its code path).
- micro_batch_size: the sequences per selection group of scope micro_batch; None in a run config means "the run's
  rl.micro_batch_size" (training.setup.train_step_config fills it in), so the authors' per-GPU-micro-batch ranking
  is the default grouping; the selection raises if scope micro_batch reaches it with None.
- Validation happens once per construction, from these field declarations (__post_init__); the run-config loader
  checks the same declarations first only to name the key and file in its message.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from stare_jax.config.options import option, validate_fields

VARIANTS = ("O1", "O2", "O3", "O4", "C1", "C2", "C3", "C4")
GATES = ("batch", "sample", "token", "none")
RULES = ("quantile", "exact_top_k")
SCOPES = ("batch", "micro_batch")
SELECT_IMPLS = ("bisect", "jnp_quantile")
ADAPTIVE_TIMINGS = ("same_step", "next_step")
SET_NAMES = ("pos_high", "pos_low", "neg_high", "neg_low")

# variant -> (sets that get W, sets that get M)  (docs/stare.md, "Token weights omega and the eight variants")
VARIANT_SETS = {
    "O1": (("pos_high",), ()),
    "O2": ((), ("pos_low",)),
    "O3": (("neg_low",), ()),
    "O4": ((), ("neg_high",)),
    "C1": (("pos_high", "neg_low"), ()),
    "C2": (("pos_high",), ("neg_high",)),
    "C3": (("neg_low",), ("pos_low",)),
    "C4": ((), ("pos_low", "neg_high")),
}


@dataclasses.dataclass(frozen=True)
class StareConfig:
    """STARE token reweighting and its closed-loop entropy gate (docs/stare.md); defaults are the paper's."""

    enabled: bool = option(False, "False = plain GRPO(-ds): omega == 1 everywhere")
    variant: Literal["O1", "O2", "O3", "O4", "C1", "C2", "C3", "C4"] = option("O1")
    top_p: float = option(0.1, "P: fraction of candidate tokens selected", lo=0.0, hi=1.0, lo_open=True)
    w: float = option(1.1, "amplification weight W >= 1", lo=1.0)
    m: float = option(0.9, "attenuation weight M in (0, 1]", lo=0.0, hi=1.0, lo_open=True)
    gate: Literal["batch", "sample", "token", "none"] = option("batch")
    target_entropy: float = option(0.3, "H_tgt; 0 = the batch gate never opens", lo=0.0)
    rule: Literal["quantile", "exact_top_k"] = option("quantile")
    scope: Literal["batch", "micro_batch"] = option("batch")
    micro_batch_size: int | None = option(
        None, "scope micro_batch: sequences per selection group; null = the run's rl.micro_batch_size", lo=1
    )
    select_impl: Literal["bisect", "jnp_quantile"] = option(
        "bisect",
        "how the quantile rule's thresholds are found: bisection on the float bits (masked counts, "
        "no sort) or jnp.nanquantile (a sort); exact_top_k always bisects",
    )
    adaptive: bool = option(False)
    alpha: float = option(0.01, lo=0.0)
    w_max: float = option(1.5, lo=1.0)
    m_min: float = option(0.5, lo=0.0, hi=1.0, lo_open=True)
    adaptive_timing: Literal["same_step", "next_step"] = option("same_step")
    theory_diagnostics: bool = option(False, "Phi, s*, Lambda, Gamma, W* in the trainer pass (slower)")
    surprisal_source: Literal["trainer", "rollout"] = option(
        "trainer",
        "whose log-probs rank the tokens' surprisal: the trainer's recomputed old log-probs (the paper) or the "
        "sampler's (needs rl.rollout_correction.rollout_log_probs and scope batch)",
    )

    def __post_init__(self):
        validate_fields(self, "rl.stare")
