"""Shared by several tests: moved from tests/unit/training/test_sft_conversations.py (which imports them back)."""

from __future__ import annotations

import json
import pathlib

from stare_jax import models


def _call(code: str, as_string: bool = True) -> dict:
    args = {"code": code}
    return {
        "id": "c",
        "type": "function",
        "function": {"name": "code_interpreter", "arguments": json.dumps(args) if as_string else args},
    }


CONVERSATIONS = [
    # ReTool-style: think, call the interpreter, read its output, answer
    [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is 12345 + 678?"},
        {"role": "assistant", "content": "Let me compute it.", "tool_calls": [_call("print(12345 + 678)")]},
        {"role": "tool", "content": "13023"},
        {"role": "assistant", "content": "The answer is 13023."},
    ],
    # no system message (the template's default one), a call with no text, two calls answered by two tool turns
    [
        {"role": "user", "content": "how many apples?"},
        {"role": "assistant", "content": None, "tool_calls": [_call("print(1)", False), _call("print(2)")]},
        {"role": "tool", "content": "1"},
        {"role": "tool", "content": "2"},
        {"role": "assistant", "content": "then 3 apples"},
        {"role": "user", "content": "and oranges?"},
        {"role": "assistant", "content": "don't know"},
    ],
    # plain chat, a trailing tool reply after the last call (context only)
    [
        {"role": "user", "content": "solve x=1"},
        {"role": "assistant", "content": "x is 1", "tool_calls": [_call("x = 1\nprint(x)")]},
        {"role": "tool", "content": "1\n"},
    ],
]


def _tiny_model(folder: pathlib.Path, vocab_size: int) -> None:
    cfg = models.ModelConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=64,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        qkv_bias=True,
        architecture="Qwen2ForCausalLM",
        tie_word_embeddings=True,
        initializer_range=0.05,
    )
    models.save_pretrained(models.init_model(cfg, seed=0), folder)
