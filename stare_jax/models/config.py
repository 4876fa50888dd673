"""ModelConfig: one typed description of a Llama / Qwen2 / Qwen3 decoder, with HF config.json conversion.

The same dataclass drives random init, HF import/export, eval_shape sizing and the sampler's KV cache.
"""

from __future__ import annotations

import dataclasses
import json
import math
import typing
from typing import Any, Literal, Mapping

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
_MODEL_TYPE = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
# config.json's model_type (any JSON value, or absent) -> architecture, for configs without `architectures`
_ARCH_OF_MODEL_TYPE: dict[Any, str] = {t: a for a, t in _MODEL_TYPE.items()}
AttentionImpl = Literal["xla", "dot_product", "cudnn", "splash"]
RematPolicy = Literal["none", "full", "dots_saveable", "dots_with_no_batch_dims_saveable"]
ATTENTION_IMPLS: tuple[str, ...] = typing.get_args(AttentionImpl)
REMAT_POLICIES: tuple[str, ...] = typing.get_args(RematPolicy)
_DTYPES = ("float32", "bfloat16", "float16")
_ROPE_TYPES = ("default", "llama3", "linear")
# HF module names LoRA adapters can target (stare_jax.models.lora); ModelConfig.lora_targets picks among them.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and numerics of a decoder-only transformer.

    architecture: HF class name; "" means inferred (qk_norm -> Qwen3, qkv_bias -> Qwen2, else Llama).
    head_dim: None means hidden_size // num_heads.
    rope_scaling: None or a dict like HF's rope_scaling, e.g. {"rope_type": "llama3", "factor": 32.0,
      "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}.
    dtype: compute dtype (activations, matmul inputs); param_dtype: storage dtype of the master weights.
    attention_impl: "xla" (einsum reference), "dot_product" (jax.nn.dot_product_attention, XLA path),
      "cudnn" (the same with implementation="cudnn" on GPU in bf16/fp16, else the XLA path),
      "splash" (Pallas TPU splash/flash kernel for full-sequence passes and the cache_index=0 prefill;
      later decode steps use the "xla" math).
    remat_policy: "none", "full" (save nothing), "dots_saveable", "dots_with_no_batch_dims_saveable".
    scan_layers: store the layers stacked (leading "layers" axis) and run the full-sequence forward as one
      lax.scan (compile time independent of depth); decode_step still loops over layers (list KV cache).
    lora_rank: 0 (off) or the rank r of LoRA adapters on the projections named in lora_targets (HF names among
      LORA_TARGETS); each targeted projection computes x W + (lora_alpha / lora_rank) * (x A) B with float32
      adapters A, B (nnx.LoRAParam). Not config.json fields: HF export/import ignores them.
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    max_position_embeddings: int = 4096
    rope_scaling: Mapping[str, Any] | None = None
    dtype: str = "float32"
    param_dtype: str = "float32"
    attention_impl: str = "xla"
    remat_policy: str = "none"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    architecture: str = ""
    initializer_range: float = 0.02
    scan_layers: bool = False
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = ()

    def __post_init__(self):
        if self.head_dim is None:
            if self.num_heads and self.hidden_size % max(self.num_heads, 1) != 0:
                raise ValueError(
                    f"ModelConfig.head_dim is None and hidden_size={self.hidden_size} is not divisible by "
                    f"num_heads={self.num_heads}; give head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // max(self.num_heads, 1))
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        if self.rope_scaling is not None:
            object.__setattr__(self, "rope_scaling", _FrozenDict(self.rope_scaling))
        if not self.architecture:
            arch = "Qwen3ForCausalLM" if self.qk_norm else "Qwen2ForCausalLM" if self.qkv_bias else "LlamaForCausalLM"
            object.__setattr__(self, "architecture", arch)
        if isinstance(self.lora_targets, (list, tuple)):
            object.__setattr__(self, "lora_targets", tuple(self.lora_targets))
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise ValueError naming the offending field."""
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "intermediate_size",
            "head_dim",
            "max_position_embeddings",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"ModelConfig.{name} must be a positive int, got {v!r}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"ModelConfig.num_heads={self.num_heads} must be divisible by num_kv_heads={self.num_kv_heads}"
            )
        assert self.head_dim is not None  # the loop above raised unless it is a positive int
        if self.head_dim % 2 != 0:
            raise ValueError(f"ModelConfig.head_dim={self.head_dim} must be even (RoPE rotates pairs)")
        if not (self.rope_theta > 0 and math.isfinite(self.rope_theta)):
            raise ValueError(f"ModelConfig.rope_theta must be positive and finite, got {self.rope_theta!r}")
        if not (self.rms_norm_eps > 0):
            raise ValueError(f"ModelConfig.rms_norm_eps must be > 0, got {self.rms_norm_eps!r}")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in _DTYPES:
                raise ValueError(f"ModelConfig.{name}={getattr(self, name)!r} not in {_DTYPES}")
        if self.attention_impl not in ATTENTION_IMPLS:
            raise ValueError(f"ModelConfig.attention_impl={self.attention_impl!r} not in {ATTENTION_IMPLS}")
        if self.remat_policy not in REMAT_POLICIES:
            raise ValueError(f"ModelConfig.remat_policy={self.remat_policy!r} not in {REMAT_POLICIES}")
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"ModelConfig.architecture={self.architecture!r} is not supported; "
                f"supported: {list(SUPPORTED_ARCHITECTURES)}"
            )
        if self.rope_scaling is not None:
            rt = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if rt not in _ROPE_TYPES:
                raise ValueError(
                    f"ModelConfig.rope_scaling rope_type={rt!r} is not supported; supported: {list(_ROPE_TYPES)}"
                )
            if rt == "llama3":
                for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
                    if k not in self.rope_scaling:
                        raise ValueError(f"ModelConfig.rope_scaling (llama3) is missing {k!r}")
            if rt == "linear" and "factor" not in self.rope_scaling:
                raise ValueError("ModelConfig.rope_scaling (linear) is missing 'factor'")
        self._validate_lora()

    def _validate_lora(self) -> None:
        r, targets = self.lora_rank, self.lora_targets
        if not isinstance(r, int) or isinstance(r, bool) or r < 0:
            raise ValueError(f"ModelConfig.lora_rank must be an int >= 0 (0 = LoRA off), got {r!r}")
        if not isinstance(targets, tuple) or not all(isinstance(t, str) for t in targets):
            raise ValueError(
                f"ModelConfig.lora_targets must be a list of module names among {list(LORA_TARGETS)}, got {targets!r}"
            )
        unknown = [t for t in targets if t not in LORA_TARGETS]
        if unknown:
            raise ValueError(
                f"ModelConfig.lora_targets has unknown module name(s) {unknown}; allowed: {list(LORA_TARGETS)}"
            )
        if len(set(targets)) != len(targets):
            raise ValueError(f"ModelConfig.lora_targets={list(targets)} names a module twice")
        if r == 0 and targets:
            raise ValueError(
                f"ModelConfig.lora_rank must be a positive int when lora_targets is set "
                f"(lora_targets={list(targets)}), got {r!r}"
            )
        if r > 0 and not targets:
            raise ValueError(
                f"ModelConfig.lora_targets must name at least one of {list(LORA_TARGETS)} when lora_rank={r} > 0"
            )
        a = self.lora_alpha
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not (a > 0 and math.isfinite(a)):
            raise ValueError(f"ModelConfig.lora_alpha must be a positive finite number, got {a!r}")

    @property
    def lora_scale(self) -> float:
        """lora_alpha / lora_rank (PEFT's `scaling`), 0.0 with LoRA off."""
        return float(self.lora_alpha) / self.lora_rank if self.lora_rank else 0.0

    def num_lora_params(self) -> int:
        """Adapter parameter count (r * (in + out) per targeted projection per layer)."""
        assert self.head_dim is not None
        d, h, kv, dh, i = self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim, self.intermediate_size
        io = {
            "q_proj": (d, h * dh),
            "k_proj": (d, kv * dh),
            "v_proj": (d, kv * dh),
            "o_proj": (h * dh, d),
            "gate_proj": (d, i),
            "up_proj": (d, i),
            "down_proj": (i, d),
        }
        return self.num_layers * self.lora_rank * sum(sum(io[t]) for t in self.lora_targets)

    # ------------------------------------------------------------------ helpers
    @property
    def rope_type(self) -> str:
        if self.rope_scaling is None:
            return "default"
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))

    def replace(self, **kw) -> "ModelConfig":
        return dataclasses.replace(self, **kw)

    def num_params(self) -> int:
        """Exact parameter count (matches the HF model with the same config)."""
        assert self.head_dim is not None  # __post_init__ derives it from hidden_size // num_heads
        d, h, kv, dh, i, v = (
            self.hidden_size,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.intermediate_size,
            self.vocab_size,
        )
        attn = d * h * dh + 2 * d * kv * dh + h * dh * d
        if self.qkv_bias:
            attn += h * dh + 2 * kv * dh
        if self.qk_norm:
            attn += 2 * dh
        layer = attn + 3 * d * i + 2 * d
        emb = v * d * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * layer + emb + d

    # ------------------------------------------------------------------ HF conversion
    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any], **overrides) -> "ModelConfig":
        """Build from a HF config.json dict (transformers 4.x `rope_theta`/`rope_scaling` or 5.x `rope_parameters`)."""
        archs = hf.get("architectures") or []
        arch = archs[0] if archs else _ARCH_OF_MODEL_TYPE.get(hf.get("model_type"), None)
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"config.json field `architectures`={archs!r} (model_type={hf.get('model_type')!r}) is not "
                f"supported; supported architectures: {list(SUPPORTED_ARCHITECTURES)}"
            )
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config.json field `hidden_act`={act!r} is not supported (only 'silu')")
        if hf.get("mlp_bias"):
            raise ValueError("config.json field `mlp_bias`=true is not supported")
        if arch != "Qwen2ForCausalLM" and hf.get("attention_bias"):
            raise ValueError(
                f"config.json field `attention_bias`=true is not supported for {arch} (it adds an o_proj bias)"
            )
        if hf.get("use_sliding_window"):
            raise ValueError("config.json field `use_sliding_window`=true is not supported")
        if hf.get("pretraining_tp", 1) not in (1, None):
            pass  # only affects HF's slow path; numerically identical
        rope_params = dict(hf.get("rope_parameters") or {})
        rope_theta = rope_params.pop("rope_theta", None)
        if rope_theta is None:
            rope_theta = hf.get("rope_theta", 10000.0)
        scaling = hf.get("rope_scaling") or rope_params or None
        if scaling is not None:
            scaling = {k: v for k, v in dict(scaling).items() if k != "rope_theta"}
            rt = scaling.get("rope_type", scaling.get("type", "default"))
            if rt == "default":
                scaling = None
        n_heads = hf["num_attention_heads"]
        kw = dict(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=n_heads,
            num_kv_heads=hf.get("num_key_value_heads") or n_heads,
            intermediate_size=hf["intermediate_size"],
            head_dim=hf.get("head_dim") or hf["hidden_size"] // n_heads,
            rope_theta=float(rope_theta),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=(arch == "Qwen2ForCausalLM"),
            qk_norm=(arch == "Qwen3ForCausalLM"),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            rope_scaling=scaling,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
            architecture=arch,
            initializer_range=float(hf.get("initializer_range", 0.02)),
        )
        kw.update(overrides)
        return cls(**kw)

    def to_hf_config(self) -> dict:
        """HF config.json dict, readable by transformers 4.x (rope_theta/rope_scaling) and 5.x (rope_parameters)."""
        arch = self.architecture
        rope_parameters = {"rope_type": self.rope_type, "rope_theta": float(self.rope_theta)}
        if self.rope_scaling is not None:
            rope_parameters.update({k: v for k, v in self.rope_scaling.items() if k != "type"})
            rope_parameters["rope_type"] = self.rope_type
        eos = list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id
        out = {
            "architectures": [arch],
            "model_type": _MODEL_TYPE[arch],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": float(self.rope_theta),
            "rope_scaling": (dict(self.rope_scaling) if self.rope_scaling is not None else None),
            "rope_parameters": rope_parameters,
            "tie_word_embeddings": self.tie_word_embeddings,
            "initializer_range": self.initializer_range,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos,
            "pad_token_id": self.pad_token_id,
            "use_cache": True,
            "torch_dtype": self.param_dtype,
            "attention_dropout": 0.0,
        }
        if arch in ("LlamaForCausalLM", "Qwen3ForCausalLM"):
            out["attention_bias"] = False
        if arch == "LlamaForCausalLM":
            out["mlp_bias"] = False
        if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
            out["use_sliding_window"] = False
            out["sliding_window"] = None
        return out

    @classmethod
    def from_json_file(cls, path, **overrides) -> "ModelConfig":
        with open(path) as f:
            return cls.from_hf_config(json.load(f), **overrides)


