"""stare_jax.rl: GRPO advantages + dynamic sampling (and the W-REINF / EntroAdv shapers), STARE token weights and
controller, the policy losses with verl's names (compute_policy_loss) and the terms beside them (entropy bonus, KL,
the 80/20 token filter), entropy-sensitivity theory, the chunked log-prob/entropy pass and the jitted train step."""

from stare_jax.rl.advantages import (
    DynamicSamplingAccumulator,
    DynamicSamplingError,
    dynamic_sampling_keep_mask,
    entropy_advantage,
    grpo_advantages,
    w_reinforce_advantages,
)
from stare_jax.rl.logprobs import token_logprobs_and_entropy
from stare_jax.rl.loss_terms import entropy_bonus, high_entropy_mask, kl_loss, kl_penalty, kl_reward_penalty
from stare_jax.rl.losses import (
    AGG_MODES,
    POLICY_LOSSES,
    clip_cov_key,
    compute_policy_loss,
    loss_normalizer,
    policy_loss,
    policy_loss_normalizer,
)
from stare_jax.rl.stare import (
    StareConfig,
    StareState,
    init_stare_state,
    micro_batch_token_weights,
    selection_sets,
    stare_omega,
    token_weights,
    update_controller,
    validate_stare_options,
)
from stare_jax.rl.theory import batch_entropy_terms, critical_surprisal, phi

__all__ = [
    "grpo_advantages",
    "dynamic_sampling_keep_mask",
    "DynamicSamplingAccumulator",
    "DynamicSamplingError",
    "entropy_advantage",
    "w_reinforce_advantages",
    "token_logprobs_and_entropy",
    "policy_loss",
    "loss_normalizer",
    "AGG_MODES",
    "compute_policy_loss",
    "POLICY_LOSSES",
    "policy_loss_normalizer",
    "clip_cov_key",
    "entropy_bonus",
    "kl_penalty",
    "kl_loss",
    "kl_reward_penalty",
    "high_entropy_mask",
    "StareConfig",
    "StareState",
    "init_stare_state",
    "update_controller",
    "token_weights",
    "selection_sets",
    "micro_batch_token_weights",
    "stare_omega",
    "validate_stare_options",
    "phi",
    "critical_surprisal",
    "batch_entropy_terms",
]
