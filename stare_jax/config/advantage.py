"""AdvantageConfig: the run config's `rl.advantage` section - which trajectory advantage the responses get and an
optional token-level entropy term on top. No jax here: the run config imports it.

- estimator "grpo" (default): verl's compute_grpo_outcome_advantage on the shaped rewards; rl.norm_adv_by_std
  false gives Dr.GRPO's advantage (with rl.loss_agg: seq-mean-token-sum-norm, Dr.GRPO's loss; see
  configs/tiny_cpu_dr_grpo.yaml).
- estimator "w_reinforce": W-REINF (Zhu et al. 2025, "The Surprising Effectiveness of Negative Reinforcement in LLM
  Reasoning", arXiv 2506.01347): REINFORCE with +1 / -1 rewards and the positive samples down-weighted by lambda,
  A = lambda for a correct response and -1 for a wrong one (no baseline, no std). lambda = 0.1 is the paper's
  recommended value (the authors' RLVR-Decomposed README: `positive_advantage_weight`, "recommended value is 0.1").
  Computed on the host from correctness (collect.collect_batch); pair with the "gpg" loss (-A log pi) or "vanilla"
  on-policy (the same gradient).
- entropy_adv: EntroAdv (Cheng et al. 2025, "Reasoning with Exploration: An Entropy Perspective", arXiv
  2506.14758): token-level A + min(alpha * sg(H_t), |A| / kappa) with H_t the no-grad pass's entropy, inside the
  train step. kappa = 2 (a third-party implementation citing the paper, lucidrains' x-transformers-rl:
  entropy_to_advantage_kappa = 2, scale 0.1 "for PPO tested in paper"); alpha = 0.4 is the GRPO setting as we read
  the paper, not confirmed by a search of the stored pages (0.1 is its PPO setting).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from stare_jax.config.options import ConfigError, option, validate_fields

ADVANTAGE_ESTIMATORS = ("grpo", "w_reinforce")


@dataclasses.dataclass(frozen=True)
class AdvantageConfig:
    """The advantage of each response (and, with entropy_adv, each token)."""

    estimator: Literal["grpo", "w_reinforce"] = option(
        "grpo",
        "grpo: group-normalised rewards (verl grpo; rl.norm_adv_by_std=false is Dr.GRPO's); w_reinforce: "
        "lambda for a correct response, -1 for a wrong one (Zhu et al. 2025)",
    )
    w_reinforce_lambda: float = option(0.1, "W-REINF: weight of the positive samples (paper: 0.1)", lo=0.0)
    entropy_adv: bool = option(False, "EntroAdv (Cheng et al. 2025): add min(alpha * sg(H), |A| / kappa) per token")
    entropy_adv_alpha: float = option(0.4, "EntroAdv: entropy scale alpha", lo=0.0)
    entropy_adv_kappa: float = option(2.0, "EntroAdv: the term is at most |A| / kappa", lo=0.0, lo_open=True)

    def __post_init__(self):
        validate_fields(self, "rl.advantage")
        if self.estimator != "w_reinforce" and self.w_reinforce_lambda != 0.1:
            raise ConfigError(
                f"rl.advantage.w_reinforce_lambda = {self.w_reinforce_lambda} belongs to "
                f"rl.advantage.estimator = 'w_reinforce', not {self.estimator!r}"
            )
        if not self.entropy_adv:
            foreign = [k for k, d in (("entropy_adv_alpha", 0.4), ("entropy_adv_kappa", 2.0)) if getattr(self, k) != d]
            if foreign:
                raise ConfigError(
                    f"rl.advantage: {', '.join('rl.advantage.' + k for k in foreign)} only apply with "
                    f"rl.advantage.entropy_adv: true"
                )
