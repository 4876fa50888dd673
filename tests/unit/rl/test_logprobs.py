"""Chunked log-prob / entropy pass == naive full-logits computation (values and gradients), theory outputs."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stare_jax.rl.logprobs import naive_logprobs_and_entropy, token_logprobs_and_entropy


def _inputs(seed=0, B=3, T=13, D=16, V=50):
    rng = np.random.default_rng(seed)
    h = rng.normal(size=(B, T, D)).astype(np.float32)
    w = (rng.normal(size=(V, D)) * 0.7).astype(np.float32)
    t = rng.integers(0, V, size=(B, T)).astype(np.int32)
    mask = (rng.uniform(size=(B, T)) < 0.8).astype(np.float32)
    t[mask == 0] = -1  # garbage labels on masked positions must be harmless
    return h, w, t, mask


def _np_ref(h, w, t, mask):
    z = h.astype(np.float64) @ w.astype(np.float64).T
    z = z - z.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    lp = np.take_along_axis(logp, np.clip(t, 0, None)[..., None], -1)[..., 0]
    ent = -(np.exp(logp) * logp).sum(-1)
    return lp * mask, ent * mask, logp


@pytest.mark.parametrize("chunk", [1, 4, 13, 64])
def test_values_match_numpy(chunk):
    h, w, t, mask = _inputs()
    lp, ent = token_logprobs_and_entropy(h, w, t, mask, chunk_size=chunk)
    rlp, rent, _ = _np_ref(h, w, t, mask)
    np.testing.assert_allclose(np.asarray(lp), rlp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ent), rent, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "chunk, vchunk, wdtype", [(5, None, jnp.float32), (4, 16, jnp.float32), (13, 10, jnp.float32), (3, 7, jnp.bfloat16)]
)
def test_gradients_match_naive(chunk, vchunk, wdtype):
    h, w, t, mask = _inputs(1)
    w = jnp.asarray(w, wdtype)
    rng = np.random.default_rng(2)
    a, b = rng.normal(size=mask.shape).astype(np.float32), rng.normal(size=mask.shape).astype(np.float32)

    def loss(fn, hh, ww):
        lp, ent = fn(hh, ww)
        return jnp.sum(lp * a) + jnp.sum(ent * b)

    def chunked(hh, ww):
        return token_logprobs_and_entropy(hh, ww, t, mask, chunk_size=chunk, vocab_chunk_size=vchunk)

    def naive(hh, ww):
        return naive_logprobs_and_entropy(hh, ww, t, mask)

    gc = jax.jit(jax.grad(lambda hh, ww: loss(chunked, hh, ww), argnums=(0, 1)))(h, w)
    gn = jax.grad(lambda hh, ww: loss(naive, hh, ww), argnums=(0, 1))(h, w)
    tol = 1e-5 if wdtype == jnp.float32 else 1e-2  # bf16 table: the gradient itself is rounded to bf16
    for x, y in zip(gc, gn):
        assert x.dtype == y.dtype
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=10 * tol, atol=tol)
    assert np.all(np.asarray(gc[0])[mask == 0] == 0)  # masked positions get no gradient


def test_bf16_hidden_is_computed_in_fp32():
    h, w, t, mask = _inputs(3)
    hb, wb = jnp.asarray(h, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    lp, _ = token_logprobs_and_entropy(hb, wb, t, mask, chunk_size=4)
    rlp, _, _ = _np_ref(np.asarray(hb.astype(jnp.float32)), np.asarray(wb.astype(jnp.float32)), t, mask)
    assert lp.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(lp), rlp, rtol=1e-5, atol=1e-4)


def test_theory_outputs():
    h, w, t, mask = _inputs(4)
    lp, ent, th = token_logprobs_and_entropy(h, w, t, mask, chunk_size=4, theory=True)
    rlp, rent, logp = _np_ref(h, w, t, mask)
    p = np.exp(logp)
    H = -(p * logp).sum(-1)
    S2 = (p * p * (logp + H[..., None])).sum(-1)
    pa = np.exp(np.take_along_axis(logp, np.clip(t, 0, None)[..., None], -1)[..., 0])
    phi_ref = (pa * (np.log(pa) + H) - S2) * mask
    np.testing.assert_allclose(np.asarray(th["phi"]), phi_ref, rtol=1e-4, atol=1e-5)
    ps = np.exp(-np.asarray(th["s_star"]))
    resid = (ps * (np.log(ps) + H) - S2)[mask > 0]
    np.testing.assert_allclose(resid, 0.0, atol=1e-5)


def test_bad_shapes():
    h, w, t, mask = _inputs()
    with pytest.raises(ValueError, match="unembed_VxD"):
        token_logprobs_and_entropy(h, w[:, :3], t, mask)
    with pytest.raises(ValueError, match="targets_BxT"):
        token_logprobs_and_entropy(h, w, t[:, :3], mask)


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")
@pytest.mark.parametrize("mesh_shape", [{"data": 2, "tensor": 4}, {"fsdp": 2, "tensor": 4}])
def test_vocab_split_backward_matches_naive_and_gathers_no_table(mesh_shape):
    """On a mesh that splits the vocab (tensor 4), the backward's vocab chunks stay inside each device's rows:
    gradients equal the naive full-logits ones, and the compiled program all-gathers nothing table-sized (chunks
    straddling shards made XLA gather the whole [V, D] table and the stacked d(unembed) every call)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from stare_jax.models.sharding import make_mesh, program_context

    B, T, D, V = 4, 12, 16, 96
    rng = np.random.default_rng(5)
    h = rng.normal(size=(B, T, D)).astype(np.float32)
    w = (rng.normal(size=(V, D)) * 0.7).astype(np.float32)
    t = rng.integers(0, V, size=(B, T)).astype(np.int32)
    mask = (rng.uniform(size=(B, T)) < 0.8).astype(np.float32)
    a, b = rng.normal(size=(B, T)).astype(np.float32), rng.normal(size=(B, T)).astype(np.float32)
    mesh = make_mesh(mesh_shape)
    batch_axes = tuple(ax for ax in ("data", "fsdp") if ax in mesh_shape)
    hs = jax.device_put(h, NamedSharding(mesh, P(batch_axes)))
    ws = jax.device_put(w, NamedSharding(mesh, P("tensor", "fsdp" if "fsdp" in mesh_shape else None)))

    def loss(hh, ww):  # vocab chunk 20 -> 5 rows per device per step, 24 rows per device: the last step pads
        lp, ent = token_logprobs_and_entropy(hh, ww, t, mask, chunk_size=4, vocab_chunk_size=20)
        return jnp.sum(lp * a) + jnp.sum(ent * b)

    def naive(hh, ww):
        lp, ent = naive_logprobs_and_entropy(hh, ww, t, mask)
        return jnp.sum(lp * a) + jnp.sum(ent * b)

    with program_context(mesh):
        grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
        hlo = grad.lower(hs, ws).compile().as_text()
        gc = grad(hs, ws)
    gn = jax.grad(naive, argnums=(0, 1))(h, w)
    for x, y in zip(gc, gn):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-5)
    gathered = [
        m
        for m in re.findall(r"= f32\[([\d,]+)\][^ ]* all-gather", hlo)
        if np.prod([int(d) for d in m.split(",")]) >= V * D // 2
    ]
    assert not gathered, f"table-sized all-gathers in the backward: {gathered}"
