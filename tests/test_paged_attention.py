"""Paged forward == the model's full forward: prefill a sequence in chunks into scattered pages, then decode one
token, and compare hidden states / logits with Transformer.__call__ on the whole sequence."""
from __future__ import annotations

import numpy as np
import pytest

import jax.numpy as jnp

from stare_jax.models import ModelConfig, init_model
from stare_jax.models import paged_attention as pa


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig(vocab_size=128, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                      intermediate_size=64, max_position_embeddings=64, qkv_bias=True, initializer_range=0.1)
    return init_model(cfg, seed=1)


def test_gather_and_write_layout():
    pages = jnp.zeros((5, 2, 1, 1))
    page, off = pa.write_slots(jnp.asarray([[3, 1, 0]]), jnp.asarray([[0, 1, 2, 3]]), jnp.asarray([[1, 1, 1, 0]]) > 0,
                               2)
    np.testing.assert_array_equal(page, [[3, 3, 1, 0]])  # the invalid token goes to the trash page
    np.testing.assert_array_equal(off, [[0, 1, 0, 1]])
    pages = pa.write_pages(pages, jnp.arange(1.0, 5.0).reshape(1, 4, 1, 1), page, off)
    seq = pa.gather_pages(pages, jnp.asarray([[3, 1]]))[0, :, 0, 0]
    np.testing.assert_array_equal(seq, [1, 2, 3, 0])


def test_chunked_paged_prefill_and_decode_match_full_forward(model):
    cfg = model.config
    ps, L = 4, 11
    ids = np.random.default_rng(0).integers(1, cfg.vocab_size, size=L + 1)
    pages = pa.init_pages(cfg.num_layers, 9, ps, cfg.num_kv_heads, cfg.head_dim)
    table = jnp.asarray([[7, 2, 5, 8]])  # scattered physical pages, logical order
    hidden = []
    for start in (0, 5, 10):  # chunks of 5, 5, 1 (the last padded to 5: padding writes go to the trash page)
        chunk = ids[start:min(start + 5, L)]
        n = len(chunk)
        tok = np.zeros((1, 5), np.int32)
        tok[0, :n] = chunk
        pos = np.arange(start, start + 5)[None]
        valid = np.arange(5)[None] < n
        h, pages = pa.paged_forward(model, tok, pos, jnp.asarray(valid), pages, table, ps)
        hidden.append(np.asarray(h[0, :n]))
    h_dec, pages = pa.paged_forward(model, ids[None, L:L + 1], np.asarray([[L]]), jnp.ones((1, 1), bool), pages,
                                    table, ps)
    full = np.asarray(model.hidden_states(jnp.asarray(ids[None])))[0]
    np.testing.assert_allclose(np.concatenate(hidden + [np.asarray(h_dec[0])]), full, atol=2e-5)
    # the trash page absorbed the padding; nothing was written to pages outside the table
    for layer in pages:
        for p in (1, 3, 4, 6):
            assert not np.any(np.asarray(layer["k"][p]))
