"""Paged KV cache for the decoder: k/v live in a pool of fixed-size pages, each sequence owns a page table.

The pool of one layer is k/v [K, N, P, Dh] (K kv heads, N pages of P tokens; kv heads first, the layout of jax's
TPU paged-attention kernel), or [D, K, N/D, P, Dh] when the engine splits slots and pages over D data shards
(`pool_shape`). On a CPU the gather backend keeps the key pool transposed, [K, N, Dh, P], so a decode step's
q . k is a plain matrix product (`keys_transposed`). Row b of a batch maps its logical page m (token positions
[m*P, (m+1)*P)) to physical page page_table_BxM[b, m]. Page 0 is the pool's trash page: writes of padding /
finished rows go there and it is never read unmasked.

This module is the model-side hook of the rollout engine (stare_jax/sampling/engine/): `paged_forward` runs the
Transformer's own submodules (embed, Block norms/qkv/out/mlp, final norm) with attention over the row's pages, so
transformer.py needs no second decode path. Two attention backends (sampling.engine.attention):
- "gather" (every platform; prefill always): the row's first M pages are gathered into [K, B, M*P, Dh] and masked
  causally by position, then the model's attention kernel (`attention.attend`) runs on them, so the math is the
  static sampler's (same kernel, same fp32 softmax; masked keys get probability exactly 0). M is chosen per call by
  the caller (a power-of-two bucket covering the live pages at the end of the call), so the read traffic scales
  with live tokens; a decode step gathers only the first m pages of the table, m the fewest of 1/2, 5/8, 3/4, 7/8
  or all of them that hold the longest row (`over_live_pages`: a lax.switch inside the same program, so no more
  programs). A prefill over more than 2 x PREFILL_KEY_BLOCK keys (xla/splash models) attends block by block with
  an online softmax (attention.attention_kv_major_blocked: equal to rounding), so its fp32 scores are one block
  wide.
- "pallas" (decode: one new token per row): jax's TPU kernel `jax.experimental.pallas.ops.tpu.paged_attention`
  reads each row's live pages straight from the pool (no gathered copy); fp32 logits and softmax, k/v read as
  bfloat16 (the kernel casts every page to bfloat16: a float32 pool loses precision, so `resolve_attention`'s auto
  picks it only for a bfloat16 pool). Off TPU it runs in Pallas' TPU interpret mode (tests). On a mesh the kernel
  runs under jax.shard_map, each device on its block (its data shard's pool, its kv heads and their q heads).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas.ops.tpu import paged_attention as pallas_paged
from jax.sharding import PartitionSpec

from stare_jax.models import attention as attn_lib, sharding as sh
from stare_jax.models.sharding import constrain

TRASH_PAGE = 0  # physical page that absorbs writes of padding tokens and finished rows
POOL_AXES = ("act_heads", None, None, None)  # logical axes of a pool [K, N, P, Dh]: kv heads split like k/v
PALLAS_HEAD_DIM = 128  # the TPU kernel's head_dim granularity (lanes): auto picks it for multiples only
PALLAS_BLOCK_TOKENS = 128  # tokens per kernel compute block (pages_per_compute_block = this / page_size)
# prefill (several queries per row) over more than 2 blocks of this many keys runs attention_kv_major_blocked: its
# fp32 scores are one block wide, not the whole context (contexts up to 2 blocks keep the one-pass softmax)
PREFILL_KEY_BLOCK = 1024
# a decode step attends over the fewest of these fractions of its call's page-table width (and the whole width)
# that cover every row's keys (`over_live_pages`)
DECODE_WIDTH_FRACTIONS = (0.5, 0.625, 0.75, 0.875)


def keys_transposed(attention: str, platform: str, impl: str) -> bool:
    """Whether the key pool is laid out [K, N, Dh, P] (each page's keys as Dh rows of P tokens) instead of
    [K, N, P, Dh]: for the gather backend on a CPU with the xla math (impl xla / splash). The gathered keys are then
    [K, B, Dh, S], so a decode step's q . k is a plain [G, Dh] x [Dh, S] product per (kv head, row): XLA's CPU dot
    runs it ~2.5x faster than against [S, Dh] keys (or as a multiply-reduce), ~5% of a greedy decode call of
    benchmarks/rollout_engine.py in same-process paired runs, same tokens. The TPU Pallas kernel reads
    [K, N, P, Dh] pages, and the fused kernels (cudnn, dot_product) take [B, S, K, Dh] keys: those keep it."""
    return attention == "gather" and platform == "cpu" and impl in ("xla", "splash")


def pool_shape(
    num_pages: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    data_shards: int | None = None,
    *,
    transposed: bool = False,
) -> tuple[int, ...]:
    """The shape of one layer's k (or v) pool: [K, N, P, Dh] ([K, N, Dh, P] for keys_transposed's key pool); with
    data_shards D, [D, ...] (N pages per shard, the leading axis over the mesh's batch axes)."""
    shape = (
        (num_kv_heads, num_pages, head_dim, page_size) if transposed else (num_kv_heads, num_pages, page_size, head_dim)
    )
    return shape if data_shards is None else (data_shards, *shape)


def init_pages(
    num_layers: int,
    num_pages: int,
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype=jnp.float32,
    *,
    keys_transposed: bool = False,
) -> list[dict]:
    """Per layer {"k", "v"}: zeros of pool_shape(num_pages, page_size, num_kv_heads, head_dim) (k transposed with
    keys_transposed)."""
    k_shape = pool_shape(num_pages, page_size, num_kv_heads, head_dim, transposed=keys_transposed)
    v_shape = pool_shape(num_pages, page_size, num_kv_heads, head_dim)
    return [{"k": jnp.zeros(k_shape, dtype), "v": jnp.zeros(v_shape, dtype)} for _ in range(num_layers)]


def write_slots(
    page_table_BxM: jax.Array, positions_BxT: jax.Array, valid_BxT: jax.Array, page_size: int
) -> tuple[jax.Array, jax.Array]:
    """(physical page, offset) [B, T] where each token's k/v go; invalid tokens go to the trash page."""
    logical_BxT = jnp.clip(positions_BxT // page_size, 0, page_table_BxM.shape[1] - 1)
    page_BxT = jnp.take_along_axis(page_table_BxM, logical_BxT, axis=1)
    page_BxT = jnp.where(valid_BxT, page_BxT, TRASH_PAGE)
    return page_BxT.astype(jnp.int32), (positions_BxT % page_size).astype(jnp.int32)


def _head_axes(pool_shape) -> tuple:
    """(mesh axes the pool's kv-head dim is split over or None, the ambient mesh); (None, None) without a mesh or
    its activation rules."""
    mesh = jax.sharding.get_abstract_mesh()
    if sh._ctx.rules is None or mesh is None or mesh.empty:
        return None, None
    return sh.logical_to_spec(POOL_AXES, sh._ctx.rules, pool_shape, mesh)[0], mesh


def _on_head_blocks(f, *args, split: tuple):
    """f on each device's block of kv heads: jax.shard_map over the mesh axes the pool's (args[0]) heads are split
    over, args with split[i] True having kv heads leading (the output too), the rest replicated; f itself when
    the heads are not split. Indexing the pool by kv head (its reshapes and gathers below) stays on the device
    holding that head: no all-reduce of gathered pages, no all-gather of the tokens written."""
    heads, mesh = _head_axes(args[0].shape)
    if heads is None:
        return f(*args)
    specs = tuple(PartitionSpec(heads, *[None] * (x.ndim - 1)) if s else PartitionSpec() for x, s in zip(args, split))
    return jax.shard_map(f, mesh=mesh, in_specs=specs, out_specs=specs[0], check_vma=False)(*args)


def _scatter_rows(pages_KxNxPxD, new_KxRxD, slot_R):
    """pages[h, slot // P, slot % P] = new[h, r] for every kv head h: one scatter of Dh-wide rows into the pool viewed
    as [K*N*P, Dh]. Its window is the minor dim only, so a TPU keeps the pool in the kernel's layout (a scatter with
    window (K, Dh) makes XLA lay the pool out kv-heads-minor and copy all of it to and from the Pallas kernel's
    layout every decode step)."""
    k, n, p, d = pages_KxNxPxD.shape
    rows = (jnp.arange(k, dtype=jnp.int32)[:, None] * (n * p) + slot_R[None]).reshape(-1)
    return pages_KxNxPxD.reshape(k * n * p, d).at[rows].set(new_KxRxD.reshape(-1, d)).reshape(k, n, p, d)


def _scatter_columns(pages_KxNxDxP, new_KxRxD, page_R, offset_R):
    """pages[h, page, :, offset] = new[h, r] for every kv head h (a transposed key pool: a token is a column of
    its page)."""
    k, n, d, p = pages_KxNxDxP.shape
    rows = (jnp.arange(k, dtype=jnp.int32)[:, None] * n + page_R[None]).reshape(-1)
    cols = jnp.broadcast_to(offset_R[None], (k, offset_R.shape[0])).reshape(-1)
    return pages_KxNxDxP.reshape(k * n, d, p).at[rows, :, cols].set(new_KxRxD.reshape(-1, d)).reshape(k, n, d, p)


def write_pages(
    pages: jax.Array, new_BxTxKxD: jax.Array, page_BxT: jax.Array, offset_BxT: jax.Array, *, transposed: bool = False
) -> jax.Array:
    """Scatter the new tokens' k (or v) into their (page, offset) slots of every kv head (each device its heads);
    pages [K, N, P, Dh], or [K, N, Dh, P] when transposed (keys_transposed's key pool)."""
    k, d = pages.shape[0], new_BxTxKxD.shape[-1]
    new_KxRxD = jnp.moveaxis(new_BxTxKxD, 2, 0).reshape(k, -1, d).astype(pages.dtype)
    page_R, offset_R = (x.reshape(-1).astype(jnp.int32) for x in (page_BxT, offset_BxT))
    if transposed:
        return _on_head_blocks(_scatter_columns, pages, new_KxRxD, page_R, offset_R, split=(True, True, False, False))
    slot_R = page_R * pages.shape[2] + offset_R
    return _on_head_blocks(_scatter_rows, pages, new_KxRxD, slot_R, split=(True, True, False))


def _gather_rows(pages_KxNxPxD, page_table_BxM):
    """gather_pages on one block of kv heads: one gather per kv head of whole pages as rows of P*Dh values."""
    b, m = page_table_BxM.shape
    k, n, p, d = pages_KxNxPxD.shape
    rows_KxNxR = pages_KxNxPxD.reshape(k, n, p * d)
    return jnp.stack([rows_KxNxR[h][page_table_BxM] for h in range(k)]).reshape(k, b, m * p, d)


def _gather_columns(pages_KxNxDxP, page_table_BxM):
    """gather_pages of a transposed pool on one block of kv heads: per kv head, one gather of whole [Dh, P] pages
    laid out [B, Dh, M, P] (the page index between Dh and the offset), so [B, Dh, M*P] is a free reshape."""
    b, m = page_table_BxM.shape
    k, n, d, p = pages_KxNxDxP.shape
    dims = jax.lax.GatherDimensionNumbers(offset_dims=(1, 3), collapsed_slice_dims=(0,), start_index_map=(0,))
    index_BxMx1 = page_table_BxM[..., None].astype(jnp.int32)
    return jnp.stack(
        [
            jax.lax.gather(
                pages_KxNxDxP[h], index_BxMx1, dims, slice_sizes=(1, d, p), mode=jax.lax.GatherScatterMode.CLIP
            )
            for h in range(k)
        ]
    ).reshape(k, b, d, m * p)


def gather_pages(pages: jax.Array, page_table_BxM: jax.Array, *, transposed: bool = False) -> jax.Array:
    """A row's first M pages as one contiguous [K, B, M*P, Dh] sequence per kv head (index = token position);
    a transposed pool [K, N, Dh, P] gives [K, B, Dh, M*P]. kv heads stay first, as in the pool, so nothing is
    transposed; each device gathers its own kv heads, one gather per head of whole pages (as rows of P*Dh values:
    XLA's CPU gather of those is ~3x faster than one gather of [P, Dh] slices over every kv head)."""
    return _on_head_blocks(_gather_columns if transposed else _gather_rows, pages, page_table_BxM, split=(True, False))


def _copy_rows(pages_KxNxPxD, src_C, dst_C):
    """copy_pages on one block of kv heads, whole pages as rows of the pool viewed as [K*N, P*Dh] (the scatter's
    window is the minor dim only: see _scatter_rows)."""
    k, n, p, d = pages_KxNxPxD.shape
    head_K1 = jnp.arange(k, dtype=jnp.int32)[:, None] * n
    rows_NxR = pages_KxNxPxD.reshape(k * n, p * d)
    return (
        rows_NxR.at[(head_K1 + dst_C[None]).reshape(-1)]
        .set(rows_NxR[(head_K1 + src_C[None]).reshape(-1)])
        .reshape(k, n, p, d)
    )


def copy_pages(pages_KxNxPxD: jax.Array, src_C: jax.Array, dst_C: jax.Array) -> jax.Array:
    """pages[:, dst] = pages[:, src] (every kv head): copy-on-write of a shared prompt's partial last page."""
    return _on_head_blocks(
        _copy_rows,
        pages_KxNxPxD,
        jnp.asarray(src_C, jnp.int32),
        jnp.asarray(dst_C, jnp.int32),
        split=(True, False, False),
    )


def resolve_attention(choice: str, *, platform: str, head_dim: int, cache_dtype) -> str:
    """The decode attention backend for sampling.engine.attention = choice: "gather" or "pallas" as given; auto =
    pallas on a TPU when the kernel fits (head_dim a multiple of 128 lanes and a bfloat16 pool: the kernel reads
    pages as bfloat16), else gather."""
    if choice in ("gather", "pallas"):
        return choice
    if choice != "auto":
        raise ValueError(f"sampling.engine.attention={choice!r}: expected auto, gather or pallas")
    fits = head_dim % PALLAS_HEAD_DIM == 0 and jnp.dtype(cache_dtype) == jnp.bfloat16
    return "pallas" if platform == "tpu" and fits else "gather"


def _pages_per_block(width: int, page_size: int) -> int:
    """pages_per_compute_block: the largest divisor of the page-table width with at most PALLAS_BLOCK_TOKENS
    tokens (at least one page); the kernel needs it to divide the width."""
    target = max(PALLAS_BLOCK_TOKENS // page_size, 1)
    return max(d for d in range(1, min(target, width) + 1) if width % d == 0)


def _kernel(q_BxHxD, k_pages_KxNxPxD, v_pages_KxNxPxD, lengths_B, page_table_BxM, *, interpret: bool):
    """The Pallas kernel on one device's block (Pallas' TPU interpret mode off TPU)."""
    call = functools.partial(
        pallas_paged.paged_attention,
        q_BxHxD,
        k_pages_KxNxPxD,
        v_pages_KxNxPxD,
        lengths_B,
        page_table_BxM,
        pages_per_compute_block=_pages_per_block(page_table_BxM.shape[1], k_pages_KxNxPxD.shape[2]),
    )
    if not interpret:
        return call()
    with pltpu.force_tpu_interpret_mode():
        return call()


def _local_blocks(f, lead: int):
    """f over the leading `lead` (0 or 1) shard axis of a device's block: one kernel call per local data shard."""
    if not lead:
        return f
    return lambda *xs: jnp.stack([f(*(x[d] for x in xs)) for d in range(xs[0].shape[0])])


def _sharded_kernel(
    q_BxHxD, k_pages, v_pages, lengths_B, page_table_BxM, *, lead: int, batch_axes: tuple, interpret: bool
):
    """The kernel under jax.shard_map over the ambient mesh (each device on its data shard's pool and its kv heads
    with their q heads); with lead=1 every argument has a leading data-shard axis, split over batch_axes. Without
    a mesh (or its activation rules) the kernel itself."""
    kernel = _local_blocks(functools.partial(_kernel, interpret=interpret), lead)
    heads, mesh = _head_axes(k_pages.shape[lead:])
    if mesh is None:
        return kernel(q_BxHxD, k_pages, v_pages, lengths_B, page_table_BxM)
    rows = (batch_axes or None,) if lead else ()
    q_spec = PartitionSpec(*rows, None, heads, None)
    pool_spec = PartitionSpec(*rows, heads, None, None, None)
    row_spec = PartitionSpec(*rows)
    fn = jax.shard_map(
        kernel,
        mesh=mesh,
        in_specs=(q_spec, pool_spec, pool_spec, row_spec, row_spec),
        out_specs=q_spec,
        check_vma=False,
    )
    return fn(q_BxHxD, k_pages, v_pages, lengths_B, page_table_BxM)


@functools.lru_cache(maxsize=None)
def _decode_kernel(batch_axes: tuple, interpret: bool):
    """The kernel call of one data shard's rows, as a function whose vmap over the data shards (the engine's
    jax.vmap(spmd_axis_name=batch_axes)) is one shard_map over the batch axes (custom_vmap): XLA cannot partition
    a Pallas call, and the kernel's own batching rule would not keep each shard's pool on its devices."""

    @jax.custom_batching.custom_vmap
    def kernel(q_BxHxD, k_pages, v_pages, lengths_B, page_table_BxM):
        return _sharded_kernel(
            q_BxHxD, k_pages, v_pages, lengths_B, page_table_BxM, lead=0, batch_axes=(), interpret=interpret
        )

    @kernel.def_vmap
    def over_shards(axis_size, in_batched, *args):
        args = [x if b else jnp.broadcast_to(x, (axis_size, *x.shape)) for x, b in zip(args, in_batched)]
        return _sharded_kernel(*args, lead=1, batch_axes=batch_axes, interpret=interpret), True

    return kernel


def pallas_decode_attention(
    q_BxTxHxD, k_pages_KxNxPxD, v_pages_KxNxPxD, page_table_BxM, positions_BxT, *, batch_axes: tuple = ()
):
    """Decode attention (T = 1) through the TPU Pallas kernel: the query at position t sees keys 0..t of its row's
    pages (lengths t + 1). fp32 logits and softmax; the kernel does not scale q, so q is scaled here in fp32.
    batch_axes: the mesh axes of the engine's data-shard vmap (none for one shard)."""
    b, t, h, d = q_BxTxHxD.shape
    if t != 1:
        raise ValueError(f"the Pallas paged-attention kernel decodes one token per row, got {t} (prefill gathers)")
    q_BxHxD = q_BxTxHxD[:, 0].astype(jnp.float32) * d**-0.5
    lengths_B = (positions_BxT[:, 0] + 1).astype(jnp.int32)
    kernel = _decode_kernel(tuple(batch_axes), attn_lib.target_platform() != "tpu")
    out_BxHxD = kernel(q_BxHxD, k_pages_KxNxPxD, v_pages_KxNxPxD, lengths_B, page_table_BxM.astype(jnp.int32))
    return out_BxHxD[:, None].astype(q_BxTxHxD.dtype)


def paged_attention(
    impl: str,
    q_BxTxHxD,
    k_pages,
    v_pages_KxNxPxD,
    page_table_BxM,
    positions_BxT,
    *,
    attention: str = "gather",
    batch_axes: tuple = (),
    keys_transposed: bool = False,
):
    """Attention of queries at `positions_BxT` over their row's pages: key s visible iff s <= query position
    (every such key has been written: the prefix before this call plus this call's own tokens). attention="pallas"
    runs decode (one query per row) through the TPU kernel; "gather" (and any prefill) gathers the pages (a decode
    step only the pages its longest row needs: over_live_pages); a prefill over more than 2 x PREFILL_KEY_BLOCK
    keys attends one key block at a time. keys_transposed: k_pages is [K, N, Dh, P] (`keys_transposed`)."""
    if attention == "pallas" and q_BxTxHxD.shape[1] == 1:
        if keys_transposed:
            raise ValueError("the Pallas paged-attention kernel reads [K, N, P, Dh] key pages, not transposed ones")
        return pallas_decode_attention(
            q_BxTxHxD, k_pages, v_pages_KxNxPxD, page_table_BxM, positions_BxT, batch_axes=batch_axes
        )
    attend = functools.partial(
        _attend_pages,
        impl,
        q_BxTxHxD,
        k_pages,
        v_pages_KxNxPxD,
        positions_BxT=positions_BxT,
        keys_transposed=keys_transposed,
    )
    if q_BxTxHxD.shape[1] > 1:
        return attend(page_table_BxM)
    return over_live_pages(
        lambda m: attend(page_table_BxM[:, :m]),
        positions_BxT,
        page_table_BxM.shape[1],
        v_pages_KxNxPxD.shape[2],
        batch_axes=batch_axes,
    )


def decode_page_widths(width: int) -> list[int]:
    """The page counts a decode step of a call with page-table width `width` may attend over: width and
    DECODE_WIDTH_FRACTIONS of it (whole pages)."""
    return sorted({max(1, int(width * f)) for f in DECODE_WIDTH_FRACTIONS} | {int(width)})


def over_live_pages(attend_over, positions_BxT, width: int, page_size: int, *, batch_axes: tuple = ()):
    """attend_over(m) for the fewest pages m of `decode_page_widths(width)` that hold every row's keys (max
    position + 1 <= m * page_size), chosen on device by lax.switch: the page-table width is a power-of-two bucket
    fixed for a whole decode chunk (few programs), so without this the steps of a row at 129 tokens would attend
    over 256 keys. Keys past a row's position are masked either way, so only the rounding of the softmax sums
    changes. One width (the whole table) inside a data-shard vmap (batch_axes), where a per-shard predicate would
    make the switch run every branch."""
    widths = decode_page_widths(width)
    if len(widths) == 1 or batch_axes:
        return attend_over(width)
    need = jnp.max(positions_BxT) + 1
    index = sum((need > m * page_size).astype(jnp.int32) for m in widths[:-1])
    return jax.lax.switch(index, [functools.partial(attend_over, m) for m in widths])


def _attend_pages(
    impl: str, q_BxTxHxD, k_pages, v_pages_KxNxPxD, page_table_BxM, positions_BxT, *, keys_transposed: bool = False
):
    """The gather path: the row's pages gathered by position (v [K, B, M*P, Dh]; k the same, or [K, B, Dh, M*P]
    from a transposed key pool), key s visible iff s <= query position, the model's attention kernel."""
    k_KxBxSxD = gather_pages(k_pages, page_table_BxM, transposed=keys_transposed).astype(q_BxTxHxD.dtype)
    v_KxBxSxD = gather_pages(v_pages_KxNxPxD, page_table_BxM).astype(q_BxTxHxD.dtype)
    s_idx = jnp.arange(v_KxBxSxD.shape[2])
    mask_BxTxS = s_idx[None, None, :] <= positions_BxT[:, :, None]
    if impl in ("xla", "splash"):  # splash is for full self-attention, not a cache: the xla math, kv-head-major
        if q_BxTxHxD.shape[1] > 1 and v_KxBxSxD.shape[2] > 2 * PREFILL_KEY_BLOCK:
            return attn_lib.attention_kv_major_blocked(
                q_BxTxHxD, k_KxBxSxD, v_KxBxSxD, mask_BxTxS, block=PREFILL_KEY_BLOCK, keys_transposed=keys_transposed
            )
        return attn_lib.attention_kv_major(q_BxTxHxD, k_KxBxSxD, v_KxBxSxD, mask_BxTxS, keys_transposed=keys_transposed)
    if keys_transposed:
        raise ValueError(f"attention_impl={impl!r} takes [B, S, K, Dh] keys: a transposed key pool is for xla/splash")
    k, v = (jnp.moveaxis(x, 0, 2) for x in (k_KxBxSxD, v_KxBxSxD))  # the fused kernels take [B, S, K, Dh]
    return attn_lib.attend(impl, q_BxTxHxD, k, v, mask_BxTxS)


def paged_forward(
    model,
    input_ids_BxT,
    positions_BxT,
    valid_BxT,
    pages: list,
    page_table_BxM,
    page_size: int,
    *,
    attention: str = "gather",
    batch_axes: tuple = (),
    keys_transposed: bool = False,
):
    """Run T tokens per row through `model` (a stare_jax Transformer) against the paged cache: write their k/v
    at their positions (valid tokens only), attend over the row's pages (`paged_attention`'s backends; prefill
    calls, T > 1, always gather). keys_transposed: the key pools are [K, N, Dh, P] (`keys_transposed`). Returns
    (hidden [B,T,D] after the final norm, new pages). Same layer math as Transformer.decode_step."""
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
        kp = constrain(write_pages(layer["k"], k, page_BxT, offset_BxT, transposed=keys_transposed), POOL_AXES)
        vp = constrain(write_pages(layer["v"], v, page_BxT, offset_BxT), POOL_AXES)
        o = paged_attention(
            attn.impl,
            q,
            kp,
            vp,
            page_table_BxM,
            positions_BxT,
            attention=attention,
            batch_axes=batch_axes,
            keys_transposed=keys_transposed,
        )
        x = x + attn.out(o)
        x = x + block.mlp(block.post_attention_layernorm(x))
        new_pages.append({"k": kp, "v": vp})
    return model.norm(x), new_pages
