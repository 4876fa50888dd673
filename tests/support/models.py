"""Tiny random HF checkpoints (made with transformers, torch fp32) shared by the model tests.

Three families, each exercising a different feature: Qwen2 (q/k/v bias, GQA, untied embeddings),
Qwen3 (per-head q/k RMSNorm, tied embeddings), Llama (llama3 RoPE scaling, untied).
"""

from __future__ import annotations

import numpy as np

VOCAB = 256
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    initializer_range=0.1,
    num_key_value_heads=2,
    intermediate_size=128,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
)

FAMILIES = ("qwen2", "qwen3", "llama")


def make_hf_model(family: str, seed: int = 0):
    """A randomly initialised transformers model (fp32, eval mode) of the given family."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    if family == "qwen2":
        cfg = tf.Qwen2Config(**COMMON, tie_word_embeddings=False, rope_theta=10000.0)
        cls = tf.Qwen2ForCausalLM
    elif family == "qwen3":
        cfg = tf.Qwen3Config(**COMMON, head_dim=16, tie_word_embeddings=True, rope_theta=1e6)
        cls = tf.Qwen3ForCausalLM
    elif family == "llama":
        cfg = tf.LlamaConfig(
            **COMMON,
            tie_word_embeddings=False,
            rope_theta=5e5,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        )
        cls = tf.LlamaForCausalLM
    else:
        raise ValueError(family)
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = 1, 2, 0
    model = cls(cfg).to(torch.float32).eval()
    # Random (non-unit) norm weights and biases so a mix-up of any tensor shows in the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn_like(p))
    return model


def padded_batch(lengths, total_len, *, left: bool, seed: int = 0):
    """input_ids [B,T] int32 (pad id 0), attention_mask [B,T], positions [B,T] as HF generation would use."""
    rng = np.random.default_rng(seed)
    b = len(lengths)
    ids = np.zeros((b, total_len), np.int32)
    mask = np.zeros((b, total_len), np.int32)
    for i, n in enumerate(lengths):
        toks = rng.integers(3, VOCAB, size=n)
        if left:
            ids[i, total_len - n :], mask[i, total_len - n :] = toks, 1
        else:
            ids[i, :n], mask[i, :n] = toks, 1
    pos = np.maximum(np.cumsum(mask, axis=1) - 1, 0).astype(np.int32)
    return ids, mask, pos


def hf_logits(model, ids, mask, pos) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = model(
            input_ids=torch.as_tensor(ids, dtype=torch.long),
            attention_mask=torch.as_tensor(mask, dtype=torch.long),
            position_ids=torch.as_tensor(pos, dtype=torch.long),
        )
    return out.logits.float().numpy()
