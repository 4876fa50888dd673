"""Per-token log-probs of the targets and entropy of the full next-token distribution, without [B, T, V] logits.

The sequence axis is cut into chunks of `chunk_size` positions; each chunk computes its [B, c, V] logits in fp32
(hidden.f32 @ unembed.f32^T for fp32 master weights, as the model contract defines logits; bf16 x bf16 with fp32
accumulation when the unembed table itself is bf16), a log-softmax, the target log-prob and the
entropy, under jax.checkpoint inside lax.map, so the forward pass keeps one chunk of logits alive at a time and the
backward pass recomputes each chunk's logits instead of storing them. Gradients w.r.t. hidden and unembed are
those of the naive full-logits computation.

Alignment: hidden[b, t] predicts targets[b, t]; the caller does the shift (train_step uses targets = input_ids[:, 1:]).
Masked positions (mask == 0) return log-prob 0 and entropy 0 and receive no gradient.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from stare_jax.rl.theory import critical_surprisal_from_stats

DEFAULT_CHUNK_SIZE = 128


def _logits(h_BxcxD, w_VxD):
    """fp32 logits. fp32 unembed (master weights): exactly hidden.f32 @ unembed.f32^T (the model contract).
    Low-precision unembed: matmul in that dtype with fp32 accumulation (the model's bf16-compute logits), so
    the [V, D] table is never copied to fp32."""
    if w_VxD.dtype == jnp.float32:
        return jnp.einsum("bcd,vd->bcv", h_BxcxD.astype(jnp.float32), w_VxD)
    return jnp.einsum("bcd,vd->bcv", h_BxcxD.astype(w_VxD.dtype), w_VxD, preferred_element_type=jnp.float32)


def _chunk_stats(h_BxcxD, t_Bxc, w_VxD, theory: bool):
    logits = _logits(h_BxcxD, w_VxD)
    logp = jax.nn.log_softmax(logits, axis=-1)
    lp_t = jnp.take_along_axis(logp, t_Bxc[..., None], axis=-1)[..., 0]
    p = jnp.exp(logp)
    ent = -jnp.sum(p * logp, axis=-1)
    if not theory:
        return lp_t, ent
    h = lax.stop_gradient(ent)
    lpd = lax.stop_gradient(logp)
    pd = lax.stop_gradient(p)
    s2 = jnp.sum(pd * pd * (lpd + h[..., None]), axis=-1)
    lp_a = lax.stop_gradient(lp_t)
    phi_a = jnp.exp(lp_a) * (lp_a + h) - s2
    return lp_t, ent, phi_a, critical_surprisal_from_stats(h, s2)


def token_logprobs_and_entropy(hidden_BxTxD, unembed_VxD, targets_BxT, mask_BxT, *,
                               chunk_size: int = DEFAULT_CHUNK_SIZE, theory: bool = False):
    """Returns (logprobs_BxT, entropy_BxT) in float32; with theory=True also a dict {phi, s_star} [B, T]
    (Phi of the target token and the critical surprisal of each position, stop-gradient diagnostics)."""
    hidden_BxTxD = jnp.asarray(hidden_BxTxD)
    if hidden_BxTxD.ndim != 3:
        raise ValueError(f"hidden_BxTxD must be 3-D [batch, time, hidden], got shape {hidden_BxTxD.shape}")
    B, T, D = hidden_BxTxD.shape
    if jnp.ndim(unembed_VxD) != 2 or jnp.shape(unembed_VxD)[1] != D:
        raise ValueError(f"unembed_VxD must be [vocab, {D}], got shape {jnp.shape(unembed_VxD)}")
    for name, arr in (("targets_BxT", targets_BxT), ("mask_BxT", mask_BxT)):
        if jnp.shape(arr) != (B, T):
            raise ValueError(f"{name} must have shape {(B, T)}, got {jnp.shape(arr)}")
    if int(chunk_size) < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    V = jnp.shape(unembed_VxD)[0]
    c = min(int(chunk_size), T)
    n_chunks = -(-T // c)
    pad = n_chunks * c - T
    valid = jnp.asarray(mask_BxT) > 0
    tgt = jnp.clip(jnp.where(valid, jnp.asarray(targets_BxT, jnp.int32), 0), 0, V - 1)
    h = hidden_BxTxD
    if pad:
        h = jnp.pad(h, ((0, 0), (0, pad), (0, 0)))
        tgt = jnp.pad(tgt, ((0, 0), (0, pad)))
    h_CxBxcxD = h.reshape(B, n_chunks, c, D).swapaxes(0, 1)
    t_CxBxc = tgt.reshape(B, n_chunks, c).swapaxes(0, 1)

    body = jax.checkpoint(lambda hh, tt, ww: _chunk_stats(hh, tt, ww, theory))
    outs = lax.map(lambda xs: body(xs[0], xs[1], unembed_VxD), (h_CxBxcxD, t_CxBxc))
    outs = [o.swapaxes(0, 1).reshape(B, n_chunks * c)[:, :T] for o in outs]
    outs = [jnp.where(valid, o, 0.0) for o in outs]
    if not theory:
        return outs[0], outs[1]
    return outs[0], outs[1], {"phi": outs[2], "s_star": outs[3]}


def naive_logprobs_and_entropy(hidden_BxTxD, unembed_VxD, targets_BxT, mask_BxT):
    """Reference: the same quantities from the full [B, T, V] fp32 logits (tests and memory benchmark only)."""
    valid = jnp.asarray(mask_BxT) > 0
    V = jnp.shape(unembed_VxD)[0]
    tgt = jnp.clip(jnp.where(valid, jnp.asarray(targets_BxT, jnp.int32), 0), 0, V - 1)
    lp, ent = _chunk_stats(jnp.asarray(hidden_BxTxD), tgt, jnp.asarray(unembed_VxD), False)
    return jnp.where(valid, lp, 0.0), jnp.where(valid, ent, 0.0)
