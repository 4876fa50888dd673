"""Paged KV cache for the decoder: k/v live in a pool of fixed-size pages, each sequence owns a page table.

The pool of one layer is k/v [N, P, K, Dh] (N pages of P tokens, K kv heads). Row b of a batch maps its
logical page m (token positions [m*P, (m+1)*P)) to physical page page_table_BxM[b, m]. Page 0 is the pool's
trash page: writes of padding / finished rows go there and it is never read unmasked.

This module is the model-side hook of the rollout engine (stare_jax/sampling/engine.py): `paged_forward` runs the
Transformer's own submodules (embed, Block norms/qkv/out/mlp, final norm) with attention over gathered pages, so
transformer.py needs no second decode path. Attention is the pure-JAX gather path (CPU/GPU): the row's first M
pages are gathered into [B, M*P, K, Dh] and masked causally by position, then the model's attention kernel
(`attention.attend`) runs on them, so the math is the static sampler's (same kernel, same fp32 softmax; masked
keys get probability exactly 0). M is chosen per call by the caller (a bucket covering the live pages), so the
read traffic scales with live tokens, not with the context length.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from stare_jax.models import attention as attn_lib
from stare_jax.models.sharding import constrain

TRASH_PAGE = 0  # physical page that absorbs writes of padding tokens and finished rows
POOL_AXES = (None, None, "act_heads", None)  # logical axes of a pool [N, P, K, Dh]: kv heads split like k/v


def init_pages(num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
               dtype=jnp.float32) -> list[dict]:
    """Per layer {"k", "v"}: zeros [num_pages, page_size, num_kv_heads, head_dim]."""
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    return [{"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)} for _ in range(num_layers)]


def write_slots(page_table_BxM: jax.Array, positions_BxT: jax.Array, valid_BxT: jax.Array,
                page_size: int) -> tuple[jax.Array, jax.Array]:
    """(physical page, offset) [B, T] where each token's k/v go; invalid tokens go to the trash page."""
    logical_BxT = jnp.clip(positions_BxT // page_size, 0, page_table_BxM.shape[1] - 1)
    page_BxT = jnp.take_along_axis(page_table_BxM, logical_BxT, axis=1)
    page_BxT = jnp.where(valid_BxT, page_BxT, TRASH_PAGE)
    return page_BxT.astype(jnp.int32), (positions_BxT % page_size).astype(jnp.int32)


def write_pages(pages_NxPxKxD: jax.Array, new_BxTxKxD: jax.Array, page_BxT: jax.Array,
                offset_BxT: jax.Array) -> jax.Array:
    """Scatter the new tokens' k (or v) into their (page, offset) slots."""
    return pages_NxPxKxD.at[page_BxT, offset_BxT].set(new_BxTxKxD.astype(pages_NxPxKxD.dtype))


def gather_pages(pages_NxPxKxD: jax.Array, page_table_BxM: jax.Array) -> jax.Array:
    """A row's first M pages as one contiguous [B, M*P, K, Dh] sequence (index = token position)."""
    b, m = page_table_BxM.shape
    _, p, k, d = pages_NxPxKxD.shape
    return pages_NxPxKxD[page_table_BxM].reshape(b, m * p, k, d)


def paged_attention(impl: str, q_BxTxHxD, k_pages_NxPxKxD, v_pages_NxPxKxD, page_table_BxM, positions_BxT):
    """Attention of queries at `positions_BxT` over their row's pages: key s visible iff s <= query position
    (every such key has been written: the prefix before this call plus this call's own tokens)."""
    k = gather_pages(k_pages_NxPxKxD, page_table_BxM).astype(q_BxTxHxD.dtype)
    v = gather_pages(v_pages_NxPxKxD, page_table_BxM).astype(q_BxTxHxD.dtype)
    s_idx = jnp.arange(k.shape[1])
    mask_BxTxS = s_idx[None, None, :] <= positions_BxT[:, :, None]
    impl = "xla" if impl == "splash" else impl  # splash is for full self-attention, not a cache
    return attn_lib.attend(impl, q_BxTxHxD, k, v, mask_BxTxS)


def paged_forward(model, input_ids_BxT, positions_BxT, valid_BxT, pages: list, page_table_BxM,
                  page_size: int):
    """Run T tokens per row through `model` (a stare_jax Transformer) against the paged cache: write their k/v
    at their positions (valid tokens only), attend over the row's pages. Returns (hidden [B,T,D] after the
    final norm, new pages). Same layer math as Transformer.decode_step."""
    if len(pages) != model.config.num_layers:
        raise ValueError(f"pages has {len(pages)} layers, the model has {model.config.num_layers}")
    positions_BxT = jnp.asarray(positions_BxT, jnp.int32)
    page_BxT, offset_BxT = write_slots(page_table_BxM, positions_BxT, valid_BxT, page_size)
    cos, sin = model._cos_sin(positions_BxT)
    x = model.embed(jnp.asarray(input_ids_BxT, jnp.int32))
    new_pages = []
    for block, layer in zip(model.blocks(), pages):
        attn = block.self_attn
        q, k, v = attn.qkv(block.input_layernorm(x), cos, sin)
        kp = constrain(write_pages(layer["k"], k, page_BxT, offset_BxT), POOL_AXES)
        vp = constrain(write_pages(layer["v"], v, page_BxT, offset_BxT), POOL_AXES)
        o = paged_attention(attn.impl, q, kp, vp, page_table_BxM, positions_BxT)
        x = x + attn.out(o)
        x = x + block.mlp(block.post_attention_layernorm(x))
        new_pages.append({"k": kp, "v": vp})
    return model.norm(x), new_pages
