"""Grouped-query attention kernels behind one switch (`ModelConfig.attention_impl`).

All take q [B,T,H,Dh], k/v [B,S,K,Dh] (K divides H) and a boolean mask [B,T,S] (True = may attend) and return
[B,T,H,Dh] in q's dtype. Softmax is always computed in float32. Rows with no allowed key (padding queries)
give a finite uniform average, never NaN.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk, splash_attention_mask as sm

from stare_jax.models import sharding as sh

_NEG = -0.7 * float(np.finfo(np.float32).max)  # finite "minus infinity": fully-masked rows stay NaN-free


def causal_padding_mask(attention_mask_BxT: jax.Array) -> jax.Array:
    """[B,T,T] bool: query t may see key s iff s <= t, key s is a real token and both lie in the same segment.

    attention_mask_BxT holds segment ids: 0 = padding, any other value names one sequence (a 0/1 mask is the
    one-sequence-per-row case; packed rows number their sequences 1, 2, ...), so attention never crosses from one
    packed sequence into another. A padding query (id 0) sees every real key at or before it, as before segment
    ids existed (its output is never used, and it stays finite)."""
    t = attention_mask_BxT.shape[1]
    causal_TxT = jnp.tril(jnp.ones((t, t), dtype=bool))
    q_BxTx1, k_Bx1xT = attention_mask_BxT[:, :, None], attention_mask_BxT[:, None, :]
    return causal_TxT[None] & (k_Bx1xT > 0) & ((q_BxTx1 == k_Bx1xT) | (q_BxTx1 == 0))


def cache_mask(t: int, s: int, cache_index, kv_mask_BxS: jax.Array) -> jax.Array:
    """[B,T,S] bool for decoding into a cache: query t sits in slot cache_index+t and sees slots
    s <= cache_index+t that hold real tokens (kv_mask_BxS == 1)."""
    q_slot_T = cache_index + jnp.arange(t)
    causal_TxS = jnp.arange(s)[None, :] <= q_slot_T[:, None]
    return causal_TxS[None] & (kv_mask_BxS[:, None, :] > 0)


def attention_xla(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, mask_BxTxS):
    """Reference einsum attention: bf16/fp32 matmul inputs, fp32 logits and softmax."""
    b, t, h, d = q_BxTxHxD.shape
    kh = k_BxSxKxD.shape[2]
    g = h // kh
    q_BxTxKxGxD = q_BxTxHxD.reshape(b, t, kh, g, d)
    logits = jnp.einsum("btkgd,bskd->bkgts", q_BxTxKxGxD, k_BxSxKxD, preferred_element_type=jnp.float32) * (d**-0.5)
    logits = jnp.where(mask_BxTxS[:, None, None, :, :], logits, _NEG)
    probs = jax.nn.softmax(logits, axis=-1).astype(v_BxSxKxD.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, v_BxSxKxD, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, d).astype(q_BxTxHxD.dtype)


def _scores_kv_major(q_KxBxGxTxD, k_KxBxSxD, *, keys_transposed: bool = False):
    """q . k in fp32, [K, B, G, T, S]; with keys_transposed k is [K, B, Dh, S] (the CPU engine's key pool layout:
    then the product is a plain [G*T, Dh] x [Dh, S] matrix product per (kv head, row), which XLA's CPU dot runs
    ~2.5x faster than the same product against [S, Dh] keys or a multiply-reduce over Dh)."""
    spec = "kbgtd,kbds->kbgts" if keys_transposed else "kbgtd,kbsd->kbgts"
    return jnp.einsum(spec, q_KxBxGxTxD, k_KxBxSxD, preferred_element_type=jnp.float32)


def attention_kv_major(q_BxTxHxD, k_KxBxSxD, v_KxBxSxD, mask_BxTxS, *, keys_transposed: bool = False):
    """attention_xla's math with k/v kv-head-major [K, B, S, Dh] (a paged pool's layout, gathered; with
    keys_transposed k is [K, B, Dh, S]): the scores and the output einsum batch over (kv head, row) in that order,
    so the large k/v operands are read in place and only the small q / output are transposed (about 4% faster per
    CPU greedy decode call than stacking the gathered cache row-major [B, S, K, Dh] for attention_xla, in one
    paired run)."""
    b, t, h, d = q_BxTxHxD.shape
    kh = k_KxBxSxD.shape[0]
    g = h // kh
    q_KxBxGxTxD = jnp.transpose(q_BxTxHxD.reshape(b, t, kh, g, d), (2, 0, 3, 1, 4))
    logits = _scores_kv_major(q_KxBxGxTxD, k_KxBxSxD, keys_transposed=keys_transposed) * (d**-0.5)
    logits = jnp.where(mask_BxTxS[None, :, None, :, :], logits, _NEG)
    probs = jax.nn.softmax(logits, axis=-1).astype(v_KxBxSxD.dtype)
    out_KxBxGxTxD = jnp.einsum("kbgts,kbsd->kbgtd", probs, v_KxBxSxD, preferred_element_type=jnp.float32)
    return jnp.transpose(out_KxBxGxTxD, (1, 3, 0, 2, 4)).reshape(b, t, h, d).astype(q_BxTxHxD.dtype)


def attention_kv_major_blocked(
    q_BxTxHxD, k_KxBxSxD, v_KxBxSxD, mask_BxTxS, *, block: int, keys_transposed: bool = False
):
    """attention_kv_major over keys in blocks of `block` with an online softmax (flash attention's running max /
    sum recurrence, in plain JAX under lax.scan): the fp32 logits and probabilities live one [.., T, block] block
    at a time instead of [.., T, S] (the rollout engine's prefill over a long context: 15.9 GiB per chip of them
    for the 7B tool configs). Equal to attention_kv_major up to float rounding (the probabilities are normalised
    at the end, not before the cast to v's dtype); keys past S (padding S up to whole blocks) are masked. With
    keys_transposed k is [K, B, Dh, S]."""
    b, t, h, d = q_BxTxHxD.shape
    kh, _, s, _ = v_KxBxSxD.shape
    g = h // kh
    nb = -(-s // block)
    k_axis = 3 if keys_transposed else 2  # k's key axis
    if nb * block != s:
        pad_v = [(0, 0)] * 4
        pad_v[2] = (0, nb * block - s)
        pad_k = [(0, 0)] * 4
        pad_k[k_axis] = (0, nb * block - s)
        k_KxBxSxD, v_KxBxSxD = jnp.pad(k_KxBxSxD, pad_k), jnp.pad(v_KxBxSxD, pad_v)
        mask_BxTxS = jnp.pad(mask_BxTxS, ((0, 0), (0, 0), (0, nb * block - s)))
    q_KxBxGxTxD = jnp.transpose(q_BxTxHxD.reshape(b, t, kh, g, d), (2, 0, 3, 1, 4))

    def one_block(carry, i):
        m_KxBxGxT, l_KxBxGxT, acc_KxBxGxTxD = carry
        k_blk = jax.lax.dynamic_slice_in_dim(k_KxBxSxD, i * block, block, axis=k_axis)
        v_blk = jax.lax.dynamic_slice_in_dim(v_KxBxSxD, i * block, block, axis=2)
        mask_blk = jax.lax.dynamic_slice_in_dim(mask_BxTxS, i * block, block, axis=2)
        logits = _scores_kv_major(q_KxBxGxTxD, k_blk, keys_transposed=keys_transposed) * (d**-0.5)
        logits = jnp.where(mask_blk[None, :, None, :, :], logits, _NEG)
        m_new = jnp.maximum(m_KxBxGxT, jnp.max(logits, axis=-1))
        rescale = jnp.exp(m_KxBxGxT - m_new)
        p = jnp.exp(logits - m_new[..., None])
        pv = jnp.einsum("kbgts,kbsd->kbgtd", p.astype(v_blk.dtype), v_blk, preferred_element_type=jnp.float32)
        return (m_new, l_KxBxGxT * rescale + jnp.sum(p, axis=-1), acc_KxBxGxTxD * rescale[..., None] + pv), None

    init = (
        jnp.full((kh, b, g, t), _NEG, jnp.float32),
        jnp.zeros((kh, b, g, t), jnp.float32),
        jnp.zeros((kh, b, g, t, d), jnp.float32),
    )
    (_, l_KxBxGxT, acc_KxBxGxTxD), _ = jax.lax.scan(one_block, init, jnp.arange(nb))
    out_KxBxGxTxD = acc_KxBxGxTxD / l_KxBxGxT[..., None]
    return jnp.transpose(out_KxBxGxTxD, (1, 3, 0, 2, 4)).reshape(b, t, h, d).astype(q_BxTxHxD.dtype)


def attention_dot_product(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, mask_BxTxS, *, implementation=None):
    """jax.nn.dot_product_attention (native GQA). implementation=None is XLA's fused path (jax 0.10 never
    auto-selects cuDNN); "cudnn" asks for cuDNN's fused flash kernel (GPU, bf16/fp16 only)."""
    dt = q_BxTxHxD.dtype
    out = jax.nn.dot_product_attention(
        q_BxTxHxD,
        k_BxSxKxD.astype(dt),
        v_BxSxKxD.astype(dt),
        mask=mask_BxTxS[:, None, :, :],
        scale=q_BxTxHxD.shape[-1] ** -0.5,
        implementation=implementation,
    )
    return out.astype(dt)


