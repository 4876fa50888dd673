"""Shared test data for the train-step tests (single process and multi-process workers)."""

import numpy as np

from stare_jax.models import ModelConfig

# the train-step tests' model: one layer, 96 tokens, large init so the log-probs and entropies vary
TINY_STEP_MODEL = ModelConfig(
    vocab_size=96,
    hidden_size=32,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=64,
    tie_word_embeddings=True,
    initializer_range=0.3,
    max_position_embeddings=64,
)


def random_train_batch(vocab_size: int, B: int, L: int, seed: int = 0) -> dict:
    """A left-padded prompt+response batch with GRPO-normalised advantages over groups of 4 (each group has at
    least one correct and one wrong response, so every advantage is nonzero)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab_size, (B, L)).astype(np.int32)
    attn = np.ones((B, L), np.int32)
    resp = np.zeros((B, L), np.int32)
    plen = rng.integers(3, 9, size=B)
    rlen = rng.integers(4, L - 8, size=B)
    for i in range(B):
        pad = L - plen[i] - rlen[i]
        attn[i, :pad] = 0  # left padding
        resp[i, pad + plen[i] :] = 1
    acc = rng.integers(0, 2, size=(B // 4, 4)).astype(np.float32)
    acc[:, 0], acc[:, 1] = 1, 0
    adv = ((acc - acc.mean(1, keepdims=True)) / (acc.std(1, ddof=1, keepdims=True) + 1e-6)).reshape(-1)
    return dict(input_ids_BxT=ids, attention_mask_BxT=attn, response_mask_BxT=resp, advantages_B=adv.astype(np.float32))


def np_agg(tok, mask, mode):
    """NumPy re-derivation of the four loss aggregation modes, per sequence (rows without valid tokens skipped)."""
    v = mask > 0
    rows = [i for i in range(len(tok)) if v[i].any()]
    if mode == "token-mean":
        return sum(tok[i][v[i]].sum() for i in rows) / max(v.sum(), 1)
    if mode == "seq-mean-token-sum":
        return np.mean([tok[i][v[i]].sum() for i in rows]) if rows else 0.0
    if mode == "seq-mean-token-mean":
        return np.mean([tok[i][v[i]].mean() for i in rows]) if rows else 0.0
    return sum(tok[i][v[i]].sum() for i in rows) / tok.shape[1]
