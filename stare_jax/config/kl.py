"""KLConfig: the run config's `rl.kl` section (a frozen reference policy and a KL penalty to it, verl's semantics).
No jax here: the run config imports it.

- reference: where the frozen reference policy comes from. "initial" = the run's starting weights (model.path as
  loaded when the run opens, never the restored policy of a resumed run); a Hugging Face folder = those weights (same
  architecture as the policy). null = no reference model: no extra forward, no KL. Set with coef 0 to only log the KL.
- coef: verl's actor.kl_loss_coef (use_as "loss") or algorithm.kl_ctrl.kl_coef (use_as "reward"; a fixed
  coefficient, verl's kl_ctrl.type "fixed"; the adaptive controller is not implemented).
- estimator: verl's kl_penalty / kl_loss_type names; null = verl's default for the use ("low_var_kl" for the loss,
  "kl" for the reward).
- use_as: "loss" = verl actor.use_kl_loss (loss += coef * agg(kl(logprobs, ref_logprobs)) with rl.loss_agg, the
  current policy's log-probs carry the gradient); "reward" = verl algorithm.use_kl_in_reward (token rewards = score -
  coef * kl(old_logprobs, ref_logprobs), summed per response before the GRPO advantage, inside the train step).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from stare_jax.config.options import ConfigError, option, validate_fields

KL_ESTIMATOR_NAMES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
# verl's defaults: actor.kl_loss_type and algorithm.kl_penalty
DEFAULT_ESTIMATOR = {"loss": "low_var_kl", "reward": "kl"}


@dataclasses.dataclass(frozen=True)
class KLConfig:
    """KL penalty to a frozen reference policy (GRPO's beta; verl use_kl_loss / use_kl_in_reward)."""

    coef: float = option(
        0.0,
        "KL coefficient (verl kl_loss_coef / kl_ctrl.kl_coef; 0.001 in verl's GRPO recipes); 0 = no KL term",
        lo=0.0,
    )
    estimator: Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"] | None = option(
        None, "per-token KL estimator (verl kl_penalty names); null = low_var_kl for the loss, kl for the reward"
    )
    use_as: Literal["loss", "reward"] = option(
        "loss",
        "loss term (verl use_kl_loss) or token-level reward penalty before the advantage (verl use_kl_in_reward)",
    )
    reference: str | None = option(
        None, "'initial' (the run's starting weights) or a Hugging Face folder; null = no reference model"
    )

    def __post_init__(self):
        validate_fields(self, "rl.kl")
        if self.coef > 0 and not self.reference:
            raise ConfigError(
                f"rl.kl.coef = {self.coef} needs a reference policy: set rl.kl.reference to 'initial' "
                f"(the run's starting weights) or a Hugging Face folder"
            )
        if self.reference == "":
            raise ConfigError("rl.kl.reference = '' is not a reference: use 'initial', a Hugging Face folder or null")

    @property
    def enabled(self) -> bool:
        """A reference model is loaded and its log-probs computed (the KL is logged; applied when coef > 0)."""
        return self.reference is not None

    @property
    def kind(self) -> str:
        """The estimator in use (verl's default for use_as when estimator is null)."""
        return self.estimator or DEFAULT_ESTIMATOR[self.use_as]

    @property
    def as_loss(self) -> bool:
        return self.enabled and self.coef > 0 and self.use_as == "loss"

    @property
    def as_reward(self) -> bool:
        return self.enabled and self.coef > 0 and self.use_as == "reward"
