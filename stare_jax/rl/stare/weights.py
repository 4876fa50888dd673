"""STARE per-token weights omega (docs/stare.md, "Token weights omega and the eight variants" and "The closed-loop
gate"): W or M on the variant's selected sets where the gate is on, 1 everywhere else; omega == 1 when STARE is
disabled (GRPO(-ds))."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from stare_jax.config.stare import GATES, VARIANT_SETS, StareConfig
from stare_jax.rl.stare.controller import StareState
from stare_jax.rl.stare.select import select, set_fractions


def gate_mask(cfg: StareConfig, shape, *, gate_on=True, entropy_BxT=None, mask_BxT=None):
    """Boolean [B, T] mask of the tokens on which the STARE weights are active: the controller's flag (gate batch),
    all (none), the response's mean entropy over its valid tokens < H_tgt (sample), or H[i, t] < H_tgt (token)."""
    gate = cfg.gate
    if gate == "batch":
        return jnp.broadcast_to(jnp.asarray(gate_on, bool), shape)
    if gate == "none":
        return jnp.ones(shape, bool)
    if gate in ("sample", "token"):
        if entropy_BxT is None:
            raise ValueError(f"gate={gate!r} needs entropy_BxT (per-token entropy of the trainer's forward pass)")
        ent = jnp.asarray(entropy_BxT, jnp.float32)
        if ent.shape != tuple(shape):
            raise ValueError(f"entropy_BxT must have shape {tuple(shape)}, got {ent.shape}")
        if gate == "token":
            return ent < cfg.target_entropy
        m = jnp.asarray(mask_BxT, jnp.float32)
        ent_mean_B = jnp.sum(jnp.where(m > 0, ent, 0.0), axis=1) / jnp.maximum(jnp.sum(m, axis=1), 1.0)
        return jnp.broadcast_to((ent_mean_B < cfg.target_entropy)[:, None], shape)
    raise ValueError(f"STARE option gate={gate!r} is not supported; accepted values: {list(GATES)}")


def stare_omega(
    logprobs_BxT,
    advantages_B,
    mask_BxT,
    state: StareState,
    cfg: StareConfig,
    entropy_BxT=None,
    extra_sets: tuple[str, ...] = (),
    scope: str | None = None,
):
    """(omega [B, T] float32 stop-gradient, info) for a config and controller state (W = state.w, M = state.m, the
    batch gate's flag = state.gate_on); omega == 1 when cfg.enabled is False. sample/token gates need entropy_BxT.

    info: {"sets": {name: bool [B, T]} (the variant's sets plus extra_sets), "gate": bool mask, "metrics": realised
    fractions frac_<set> (of the variant's sets), n_pos, n_neg, omega_mean (over valid tokens), frac_reweighted
    (omega != 1), gate_frac}.
    scope overrides cfg.scope (the train step passes "batch" / "micro_batch" explicitly)."""
    shape = jnp.shape(logprobs_BxT)
    valid = jnp.asarray(mask_BxT) > 0
    n_valid = jnp.maximum(jnp.sum(valid), 1).astype(jnp.float32)
    if not cfg.enabled and not extra_sets:
        return jnp.ones(shape, jnp.float32), {
            "sets": {},
            "gate": jnp.zeros(shape, bool),
            "metrics": {"omega_mean": jnp.float32(1.0), "frac_reweighted": jnp.float32(0.0)},
        }
    w_sets, m_sets = VARIANT_SETS[cfg.variant]
    need = tuple(dict.fromkeys(w_sets + m_sets + tuple(extra_sets)))
    g = gate_mask(cfg, shape, gate_on=state.gate_on, entropy_BxT=entropy_BxT, mask_BxT=mask_BxT)
    sets, cand_pos, cand_neg = select(logprobs_BxT, advantages_B, mask_BxT, cfg, need=need, scope=scope)
    if cfg.enabled:
        sel_w = jnp.zeros(shape, bool)
        for name in w_sets:
            sel_w = sel_w | sets[name]
        sel_m = jnp.zeros(shape, bool)
        for name in m_sets:
            sel_m = sel_m | sets[name]
        w, m = jnp.asarray(state.w, jnp.float32), jnp.asarray(state.m, jnp.float32)
        omega = lax.stop_gradient(jnp.where(sel_w & g, w, jnp.where(sel_m & g, m, 1.0)).astype(jnp.float32))
    else:  # disabled, but the caller wants the sets (theory diagnostics of a GRPO-ds run)
        omega = jnp.ones(shape, jnp.float32)
    n_pos, n_neg = jnp.sum(cand_pos, dtype=jnp.int32), jnp.sum(cand_neg, dtype=jnp.int32)
    metrics = {
        "n_pos": n_pos,
        "n_neg": n_neg,
        "omega_mean": jnp.sum(jnp.where(valid, omega, 0.0)) / n_valid,
        "frac_reweighted": jnp.sum(valid & (omega != 1.0)) / n_valid,
        "gate_frac": jnp.sum(valid & g) / n_valid,
        # the fractions of what the variant selects (a disabled config: of the sets asked for); sets asked for only
        # by diagnostics (extra_sets) stay out, so the logged selection of an O1 run is its own
        **set_fractions({k: sets[k] for k in (w_sets + m_sets if cfg.enabled else need)}, n_pos, n_neg),
    }
    return omega, {"sets": sets, "gate": g, "metrics": metrics}