def target_platform() -> str:
    """The platform the program being traced is for: the ambient mesh's (jax.set_mesh), which may be a TPU
    topology's abstract devices in an ahead-of-time compile on a CPU host, else the default backend."""
    mesh = jax.sharding.get_abstract_mesh()
    device = None if mesh is None or mesh.empty else getattr(mesh, "abstract_device", None)
    return getattr(device, "platform", None) or jax.default_backend()


def _cudnn_usable(q) -> bool:
    return target_platform() == "gpu" and q.dtype in (jnp.bfloat16, jnp.float16)


@functools.lru_cache(maxsize=32)
def _splash_mask(t: int, num_heads: int):
    """The causal multi-head mask object for one shape (host-side numpy; cached so splash's own mask-processing
    cache, keyed by this object, is hit by every layer and every trace)."""
    return sm.MultiHeadMask([sm.CausalMask((t, t)) for _ in range(num_heads)])


def _splash_kernel(t: int, num_heads: int, interpret: bool):
    """The kernel for one shape, built inside the current trace: its mask-info arrays are staged as constants of
    the program being traced (so nothing concrete is created on the host's devices, or on a TPU topology's
    compile-only ones, and no kernel is shared between traces or shard_map contexts)."""
    bq = next((b for b in (512, 256, 128) if t % b == 0), t)
    sizes = sk.BlockSizes(
        block_q=bq,
        block_kv_compute=bq,
        block_kv=bq,
        block_q_dkv=bq,
        block_kv_dkv=bq,
        block_kv_dkv_compute=bq,
        block_q_dq=bq,
        block_kv_dq=bq,
    )
    return sk.make_splash_mha(
        _splash_mask(t, num_heads), block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret
    )