class _FrozenDict(dict):
    """A hashable, read-only dict so ModelConfig stays hashable (usable as a jit static arg)."""

    def __hash__(self):
        return hash(tuple(sorted(self.items())))

    def _ro(self, *a, **k):
        raise TypeError("ModelConfig.rope_scaling is read-only")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = _ro


_QWEN_EOS = 151643
PRESETS: dict[str, ModelConfig] = {}


def _preset(name, **kw):
    PRESETS[name] = ModelConfig(**kw)


# Shapes from the public config.json of each base checkpoint.
_preset(
    "qwen2.5-7b",
    vocab_size=152064,
    hidden_size=3584,
    num_layers=28,
    num_heads=28,
    num_kv_heads=4,
    intermediate_size=18944,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    qkv_bias=True,
    max_position_embeddings=131072,
    bos_token_id=151643,
    eos_token_id=151643,
)
_preset(
    "qwen2.5-math-7b",
    vocab_size=152064,
    hidden_size=3584,
    num_layers=28,
    num_heads=28,
    num_kv_heads=4,
    intermediate_size=18944,
    rope_theta=1e4,
    rms_norm_eps=1e-6,
    qkv_bias=True,
    max_position_embeddings=4096,
    bos_token_id=151643,
    eos_token_id=151643,
)
_preset(
    "qwen2.5-14b",
    vocab_size=152064,
    hidden_size=5120,
    num_layers=48,
    num_heads=40,
    num_kv_heads=8,
    intermediate_size=13824,
    rope_theta=1e6,
    rms_norm_eps=1e-5,
    qkv_bias=True,
    max_position_embeddings=131072,
    bos_token_id=151643,
    eos_token_id=151643,
)
_preset(
    "qwen2.5-32b",
    vocab_size=152064,
    hidden_size=5120,
    num_layers=64,
    num_heads=40,
    num_kv_heads=8,
    intermediate_size=27648,
    rope_theta=1e6,
    rms_norm_eps=1e-5,
    qkv_bias=True,
    max_position_embeddings=131072,
    bos_token_id=151643,
    eos_token_id=151643,
)
_preset(
    "qwen3-8b",
    vocab_size=151936,
    hidden_size=4096,
    num_layers=36,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    intermediate_size=12288,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    qk_norm=True,
    max_position_embeddings=40960,
    bos_token_id=151643,
    eos_token_id=151645,
)
_preset(
    "r1-distill-qwen-1.5b",
    vocab_size=151936,
    hidden_size=1536,
    num_layers=28,
    num_heads=12,
    num_kv_heads=2,
    intermediate_size=8960,
    rope_theta=1e4,
    rms_norm_eps=1e-6,
    qkv_bias=True,
    max_position_embeddings=131072,
    bos_token_id=151646,
    eos_token_id=151643,
)
_preset(
    "llama-3.2-1b",
    vocab_size=128256,
    hidden_size=2048,
    num_layers=16,
    num_heads=32,
    num_kv_heads=8,
    head_dim=64,
    intermediate_size=8192,
    rope_theta=5e5,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    max_position_embeddings=131072,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    bos_token_id=128000,
    eos_token_id=128001,
)


def get_preset(name: str, **overrides) -> ModelConfig:
    """A full-size preset by name (e.g. "qwen2.5-7b"), with optional field overrides (dtype=..., ...)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name].replace(**overrides) if overrides else PRESETS[name]
