"""Per-token log-probs of the targets and entropy of the full next-token distribution, without [B, T, V] logits.

Forward: the sequence axis is cut into chunks of `chunk_size` positions; each chunk computes its [B, c, V]
logits in fp32 (hidden.f32 @ unembed.f32^T for fp32 master weights, as the model contract defines logits;
bf16 x bf16 with fp32 accumulation when the unembed table itself is bf16), a log-softmax, the target log-prob and the
entropy inside lax.map, so one chunk of logits is alive at a time; it keeps only the per-token logsumexp and entropy.
Backward (custom VJP): the VOCAB axis is cut into chunks of about the same size (inside each device's vocab shard
when the table is split over devices); each recomputes its logit columns for all tokens, forms
dlogits = dlp (onehot - p) - dH p (log p + H), writes its own rows of d(unembed) (no [V, D] accumulator carried
through the loop) and accumulates d(hidden) [N, D]. Gradients w.r.t. hidden and unembed are
those of the naive full-logits computation.

Alignment: hidden[b, t] predicts targets[b, t]; the caller does the shift (train_step uses targets = input_ids[:, 1:]).
Masked positions (mask == 0) return log-prob 0 and entropy 0 and receive no gradient.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from stare_jax.models.sharding import constrain, shard_count
from stare_jax.rl.theory import critical_surprisal_from_stats


def _constrain(x, names):
    """Logical sharding constraint (stare_jax.models.sharding.constrain): a no-op unless the caller traces under
    jax.set_mesh + activation_rules (the train step does). Keeps tokens batch-sharded and gathers the unembed
    table over the FSDP axis (vocab stays tensor-parallel) instead of letting XLA reshard the activations."""
    return constrain(x, names)


DEFAULT_CHUNK_SIZE = 128


def _logits(h_xD, w_VxD):
    """fp32 logits. fp32 unembed (master weights): exactly hidden.f32 @ unembed.f32^T (the model contract).
    Low-precision unembed: matmul in that dtype with fp32 accumulation (the model's bf16-compute logits), so
    the [V, D] table is never copied to fp32."""
    if w_VxD.dtype == jnp.float32:
        return jnp.einsum("...d,vd->...v", h_xD.astype(jnp.float32), w_VxD)
    return jnp.einsum("...d,vd->...v", h_xD.astype(w_VxD.dtype), w_VxD, preferred_element_type=jnp.float32)


def _chunk_stats(h_BxcxD, t_Bxc, w_VxD, theory: bool, with_lse: bool = False):
    logits = _logits(h_BxcxD, w_VxD)
    lse = jax.nn.logsumexp(logits, axis=-1)
    logp = logits - lse[..., None]
    lp_t = jnp.take_along_axis(logp, t_Bxc[..., None], axis=-1)[..., 0]
    p = jnp.exp(logp)
    ent = -jnp.sum(p * logp, axis=-1)
    if with_lse:
        return (lp_t, ent, lse) + (_theory_stats(lp_t, ent, logp, p) if theory else ())
    if not theory:
        return lp_t, ent
    return (lp_t, ent) + _theory_stats(lp_t, ent, logp, p)


def _theory_stats(lp_t, ent, logp, p):
    h = lax.stop_gradient(ent)
    lpd = lax.stop_gradient(logp)
    pd = lax.stop_gradient(p)
    s2 = jnp.sum(pd * pd * (lpd + h[..., None]), axis=-1)
    lp_a = lax.stop_gradient(lp_t)
    phi_a = jnp.exp(lp_a) * (lp_a + h) - s2
    return phi_a, critical_surprisal_from_stats(h, s2)


def _vocab_chunk(V: int, target: int) -> int:
    """A vocab chunk near `target` that divides V when a divisor is close (151936 = 32 x 4748), else target."""
    target = max(1, min(int(target), V))
    for n in range(-(-V // target), min(V, 4 * (-(-V // target))) + 1):
        if V % n == 0:
            return V // n
    return target


def _seq_forward(h_BxTxD, t_BxT, w_VxD, c: int, theory: bool):
    """Sequence-chunked forward: [B, T] outputs (lp, ent, lse, *theory); T must be a multiple of c."""
    B, T, D = h_BxTxD.shape
    n = T // c
    h_CxBxcxD = h_BxTxD.reshape(B, n, c, D).swapaxes(0, 1)
    t_CxBxc = t_BxT.reshape(B, n, c).swapaxes(0, 1)
    w_VxD = _constrain(w_VxD, ("act_vocab", None))

    def chunk(xs):
        h = _constrain(xs[0], ("batch", None, None))
        return _chunk_stats(h, xs[1], w_VxD, theory, with_lse=True)

    outs = lax.map(chunk, (h_CxBxcxD, t_CxBxc))
    return tuple(o.swapaxes(0, 1).reshape(B, T) for o in outs)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _lp_ent(h_BxTxD, w_VxD, t_BxT, c: int, vc: int, theory: bool):
    outs = _seq_forward(h_BxTxD, t_BxT, w_VxD, c, theory)
    return (outs[0], outs[1]) + tuple(lax.stop_gradient(o) for o in outs[3:])


def _lp_ent_fwd(h_BxTxD, w_VxD, t_BxT, c, vc, theory):
    outs = _seq_forward(h_BxTxD, t_BxT, w_VxD, c, theory)
    lp, ent, lse = outs[:3]
    return (lp, ent) + tuple(outs[3:]), (h_BxTxD, w_VxD, t_BxT, lse, ent)


def _lp_ent_bwd(c, vc, theory, res, cts):
    h_BxTxD, w_VxD, t_BxT, lse_BxT, ent_BxT = res
    dlp_BxT, dent_BxT = cts[0], cts[1]
    B, T, D = h_BxTxD.shape
    V = w_VxD.shape[0]
    N = B * T
    h_NxD = _constrain(h_BxTxD.reshape(N, D), ("batch", None))
    t_N, lse_N, ent_N = t_BxT.reshape(N), lse_BxT.reshape(N), ent_BxT.reshape(N)
    dlp_N, dent_N = dlp_BxT.reshape(N).astype(jnp.float32), dent_BxT.reshape(N).astype(jnp.float32)
    h32 = h_NxD.astype(jnp.float32)
    # The loop walks every device's own vocab rows: the table viewed as [S, V/S, D] (S = the devices the vocab
    # dim is split over), each shard cut into `nl` chunks of `vl` rows; step k takes rows [k*vl, (k+1)*vl) of
    # every shard. Chunks of the unsplit table straddle shards, and XLA then all-gathered the whole table for
    # the dynamic slice and the stacked d(unembed) for the reshape back, every micro-batch (3 GiB per chip for
    # the 7B on tensor 4).
    S = shard_count("act_vocab", V)
    Vl = V // S
    vl = -(-vc // S)
    nl = -(-Vl // vl)
    w_SxVlxD = w_VxD.reshape(S, Vl, D)
    if nl * vl != Vl:
        w_SxVlxD = jnp.pad(w_SxVlxD, ((0, 0), (0, nl * vl - Vl), (0, 0)))
    w_KxSxvxD = _constrain(w_SxVlxD.reshape(S, nl, vl, D).swapaxes(0, 1), (None, "act_vocab", None, None))
    shard_start_S = lax.iota(jnp.int32, S) * Vl

    def body(dh_NxD, xs):
        k, w_SxvxD = xs
        row_v = k * vl + lax.iota(jnp.int32, vl)  # row inside each shard
        col = (shard_start_S[:, None] + row_v[None, :]).reshape(S * vl)  # row of the whole table
        real = jnp.broadcast_to(row_v[None, :] < Vl, (S, vl)).reshape(S * vl)  # not padding
        w_c = _constrain(w_SxvxD.reshape(S * vl, D), ("act_vocab", None))
        logp = _logits(h_NxD, w_c) - lse_N[:, None]
        p = jnp.where(real[None, :], jnp.exp(logp), 0.0)
        onehot = ((t_N[:, None] == col[None, :]) & real[None, :]).astype(jnp.float32)
        dz = dlp_N[:, None] * (onehot - p) - dent_N[:, None] * p * (logp + ent_N[:, None])
        # each chunk of d(unembed) leaves the loop sharded like the parameter (a reduce-scatter over the batch
        # shards), never as a full fp32 [V, D] copy per device
        dw_c = _constrain(jnp.einsum("nv,nd->vd", dz, h32), ("vocab", "embed"))
        dh_NxD = dh_NxD + jnp.einsum("nv,vd->nd", dz, w_c.astype(jnp.float32))
        return dh_NxD, dw_c.astype(w_VxD.dtype).reshape(S, vl, D)

    dh, dw_KxSxvxD = lax.scan(body, jnp.zeros((N, D), jnp.float32), (jnp.arange(nl), w_KxSxvxD))
    dw = dw_KxSxvxD.swapaxes(0, 1).reshape(S, nl * vl, D)[:, :Vl].reshape(V, D)
    return dh.astype(h_BxTxD.dtype).reshape(B, T, D), dw, None


_lp_ent.defvjp(_lp_ent_fwd, _lp_ent_bwd)


def token_logprobs_and_entropy(
    hidden_BxTxD,
    unembed_VxD,
    targets_BxT,
    mask_BxT,
    *,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    theory: bool = False,
    vocab_chunk_size: int | None = None,
):
    """Returns (logprobs_BxT, entropy_BxT) in float32; with theory=True also a dict {phi, s_star} [B, T]
    (Phi of the target token and the critical surprisal of each position, stop-gradient diagnostics).
    chunk_size: sequence positions per forward chunk; vocab_chunk_size: vocabulary rows per backward chunk
    (default: about V * chunk_size / T, so both passes hold [B*c, V]-sized logit blocks)."""
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
    Tp = n_chunks * c
    if vocab_chunk_size is None:
        vc = _vocab_chunk(V, max(128, -(-V * c // Tp)))
    else:
        if int(vocab_chunk_size) < 1:
            raise ValueError(f"vocab_chunk_size must be >= 1, got {vocab_chunk_size}")
        vc = min(int(vocab_chunk_size), V)
    outs = _lp_ent(h, jnp.asarray(unembed_VxD), tgt, c, vc, bool(theory))
    outs = [jnp.where(valid, o[:, :T], 0.0) for o in outs]
    if not theory:
        return outs[0], outs[1]
    return outs[0], outs[1], {"phi": outs[2], "s_star": outs[3]}


def naive_logprobs_and_entropy(hidden_BxTxD, unembed_VxD, targets_BxT, mask_BxT):
    """Reference: the same quantities from the full [B, T, V] fp32 logits with plain autodiff (tests and the
    memory benchmark only)."""
    valid = jnp.asarray(mask_BxT) > 0
    V = jnp.shape(unembed_VxD)[0]
    tgt = jnp.clip(jnp.where(valid, jnp.asarray(targets_BxT, jnp.int32), 0), 0, V - 1)
    logp = jax.nn.log_softmax(_logits(jnp.asarray(hidden_BxTxD), jnp.asarray(unembed_VxD)), axis=-1)
    lp = jnp.take_along_axis(logp, tgt[..., None], axis=-1)[..., 0]
    ent = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    return jnp.where(valid, lp, 0.0), jnp.where(valid, ent, 0.0)
