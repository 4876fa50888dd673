"""The embedded toy's configuration and model architecture: plain data (no training code), so the planner and the
ahead-of-time compile can size a toy run without building it (stare_jax.toy.assets builds it)."""

from __future__ import annotations

import dataclasses
import hashlib
import json

from stare_jax import models

MAX_POSITIONS = 64  # the toy model's context: prompt + response (tool_mul: call, observation and answer)
TOOL_MUL_M_RANGE = (11, 99)  # tool_mul's multipliers (multiples of 10 left out by the task)


@dataclasses.dataclass(frozen=True)
class ToyAssetConfig:
    task: str = "digit_set"
    seed: int = 0
    num_train: int = 4000
    num_eval: int = 200
    k_min: int = 3
    k_max: int = 5
    eval_holdout_frac: float = 0.2
    set_size: int = 3
    sft_noise: float = 0.3
    sft_direct_frac: float = 0.0  # tool_mul: warm-start answers guessed without calling the tool
    vocab_size: int = 40
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    sft_steps: int = 150
    sft_batch_size: int = 64
    sft_lr: float = 3e-3

    def key(self) -> str:
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


def asset_config(run_toy) -> ToyAssetConfig:
    """The asset config named by a run config's `toy` section (it sets a subset of the fields; the rest keep
    their defaults)."""
    shared = {f.name for f in dataclasses.fields(ToyAssetConfig)} & {f.name for f in dataclasses.fields(run_toy)}
    return ToyAssetConfig(**{k: getattr(run_toy, k) for k in shared})


def model_config(cfg: ToyAssetConfig, **token_ids):
    """The toy's Qwen2-shaped ModelConfig (vocab_size and special token ids from its tokenizer when given)."""

    fields = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_layers,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=MAX_POSITIONS,
        rope_theta=10000.0,
        qkv_bias=True,
        architecture="Qwen2ForCausalLM",
        tie_word_embeddings=True,
        initializer_range=0.05,
    )
    return models.ModelConfig(**{**fields, **token_ids})
