"""The STARE closed-loop controller (docs/stare.md, "The closed-loop gate" and "Fixed and adaptive weights"): the
batch gate g_k = 1[H_bar_k < H_tgt] and the adaptive W/M schedule, as a pytree state carried (and checkpointed)
across steps."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from stare_jax.config.stare import StareConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StareState:
    """Controller state carried across steps.

    gate_on: the batch gate of the latest step (False before the first finite batch entropy).
    w, m: the W and M the latest step used (W_0 = cfg.w, M_0 = cfg.m before the first step).
    last_entropy: the latest finite batch entropy H_bar (NaN before the first one); drives next_step timing.
    """

    gate_on: jax.Array
    w: jax.Array
    m: jax.Array
    last_entropy: jax.Array


def init_stare_state(cfg: StareConfig | None = None) -> StareState:
    cfg = cfg or StareConfig()
    return StareState(
        gate_on=jnp.asarray(False),
        w=jnp.asarray(cfg.w, jnp.float32),
        m=jnp.asarray(cfg.m, jnp.float32),
        last_entropy=jnp.asarray(jnp.nan, jnp.float32),
    )


def update_controller(state: StareState, batch_entropy, cfg: StareConfig | None = None) -> StareState:
    """One controller step from step k's batch mean entropy H_bar_k (trainer forward pass before the update); the
    returned state's (gate_on, w, m) are what step k uses.

    - Gate: g_k = 1[H_bar_k < H_tgt] (strict).
    - Adaptive weights (cfg.adaptive; every step, also with the gate off): sign = sgn(H_tgt - H), W = clip(W + alpha
      sign, 1, W_max), M = clip(M - alpha sign, M_min, 1), with H = H_bar_k (adaptive_timing same_step: step k uses
      the updated values, as the authors' code) or H = H_bar_{k-1} (next_step: the paper's W_{k+1} notation).
    - A non-finite H_bar_k leaves the whole state unchanged.

    Two choices where the authors' code (STAREController) differs, decided by the paper's semantics:
    - No measured entropy yet => gate OFF. Before the first finite H_bar (a first step whose entropy is NaN) the gate
      stays off, so that step is exactly GRPO(-ds). The authors' controller starts with gate_on = True, which only
      shows when its first update is skipped for a NaN; the paper defines the gate only through measured entropy
      (g_k = 1[H_bar_k < H_tgt], and 1[NaN < H_tgt] = 0) and reweighting is meant to act only on evidence of
      collapse, so a step without that evidence is not reweighted. Open-loop reweighting is gate = none.
    - alpha = 0 is the fixed-weight schedule: W and M stay at W_0 and M_0 unclipped, as the paper states ("Setting
      alpha = 0 recovers the fixed-weight") and the authors' code does (it returns before clipping). Clipping them
      anyway, as this controller did before, would move a W_0 above W_max (e.g. the toy's W = 4) to W_max on the first
      step. With alpha > 0 both clip, so a W_0 above W_max (or M_0 below M_min) is pulled into the band at once.
    """
    cfg = cfg or StareConfig()
    h = jnp.asarray(batch_entropy, jnp.float32)
    finite = jnp.isfinite(h)
    gate_on = h < cfg.target_entropy
    if cfg.adaptive and cfg.alpha > 0:
        h_drive = h if cfg.adaptive_timing == "same_step" else state.last_entropy
        sign = jnp.where(jnp.isfinite(h_drive), jnp.sign(cfg.target_entropy - h_drive), 0.0)
        w = jnp.clip(state.w + cfg.alpha * sign, 1.0, cfg.w_max)
        m = jnp.clip(state.m - cfg.alpha * sign, cfg.m_min, 1.0)
    else:
        w, m = state.w, state.m
    new = StareState(gate_on=gate_on, w=jnp.asarray(w, jnp.float32), m=jnp.asarray(m, jnp.float32), last_entropy=h)
    return jax.tree_util.tree_map(lambda a, b: jnp.where(finite, a, b), new, state)
