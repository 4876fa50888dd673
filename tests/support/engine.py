"""Shared by several tests: moved from tests/unit/sampling/test_engine.py (which imports them back)."""

from __future__ import annotations

import numpy as np

from stare_jax.models import ModelConfig, init_model

V = 256


PROMPTS = [[3, 14, 15, 92, 65, 35], [1, 2, 3], [4] * 9, [7], list(range(10, 30))]


EOS = list(range(100, 108))  # 8 of 256 ids: sampled rows end after geometric (long-tailed) lengths


def _tiny(family: str):
    """Tiny random Qwen2 (q/k/v bias, untied) or Qwen3 (q/k norm, tied) stare_jax model."""
    qwen3 = family == "qwen3"
    cfg = ModelConfig(
        vocab_size=V,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        max_position_embeddings=64,
        qkv_bias=not qwen3,
        qk_norm=qwen3,
        tie_word_embeddings=qwen3,
        initializer_range=0.1,
        eos_token_id=None,
        pad_token_id=0,
    )
    return init_model(cfg, seed=0)


def _assert_same(a, b):
    assert a.tokens == b.tokens
    assert a.finish_reasons == b.finish_reasons and a.lengths == b.lengths
    np.testing.assert_allclose(np.concatenate(a.logprobs), np.concatenate(b.logprobs), atol=1e-5)
