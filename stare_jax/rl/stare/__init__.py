"""STARE's public API (the method and its exact semantics: docs/stare.md), one module per role:

- stare_jax/config/stare.py:        StareConfig (every option, validated on construction; also the run config's
                                    `rl.stare`)
- stare_jax/rl/stare/select.py:     selection_sets: top / bottom P of surprisal within T+ and T- (cfg.rule, scope,
                                    select_impl)
- stare_jax/rl/stare/weights.py:    stare_omega: W / M on the variant's sets where the gate (batch | sample |
                                    token | none) is on
- stare_jax/rl/stare/controller.py: StareState, init_stare_state, update_controller: the batch gate and the
                                    adaptive W/M

Every function takes the StareConfig. token_weights / micro_batch_token_weights / validate_stare_options take the
options as keywords instead, for tests and notebooks; they build a StareConfig and call the functions above.
"""

from __future__ import annotations

import jax.numpy as jnp

from stare_jax.config.stare import (
    ADAPTIVE_TIMINGS,
    GATES,
    RULES,
    SCOPES,
    SELECT_IMPLS,
    SET_NAMES,
    VARIANT_SETS,
    VARIANTS,
    StareConfig,
)
from stare_jax.rl.stare.controller import StareState, init_stare_state, update_controller
from stare_jax.rl.stare.select import selection_sets
from stare_jax.rl.stare.weights import gate_mask, stare_omega

__all__ = [
    "StareConfig",
    "StareState",
    "init_stare_state",
    "update_controller",
    "selection_sets",
    "gate_mask",
    "stare_omega",
    "token_weights",
    "micro_batch_token_weights",
    "validate_stare_options",
    "VARIANTS",
    "GATES",
    "RULES",
    "SCOPES",
    "SELECT_IMPLS",
    "ADAPTIVE_TIMINGS",
    "SET_NAMES",
    "VARIANT_SETS",
]


def token_weights(logprobs_BxT, advantages_B, mask_BxT, *, w=1.1, m=0.9, gate_on=True, entropy_BxT=None, **options):
    """omega [B, T] of stare_omega for StareConfig(enabled=True, **options) with the controller values W = w,
    M = m (plain or traced numbers) and the batch gate's flag gate_on."""
    cfg = StareConfig(enabled=True, **options)
    state = StareState(
        gate_on=jnp.asarray(gate_on, bool),
        w=jnp.asarray(w, jnp.float32),
        m=jnp.asarray(m, jnp.float32),
        last_entropy=jnp.float32(jnp.nan),
    )
    return stare_omega(logprobs_BxT, advantages_B, mask_BxT, state, cfg, entropy_BxT=entropy_BxT)[0]


def micro_batch_token_weights(logprobs_BxT, advantages_B, mask_BxT, *, micro_batch_size: int, **kwargs):
    """token_weights with scope='micro_batch' (each consecutive group of micro_batch_size sequences ranked alone)."""
    return token_weights(
        logprobs_BxT, advantages_B, mask_BxT, scope="micro_batch", micro_batch_size=micro_batch_size, **kwargs
    )


def validate_stare_options(**options) -> None:
    """Raise ValueError for an option StareConfig rejects (the same checks: one definition)."""
    StareConfig(**options)
