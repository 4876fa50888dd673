"""Paged forward == the model's full forward: prefill a sequence in chunks into scattered pages, then decode one
token, and compare hidden states / logits with Transformer.__call__ on the whole sequence, with the key pool
[K, N, P, Dh] and transposed [K, N, Dh, P] (the CPU's). The pool layout (kv heads first), and the TPU Pallas decode
kernel (Pallas interpret mode on CPU) == the gather path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stare_jax.models import ModelConfig, init_model, paged_attention as pa
from stare_jax.models.sharding import make_mesh, program_context
from support.params import representative


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig(
        vocab_size=128,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        qkv_bias=True,
        initializer_range=0.1,
    )
    return init_model(cfg, seed=1)


def test_pool_shape_is_kv_heads_first():
    assert pa.pool_shape(9, 4, 2, 16) == (2, 9, 4, 16)
    assert pa.pool_shape(9, 4, 2, 16, data_shards=3) == (3, 2, 9, 4, 16)
    assert pa.pool_shape(9, 4, 2, 16, data_shards=3, transposed=True) == (3, 2, 9, 16, 4)
    assert pa.init_pages(1, 9, 4, 2, 16)[0]["k"].shape == (2, 9, 4, 16)
    layer = pa.init_pages(1, 9, 4, 2, 16, keys_transposed=True)[0]
    assert layer["k"].shape == (2, 9, 16, 4) and layer["v"].shape == (2, 9, 4, 16)


def test_keys_are_transposed_for_the_cpu_gather_path_only():
    assert pa.keys_transposed("gather", "cpu", "xla") and pa.keys_transposed("gather", "cpu", "splash")
    assert not pa.keys_transposed("pallas", "cpu", "xla")  # the TPU kernel reads [K, N, P, Dh] pages
    assert not pa.keys_transposed("gather", "gpu", "xla") and not pa.keys_transposed("gather", "tpu", "xla")
    assert not pa.keys_transposed("gather", "cpu", "cudnn")  # the fused kernels take [B, S, K, Dh] keys


@pytest.mark.parametrize("transposed", [False, True], ids=["PxDh", "DhxP"])
def test_gather_and_write_layout(transposed):
    pages = jnp.zeros((2, 5, 1, 2) if transposed else (2, 5, 2, 1))  # [K, N, P, Dh] or [K, N, Dh, P]
    page, off = pa.write_slots(
        jnp.asarray([[3, 1, 0]]), jnp.asarray([[0, 1, 2, 3]]), jnp.asarray([[1, 1, 1, 0]]) > 0, 2
    )
    np.testing.assert_array_equal(page, [[3, 3, 1, 0]])  # the invalid token goes to the trash page
    np.testing.assert_array_equal(off, [[0, 1, 0, 1]])
    new_BxTxKxD = jnp.stack([jnp.arange(1.0, 5.0), 10 * jnp.arange(1.0, 5.0)], axis=-1).reshape(1, 4, 2, 1)
    pages = pa.write_pages(pages, new_BxTxKxD, page, off, transposed=transposed)
    at = (lambda h, p, o: pages[h, p, 0, o]) if transposed else (lambda h, p, o: pages[h, p, o, 0])
    assert at(1, 3, 1) == 20 and at(0, 1, 0) == 3  # head 1 of token 1 -> page 3 offset 1
    seq = pa.gather_pages(pages, jnp.asarray([[3, 1]]), transposed=transposed)  # kv heads first
    seq_KxS = seq[:, 0, 0, :] if transposed else seq[:, 0, :, 0]  # [K, B, Dh, M*P] or [K, B, M*P, Dh]
    np.testing.assert_array_equal(seq_KxS, [[1, 2, 3, 0], [10, 20, 30, 0]])
    copied = pa.copy_pages(pages, jnp.asarray([3]), jnp.asarray([2]))
    np.testing.assert_array_equal(copied[:, 2], pages[:, 3])
    np.testing.assert_array_equal(copied[:, 3], pages[:, 3])


def test_transposed_key_pages_gather_to_the_transposed_sequence():
    """Written through the same slots, a [K, N, Dh, P] key pool gathers to exactly the [K, N, P, Dh] pool's
    sequence with Dh and S swapped (several heads, Dh > 1, scattered pages, a trash-padded table)."""
    rng = np.random.default_rng(3)
    K, N, P, D = 2, 7, 4, 3
    table = jnp.asarray([[5, 2, 0], [1, 6, 3]])
    pos = jnp.asarray(np.tile(np.arange(10), (2, 1)))
    page, off = pa.write_slots(table, pos, jnp.ones((2, 10), bool), P)
    new = jnp.asarray(rng.normal(size=(2, 10, K, D)), jnp.float32)
    std = pa.write_pages(jnp.zeros((K, N, P, D)), new, page, off)
    tr = pa.write_pages(jnp.zeros((K, N, D, P)), new, page, off, transposed=True)
    np.testing.assert_array_equal(np.swapaxes(np.asarray(tr), -1, -2), np.asarray(std))
    np.testing.assert_array_equal(
        np.asarray(pa.gather_pages(tr, table, transposed=True)),
        np.swapaxes(np.asarray(pa.gather_pages(std, table)), -1, -2),
    )


@pytest.mark.parametrize("keys_transposed", representative([False, True]), ids=["keys-PxDh", "keys-DhxP"])
def test_chunked_paged_prefill_and_decode_match_full_forward(model, keys_transposed):
    cfg = model.config
    ps, L = 4, 11
    ids = np.random.default_rng(0).integers(1, cfg.vocab_size, size=L + 1)
    pages = pa.init_pages(cfg.num_layers, 9, ps, cfg.num_kv_heads, cfg.head_dim, keys_transposed=keys_transposed)
    table = jnp.asarray([[7, 2, 5, 8]])  # scattered physical pages, logical order
    hidden = []
    for start in (0, 5, 10):  # chunks of 5, 5, 1 (the last padded to 5: padding writes go to the trash page)
        chunk = ids[start : min(start + 5, L)]
        n = len(chunk)
        tok = np.zeros((1, 5), np.int32)
        tok[0, :n] = chunk
        pos = np.arange(start, start + 5)[None]
        valid = np.arange(5)[None] < n
        h, pages = pa.paged_forward(
            model, tok, pos, jnp.asarray(valid), pages, table, ps, keys_transposed=keys_transposed
        )
        hidden.append(np.asarray(h[0, :n]))
    h_dec, pages = pa.paged_forward(
        model,
        ids[None, L : L + 1],
        np.asarray([[L]]),
        jnp.ones((1, 1), bool),
        pages,
        table,
        ps,
        keys_transposed=keys_transposed,
    )
    full = np.asarray(model.hidden_states(jnp.asarray(ids[None])))[0]
    np.testing.assert_allclose(np.concatenate(hidden + [np.asarray(h_dec[0])]), full, atol=2e-5)
    # the trash page absorbed the padding; nothing was written to pages outside the table
    for layer in pages:
        for p in (1, 3, 4, 6):
            assert not np.any(np.asarray(layer["k"][:, p]))


@pytest.mark.parametrize("keys_transposed", [False, True], ids=["keys-PxDh", "keys-DhxP"])
def test_long_prefill_runs_key_blocks_and_matches_full_forward(model, monkeypatch, keys_transposed):
    """A prefill whose gathered context exceeds 2 x PREFILL_KEY_BLOCK attends block by block (the online
    softmax); chunked prefill + decode still equal the model's full forward. The block is made small here so the
    tiny test context crosses it (the real 1024 is hit by long prompts only)."""
    calls = []
    blocked = pa.attn_lib.attention_kv_major_blocked
    monkeypatch.setattr(pa, "PREFILL_KEY_BLOCK", 4)
    monkeypatch.setattr(pa.attn_lib, "attention_kv_major_blocked", lambda *a, **k: calls.append(k) or blocked(*a, **k))
    test_chunked_paged_prefill_and_decode_match_full_forward(model, keys_transposed)
    assert calls and all(k["block"] == 4 for k in calls)  # the 16-key gathered context crossed 2 blocks


def _decode_case(num_heads: int, num_kv_heads: int, seed: int = 0, head_dim: int = 128, page_size: int = 16):
    """A bfloat16 pool of scattered pages, ragged lengths (1 token, a partial page, exactly full pages, the whole
    table), a trash-page-padded table; q in float32 [B, 1, H, Dh]."""
    rng = np.random.default_rng(seed)
    n_pages, width = 20, 4
    shape = pa.pool_shape(n_pages, page_size, num_kv_heads, head_dim)
    kp = jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
    vp = jnp.asarray(rng.normal(size=shape), jnp.bfloat16)
    lengths = np.asarray([1, 21, 2 * page_size, width * page_size])
    perm = rng.permutation(np.arange(1, n_pages))
    table = np.zeros((4, width), np.int32)
    used = 0
    for b, n in enumerate(lengths):
        m = -(-n // page_size)
        table[b, :m] = perm[used : used + m]
        used += m
    q = jnp.asarray(rng.normal(size=(4, 1, num_heads, head_dim)), jnp.float32)
    return q, kp, vp, jnp.asarray(table), jnp.asarray(lengths[:, None] - 1, jnp.int32)


@pytest.mark.parametrize(
    "num_heads, num_kv_heads", representative([(4, 2), (6, 2), (2, 2)]), ids=["gqa2x", "gqa3x", "mha"]
)
def test_pallas_decode_matches_gather(num_heads, num_kv_heads):
    """The TPU kernel (Pallas interpret mode on CPU) gives the gather path's decode attention to float tolerance:
    GQA with 2x and 3x as many q heads as kv heads, and MHA; ragged lengths over scattered pages."""
    q, kp, vp, table, pos = _decode_case(num_heads, num_kv_heads)
    ref = pa.paged_attention("xla", q, kp, vp, table, pos, attention="gather")
    out = jax.jit(lambda *a: pa.paged_attention("xla", *a, attention="pallas"))(q, kp, vp, table, pos)
    assert out.shape == ref.shape == q.shape and out.dtype == q.dtype
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=1e-5)
    # an independent reference: softmax over the row's first `length` gathered keys, in numpy float64
    k = np.moveaxis(np.asarray(pa.gather_pages(kp, table), np.float64), 0, 2)  # [B, S, K, Dh]
    v = np.moveaxis(np.asarray(pa.gather_pages(vp, table), np.float64), 0, 2)
    g = num_heads // num_kv_heads
    for b in range(q.shape[0]):
        n = int(pos[b, 0]) + 1
        for h in range(num_heads):
            logits = k[b, :n, h // g] @ np.asarray(q[b, 0, h], np.float64) / np.sqrt(q.shape[-1])
            p = np.exp(logits - logits.max())
            np.testing.assert_allclose(np.asarray(out[b, 0, h]), (p / p.sum()) @ v[b, :n, h // g], atol=2e-5)


def test_decode_attends_over_the_fewest_pages_that_hold_every_row():
    """The decode switch (over_live_pages) picks the smallest of width x {1/2, 5/8, 3/4, 7/8, 1} pages covering the
    longest row (max position + 1), and a decode step over a table wider than its rows need gives the numpy
    float64 softmax over exactly each row's keys, whichever branch runs (jitted: the branch is picked on device)."""
    assert pa.decode_page_widths(16) == [8, 10, 12, 14, 16]
    assert pa.decode_page_widths(4) == [2, 3, 4] and pa.decode_page_widths(1) == [1]
    picked = jax.jit(lambda pos: pa.over_live_pages(lambda m: jnp.float32(m), pos, 16, 4))
    for longest, m in [(1, 8), (32, 8), (33, 10), (40, 10), (41, 12), (56, 14), (57, 16), (64, 16)]:
        assert int(picked(jnp.asarray([[0], [longest - 1]]))) == m, longest
    assert (
        int(pa.over_live_pages(lambda m: jnp.float32(m), jnp.zeros((2, 1), jnp.int32), 16, 4, batch_axes=("data",)))
        == 16
    )  # one width inside the data-shard vmap
    rng = np.random.default_rng(5)
    ps, width, n_pages = 4, 16, 40
    kp, vp = (jnp.asarray(rng.normal(size=pa.pool_shape(n_pages, ps, 2, 8)), jnp.float32) for _ in range(2))
    table = jnp.asarray(rng.permutation(np.arange(1, n_pages))[: 2 * width].reshape(2, width))
    attend = jax.jit(lambda q, pos: pa.paged_attention("xla", q, kp, vp, table, pos))
    k = np.moveaxis(np.asarray(pa.gather_pages(kp, table), np.float64), 0, 2)  # [B, S, K, Dh]
    v = np.moveaxis(np.asarray(pa.gather_pages(vp, table), np.float64), 0, 2)
    for lengths in ([3, 17], [30, 33], [50, 41], [64, 2]):  # branches 8, 10, 12 (+ a short row) and 16 pages
        q = jnp.asarray(rng.normal(size=(2, 1, 4, 8)), jnp.float32)
        out = np.asarray(attend(q, jnp.asarray(lengths, jnp.int32)[:, None] - 1))
        for b, n in enumerate(lengths):
            for h in range(4):
                logits = k[b, :n, h // 2] @ np.asarray(q[b, 0, h], np.float64) / np.sqrt(8)
                p = np.exp(logits - logits.max())
                np.testing.assert_allclose(out[b, 0, h], (p / p.sum()) @ v[b, :n, h // 2], atol=1e-5)


@pytest.mark.parametrize("tensor", [2, 4])
def test_pallas_decode_on_a_tensor_mesh_matches_gather(tensor):
    """Under a mesh the kernel runs under shard_map: over tensor=2 each device on its kv head and its q heads; over
    tensor=4, which does not divide the 2 kv heads, the pool and the heads are replicated (as the pool's layout
    is). Same output as the gather path."""
    q, kp, vp, table, pos = _decode_case(6, 2, seed=1)
    mesh = make_mesh({"data": 1, "tensor": tensor}, devices=jax.devices()[:tensor])
    ref = pa.paged_attention("xla", q, kp, vp, table, pos, attention="gather")
    with program_context(mesh):
        out = jax.jit(lambda *a: pa.paged_attention("xla", *a, attention="pallas"))(q, kp, vp, table, pos)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=1e-5)


def test_pallas_decode_under_vmap_over_data_shards_matches_gather():
    """The engine's data-shard vmap (spmd_axis_name = the batch axes) of the kernel: one shard_map over data=2 x
    tensor=2, each device on its shard's pool; same output as the gather path per shard."""
    cases = [_decode_case(4, 2, seed=s) for s in (2, 3)]
    q, kp, vp, table, pos = (jnp.stack(xs) for xs in zip(*cases))
    mesh = make_mesh({"data": 2, "tensor": 2}, devices=jax.devices()[:4])

    def attend(attention):
        f = jax.vmap(
            lambda *a: pa.paged_attention("xla", *a, attention=attention, batch_axes=("data",)),
            spmd_axis_name=("data",),
        )
        return jax.jit(f)(q, kp, vp, table, pos)

    ref = attend("gather")
    with program_context(mesh, {"batch": None, "act_heads": "tensor"}):
        out = attend("pallas")
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=2e-5, rtol=1e-5)


def test_pallas_decode_rejects_prefill_and_resolve_attention():
    q, kp, vp, table, pos = _decode_case(4, 2)
    with pytest.raises(ValueError, match="one token per row"):
        pa.pallas_decode_attention(jnp.concatenate([q, q], axis=1), kp, vp, table, jnp.concatenate([pos, pos], 1))
    # prefill (T > 1) with attention=pallas gathers
    q2, p2 = jnp.concatenate([q, q], axis=1), jnp.concatenate([pos - 1, pos], axis=1)
    np.testing.assert_array_equal(
        pa.paged_attention("xla", q2, kp, vp, table, p2, attention="pallas"),
        pa.paged_attention("xla", q2, kp, vp, table, p2, attention="gather"),
    )
    auto = dict(platform="tpu", head_dim=128, cache_dtype="bfloat16")
    assert pa.resolve_attention("auto", **auto) == "pallas"
    assert pa.resolve_attention("auto", **{**auto, "platform": "cpu"}) == "gather"
    assert pa.resolve_attention("auto", **{**auto, "head_dim": 64}) == "gather"
    assert pa.resolve_attention("auto", **{**auto, "cache_dtype": "float32"}) == "gather"
    assert pa.resolve_attention("pallas", **{**auto, "platform": "cpu"}) == "pallas"
    assert pa.resolve_attention("gather", **auto) == "gather"
    with pytest.raises(ValueError, match="sampling.engine.attention='flash'"):
        pa.resolve_attention("flash", **auto)
