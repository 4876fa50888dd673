"""stare_jax.rl: GRPO advantages + dynamic sampling, STARE token weights and controller, the clipped policy loss,
entropy-sensitivity theory, the chunked log-prob/entropy pass and the jitted train step."""
from stare_jax.rl.advantages import (DynamicSamplingAccumulator, DynamicSamplingError, dynamic_sampling_keep_mask,
                                     grpo_advantages)
from stare_jax.rl.logprobs import token_logprobs_and_entropy
from stare_jax.rl.losses import AGG_MODES, loss_normalizer, policy_loss
from stare_jax.rl.stare import (StareConfig, StareState, init_stare_state, micro_batch_token_weights,
                                selection_sets, stare_omega, token_weights, update_controller,
                                validate_stare_options)
from stare_jax.rl.theory import batch_entropy_terms, critical_surprisal, phi

__all__ = [
    "grpo_advantages", "dynamic_sampling_keep_mask", "DynamicSamplingAccumulator", "DynamicSamplingError",
    "token_logprobs_and_entropy", "policy_loss", "loss_normalizer", "AGG_MODES",
    "StareConfig", "StareState", "init_stare_state", "update_controller", "token_weights", "selection_sets",
    "micro_batch_token_weights", "stare_omega", "validate_stare_options",
    "phi", "critical_surprisal", "batch_entropy_terms",
]
