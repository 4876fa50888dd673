"""stare_jax.models: Llama / Qwen2 / Qwen3 decoder in Flax NNX, HF safetensors import/export, sharding rules, LoRA."""

from stare_jax.models.config import LORA_TARGETS, PRESETS, SUPPORTED_ARCHITECTURES, ModelConfig, get_preset
from stare_jax.models.hf_io import from_pretrained, save_pretrained
from stare_jax.models.transformer import LoRAParam, Transformer, abstract_model, default_positions, init_model

__all__ = [
    "ModelConfig",
    "Transformer",
    "init_model",
    "abstract_model",
    "from_pretrained",
    "save_pretrained",
    "get_preset",
    "PRESETS",
    "SUPPORTED_ARCHITECTURES",
    "default_positions",
    "LoRAParam",
    "LORA_TARGETS",
]