def attention_splash(q_BxTxHxD, k_BxSxKxD, v_BxSxKxD, segment_ids_BxT, *, interpret: bool | None = None):
    """Pallas splash (flash) attention for TPU, self-attention only (T == S), causal.

    Padding and packing are expressed through segment ids (the attention mask itself: padding 0, each packed
    sequence its own id): a real query sees only keys of its own segment at or before it, exactly like
    `causal_padding_mask` for real positions. T is padded up to a multiple of
    128 (the kernel's block granularity) with an extra segment. interpret=None runs the Pallas interpreter off-TPU
    (CPU tests)."""
    b, t, h, d = q_BxTxHxD.shape
    pad = -t % 128  # the kernel needs whole 128-token blocks: pad the tail as a separate segment (id 0)
    if pad:
        widths = ((0, 0), (0, pad), (0, 0), (0, 0))
        out = attention_splash(
            jnp.pad(q_BxTxHxD, widths),
            jnp.pad(k_BxSxKxD, widths),
            jnp.pad(v_BxSxKxD, widths),
            jnp.pad(segment_ids_BxT, ((0, 0), (0, pad))),
            interpret=interpret,
        )
        return out[:, :t]
    kh = k_BxSxKxD.shape[2]
    if interpret is None:
        interpret = target_platform() != "tpu"
    kernel = _splash_kernel(t, h, bool(interpret))
    g = h // kh
    # splash takes [H, T, D] per example; repeat kv heads for GQA.
    q = jnp.swapaxes(q_BxTxHxD, 1, 2) * (d**-0.5)
    k = jnp.repeat(jnp.swapaxes(k_BxSxKxD, 1, 2), g, axis=1).astype(q.dtype)
    v = jnp.repeat(jnp.swapaxes(v_BxSxKxD, 1, 2), g, axis=1).astype(q.dtype)
    seg = segment_ids_BxT.astype(jnp.int32)

    def one(q1, k1, v1, s1):
        return kernel(q1, k1, v1, segment_ids=sk.SegmentIds(q=s1, kv=s1))

    out_BxHxTxD = jax.vmap(one)(q, k, v, seg)
    return jnp.swapaxes(out_BxHxTxD, 1, 2).astype(q_BxTxHxD.dtype)


def _splash_maybe_sharded(q, k, v, attention_mask_BxT):
    """Under an ambient mesh with activation rules (see sharding.activation_rules), run the kernel per shard
    with jax.shard_map (batch over the batch axes, heads over the head axis): XLA cannot partition a Pallas
    call itself. Otherwise call it directly."""
    rules = sh._ctx.rules
    mesh = jax.sharding.get_abstract_mesh()
    if rules is None or mesh is None or mesh.empty:
        return attention_splash(q, k, v, attention_mask_BxT)
    g = q.shape[2] // k.shape[2]
    k = jnp.repeat(k, g, axis=2)  # heads sharded together with q's heads
    v = jnp.repeat(v, g, axis=2)
    spec = sh.logical_to_spec(("batch", "seq", "act_heads", None), rules, q.shape, mesh)
    seg_spec = jax.sharding.PartitionSpec(spec[0], None)
    fn = jax.shard_map(
        attention_splash, mesh=mesh, in_specs=(spec, spec, spec, seg_spec), out_specs=spec, check_vma=False
    )
    return fn(q, k, v, attention_mask_BxT)


def attend(impl: str, q, k, v, mask_BxTxS, *, attention_mask_BxT=None):
    """Dispatch on ModelConfig.attention_impl. "splash" needs the [B,T] padding mask (self-attention)."""
    if impl == "xla":
        return attention_xla(q, k, v, mask_BxTxS)
    if impl == "dot_product":
        return attention_dot_product(q, k, v, mask_BxTxS)
    if impl == "cudnn":  # off GPU or in fp32 cuDNN cannot run: same math through XLA's fused path
        return attention_dot_product(q, k, v, mask_BxTxS, implementation="cudnn" if _cudnn_usable(q) else None)
    if impl == "splash":
        if attention_mask_BxT is None or q.shape[1] != k.shape[1]:
            return attention_xla(q, k, v, mask_BxTxS)  # decode steps: T != S, splash is for full sequences
        return _splash_maybe_sharded(q, k, v, attention_mask_BxT)
    raise ValueError(f"attention_impl={impl!r} not in ('xla', 'dot_product', 'cudnn', 'splash')")
