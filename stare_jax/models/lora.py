"""LoRA adapters for the decoder: variable type, trainable/frozen filters, PEFT export, merging.

ModelConfig(lora_rank=r, lora_alpha=alpha, lora_targets=("q_proj", ...)) gives each targeted projection float32
adapters lora_a [in axes..., r] and lora_b [r, out axes...] (nnx.LoRAParam, a subclass of nnx.Param) sharded like
its kernel; the forward adds (alpha / r) * (x A) B (transformer.Linear.__call__). PEFT's default init: A
kaiming-uniform (bound 1 / sqrt(fan_in)), B = 0, so a fresh adapter leaves the model unchanged.

Why our own module and not qwix (google/qwix 0.1.8, qwix/_src/providers/lora.py): qwix's LoraProvider intercepts
einsum/dot_general and finds the weight by looking the rhs operand up among the nnx.Params of the *calling* module's
__dict__, creating the adapters in that param's dtype; on our Transformer (whose kernels sit on child Linear modules
and are cast with .astype before the einsum) apply_lora_to_model with module_path=".*" added adapters to lm_head only
(found by the shape heuristic in Transformer.logits_from_hidden) and to none of the seven projections, and on a
module owning a bfloat16 kernel it made bfloat16 lora_a/lora_b (measured with qwix 0.1.8, flax 0.12.8).

Train step (the base frozen, only adapters trained):
    graphdef, lora, base, rest = nnx.split(model, LoRAParam, nnx.Param, ...)   # filter order matters
    # or: nnx.Optimizer(model, tx, wrt=LoRAParam); grads w.r.t. nnx.DiffState(0, LoRAParam)
Export: write_peft_adapter(model, out_dir, base_model_name_or_path) (PEFT folder: adapter_config.json +
adapter_model.safetensors), hf_io.save_pretrained(model, dir, merged=True) (HF folder, W + scale * A B), or
merge_lora(model) (a LoRA-free copy of the model with merged kernels). This module imports models.hf_io, which
sampling/rewards/tasks may not: they find LoRAParam and BASE_PARAMS in stare_jax.models.transformer.
Import: read_peft_adapter(model, folder), the inverse of the export (a PEFT folder's adapters into the model, e.g. an
SFT adapter a run starts from; PeftAdapterError names the file, tensor or setting that does not fit).
"""

from __future__ import annotations

import json
import pathlib
from struct import error as struct_error
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from stare_jax.models import hf_io
from stare_jax.models.config import LORA_TARGETS, ModelConfig
from stare_jax.models.transformer import BASE_PARAMS, LoRAParam, Transformer, init_lora_state

__all__ = [
    "LoRAParam",
    "LORA_TARGETS",
    "TRAINABLE",
    "FROZEN",
    "split_lora",
    "lora_param_count",
    "init_lora_state",
    "peft_adapter_state_dict",
    "write_peft_adapter",
    "PeftAdapterError",
    "read_adapter_config",
    "check_adapter_config",
    "read_peft_adapter",
    "merge_lora",
]

TRAINABLE = LoRAParam  # nnx filter: the adapters
FROZEN = BASE_PARAMS  # nnx filter: every other nnx.Param (the base weights)

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_MODULE_GROUP = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


def split_lora(model: Transformer):
    """(graphdef, adapters, base params, rest): nnx.split(model, LoRAParam, nnx.Param, ...). Train the adapters,
    keep the base frozen; nnx.merge(graphdef, adapters, base, rest) rebuilds the model."""
    return nnx.split(model, LoRAParam, nnx.Param, ...)


def lora_param_count(model: Transformer) -> int:
    """Number of adapter scalars in the model (ModelConfig.num_lora_params())."""
    return sum(int(np.prod(v.get_value().shape)) for _, v in nnx.to_flat_state(nnx.state(model, LoRAParam)))


def _adapters(model: Transformer) -> Iterator[tuple[int, str, jax.Array, jax.Array]]:
    """(layer index, HF module name, A [in..., r], B [r, out...]) per layer and targeted projection, in HF order
    (only the adapters are read: stacked ones are sliced per layer, base weights are not touched)."""
    cfg = model.config
    flat = {tuple(str(x) for x in p): v.get_value() for p, v in nnx.to_flat_state(nnx.state(model, LoRAParam))}
    for i in range(cfg.num_layers if cfg.lora_rank else 0):
        for name in LORA_TARGETS:
            if name not in cfg.lora_targets:
                continue
            if cfg.scan_layers:
                key: tuple[str, ...] = ("layers", _MODULE_GROUP[name], name)
                yield i, name, flat[key + ("lora_a",)][i], flat[key + ("lora_b",)][i]
            else:
                key = ("layers", str(i), _MODULE_GROUP[name], name)
                yield i, name, flat[key + ("lora_a",)], flat[key + ("lora_b",)]


def peft_adapter_state_dict(model: Transformer) -> dict[str, np.ndarray]:
    """The adapters with PEFT's names and layout (what peft.get_peft_model_state_dict returns for a
    LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM): float32
    `base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_A.weight` [r, in_features] and
    `....lora_B.weight` [out_features, r] (features flattened as in the HF weights: heads-major). Gathered to host."""
    out: dict[str, np.ndarray] = {}
    r = model.config.lora_rank
    for i, name, a, b in _adapters(model):
        prefix = f"base_model.model.model.layers.{i}.{_MODULE_GROUP[name]}.{name}."
        a_np = hf_io._to_host(a).astype(np.float32)
        b_np = hf_io._to_host(b).astype(np.float32)
        out[prefix + "lora_A.weight"] = np.ascontiguousarray(a_np.reshape(-1, r).T)
        out[prefix + "lora_B.weight"] = np.ascontiguousarray(b_np.reshape(r, -1).T)
    return out


def adapter_config(cfg: ModelConfig, base_model_name_or_path: str | None) -> dict:
    """PEFT adapter_config.json for cfg's LoRA settings (LoraConfig fields; unset ones take PEFT's defaults)."""
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": cfg.lora_rank,
        "lora_alpha": cfg.lora_alpha,
        "target_modules": [t for t in LORA_TARGETS if t in cfg.lora_targets],
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": None,
    }


def write_peft_adapter(model: Transformer, out_dir, base_model_name_or_path: str | None = None) -> pathlib.Path:
    """Write a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors) that
    peft.PeftModel.from_pretrained(<the base transformers model>, out_dir) loads. Every process must call it
    (gathers sharded adapters); process 0 writes."""
    cfg = model.config
    if cfg.lora_rank == 0:
        raise ValueError("write_peft_adapter: the model has no LoRA adapters (ModelConfig.lora_rank=0)")
    tensors = peft_adapter_state_dict(model)  # collective
    folder = pathlib.Path(out_dir)
    if jax.process_index() != 0:
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    hf_io._write_safetensors(folder / ADAPTER_WEIGHTS, tensors)
    conf = adapter_config(cfg, base_model_name_or_path)
    (folder / ADAPTER_CONFIG).write_text(json.dumps(conf, indent=2))
    return folder


class PeftAdapterError(ValueError):
    """A PEFT adapter folder that does not fit the model (a missing file or tensor, an unexpected tensor, a shape,
    rank, alpha or target that differs, a PEFT feature we do not implement); the message is one line."""


# adapter_config.json settings we do not implement, with the value that means "off" (absent keys count as off)
_UNSUPPORTED = {
    "use_dora": False,
    "use_rslora": False,
    "fan_in_fan_out": False,
    "bias": "none",
    "lora_bias": False,
    "rank_pattern": {},
    "alpha_pattern": {},
    "layers_to_transform": None,
    "layer_replication": None,
    "modules_to_save": None,
    "target_parameters": None,
}


def read_adapter_config(folder) -> dict:
    """adapter_config.json of a PEFT folder (PeftAdapterError when the folder or the file is missing, or it is not
    a LoRA adapter)."""
    folder = pathlib.Path(folder)
    path = folder / ADAPTER_CONFIG
    if not path.is_file():
        what = "no such folder" if not folder.is_dir() else f"no {ADAPTER_CONFIG} there"
        raise PeftAdapterError(f"{folder} is not a PEFT adapter folder ({what})")
    try:
        conf = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise PeftAdapterError(f"{path} is not readable JSON: {e}") from None
    if not isinstance(conf, dict) or conf.get("peft_type", "LORA") != "LORA":
        kind = conf.get("peft_type") if isinstance(conf, dict) else type(conf).__name__
        raise PeftAdapterError(f"{path}: peft_type {kind!r} is not a LoRA adapter (peft_type 'LORA')")
    return conf


def check_adapter_config(conf: dict, cfg: ModelConfig, where: str = "adapter_config.json", names=None) -> None:
    """PeftAdapterError unless the PEFT config `conf` has cfg's rank, alpha and target modules and no setting we do
    not implement (DoRA, rsLoRA, per-module ranks, ...). `names`: the setting each of (lora_rank, lora_alpha,
    lora_targets) comes from, for the message (default ModelConfig's field names)."""
    rank_key, alpha_key, targets_key = names or (
        "ModelConfig.lora_rank",
        "ModelConfig.lora_alpha",
        "ModelConfig.lora_targets",
    )
    targets = conf.get("target_modules")
    if isinstance(targets, str):
        raise PeftAdapterError(
            f"{where}: target_modules is the pattern {targets!r}; only a list of module names is read "
            f"(any of {', '.join(LORA_TARGETS)})"
        )
    if conf.get("r") != cfg.lora_rank:
        raise PeftAdapterError(
            f"{where} has r = {conf.get('r')!r} but {rank_key} = {cfg.lora_rank}: set {rank_key}={conf.get('r')}"
        )
    alpha = conf.get("lora_alpha")
    if not isinstance(alpha, (int, float)) or float(alpha) != float(cfg.lora_alpha):
        raise PeftAdapterError(
            f"{where} has lora_alpha = {alpha!r} but {alpha_key} = {cfg.lora_alpha:g}: set {alpha_key}={alpha}"
        )
    if not isinstance(targets, (list, tuple)) or set(targets) != set(cfg.lora_targets):

        def names_of(ts) -> str:
            ts = list(ts) if isinstance(ts, (list, tuple)) else []
            return "[" + ",".join(sorted(map(str, ts), key=lambda t: (LORA_TARGETS + (t,)).index(t))) + "]"

        theirs = names_of(targets) if isinstance(targets, (list, tuple)) else repr(targets)
        raise PeftAdapterError(
            f"{where} has target_modules = {theirs} but {targets_key} = {names_of(cfg.lora_targets)}: "
            f"set {targets_key}={theirs}"
        )
    for key, off in _UNSUPPORTED.items():
        value = conf.get(key, off)
        if value != off and not (off is None and value in ([], {})):
            raise PeftAdapterError(
                f"{where} sets {key} = {json.dumps(value)}, which stare_jax's LoRA does not implement"
            )


def _peft_key(i: int, name: str, kind: str) -> str:
    return (
        f"base_model.model.model.layers.{i}.{_MODULE_GROUP[name]}.{name}.lora_{'A' if kind == 'lora_a' else 'B'}.weight"
    )


def _peft_shape(kind: str, shape: tuple, r: int) -> tuple[int, int]:
    """PEFT's shape of one layer's adapter of our `shape`: A [in..., r] -> [r, in], B [r, out...] -> [out, r]."""
    return (r, int(np.prod(shape[:-1]))) if kind == "lora_a" else (int(np.prod(shape[1:])), r)


def read_peft_adapter(model: Transformer, folder, names=None) -> Transformer:
    """Put the adapters of a PEFT LoRA folder (adapter_config.json + adapter_model.safetensors, as
    peft's save_pretrained or write_peft_adapter writes it) into `model`, in place, and return it: the inverse of
    peft_adapter_state_dict (float32, each adapter in its current sharding; stacked under scan_layers).
    PeftAdapterError (one line) for a missing file or tensor, an unexpected tensor, a tensor of another shape (an
    adapter of another base model) or an adapter_config.json that differs from the model's LoRA settings (`names`:
    see check_adapter_config). Every process reads the whole file."""
    cfg = model.config
    if cfg.lora_rank == 0:
        raise ValueError("read_peft_adapter: the model has no LoRA adapters (ModelConfig.lora_rank=0)")
    folder = pathlib.Path(folder)
    conf = read_adapter_config(folder)
    check_adapter_config(conf, cfg, str(folder / ADAPTER_CONFIG), names)
    weights = folder / ADAPTER_WEIGHTS
    if not weights.is_file():
        old = (
            " (adapter_model.bin is not read: save it with safe_serialization=True)"
            if (folder / "adapter_model.bin").is_file()
            else ""
        )
        raise PeftAdapterError(f"no {ADAPTER_WEIGHTS} in {folder}{old}")
    try:
        st = hf_io._SafetensorsFile(weights)
    except (OSError, ValueError, struct_error) as e:
        raise PeftAdapterError(f"{weights} is not a readable safetensors file: {e}") from None
    r = cfg.lora_rank
    flat = list(nnx.to_flat_state(nnx.state(model, LoRAParam)))
    wanted: dict[str, tuple[int, int]] = {}
    for path, var in flat:
        kind, name = str(path[-1]), str(path[-2])
        shape = tuple(var.get_value().shape)
        layers = range(cfg.num_layers) if cfg.scan_layers else [int(str(path[1]))]
        for i in layers:
            wanted[_peft_key(i, name, kind)] = _peft_shape(kind, shape[1:] if cfg.scan_layers else shape, r)
    have = set(st.names())
    for key in sorted(have & set(wanted), key=_layer_order):
        if st.shape(key) != wanted[key]:
            raise PeftAdapterError(
                f"{weights}: tensor {key} has shape {list(st.shape(key))} but the model's adapter needs "
                f"{list(wanted[key])} (an adapter of another base model?)"
            )
    for what, keys, tail in (
        ("lacks", set(wanted) - have, "the model's adapters need"),
        ("has unexpected", have - set(wanted), "no adapter of the model takes"),
    ):
        if keys:
            first = sorted(keys, key=_layer_order)
            more = f" (and {len(first) - 1} more)" if len(first) > 1 else ""
            raise PeftAdapterError(f"{weights} {what} tensor {first[0]}{more}, which {tail}")

    def ours(i: int, name: str, kind: str, shape: tuple) -> np.ndarray:
        t = np.asarray(st.array(_peft_key(i, name, kind)), np.float32)
        return t.T.reshape(shape)

    new = []
    for path, var in flat:
        kind, name = str(path[-1]), str(path[-2])
        value = var.get_value()
        if cfg.scan_layers:
            host = np.stack([ours(i, name, kind, value.shape[1:]) for i in range(cfg.num_layers)])
        else:
            host = ours(int(str(path[1])), name, kind, value.shape)
        host = host.astype(value.dtype)
        new.append((path, var.replace(_put_like(host, value))))
    nnx.update(model, nnx.from_flat_state(new))
    return model


def _put_like(host: np.ndarray, like) -> jax.Array:
    """`host` (the same full array on every process) as a jax.Array in the sharding of `like`."""
    sharding = getattr(like, "sharding", None)
    if sharding is None:
        return jnp.asarray(host)

    def block(idx):
        return host[idx]

    return jax.make_array_from_callback(host.shape, sharding, block)


def _layer_order(key: str):
    """Sort PEFT keys by layer number, then name (layer 2 before layer 10)."""
    parts = key.split(".")
    return tuple(int(p) if p.isdigit() else 0 for p in parts), key


def _merge_one(w, a, b, scale: float, stacked: bool):
    def one(w, a, b):
        return (
            w.astype(jnp.float32) + scale * jnp.tensordot(a.astype(jnp.float32), b.astype(jnp.float32), axes=1)
        ).astype(w.dtype)

    return jax.vmap(one)(w, a, b) if stacked else one(w, a, b)


def merge_lora(model: Transformer) -> Transformer:
    """A copy of the model without adapters (lora_rank=0) whose targeted kernels are W + lora_alpha / lora_rank *
    A B (computed in float32 on device, kept in param dtype and in the kernel's sharding). The other parameters'
    arrays are shared with `model`, not copied (in new Variables: updating one model leaves the other alone)."""
    cfg = model.config
    plain = cfg.replace(lora_rank=0, lora_targets=())
    if cfg.lora_rank == 0:
        return model
    lora = dict(nnx.to_flat_state(nnx.state(model, LoRAParam)))
    out = []
    for path, var in nnx.to_flat_state(nnx.state(model, FROZEN)):
        if path[-1] == "kernel" and path[:-1] + ("lora_a",) in lora:
            a = lora[path[:-1] + ("lora_a",)].get_value()
            b = lora[path[:-1] + ("lora_b",)].get_value()
            w = var.get_value()
            stacked = cfg.scan_layers and str(path[0]) == "layers"
            merge = jax.jit(_merge_one, static_argnums=(3, 4), out_shardings=getattr(w, "sharding", None))
            var = var.replace(merge(w, a, b, cfg.lora_scale, stacked))
        else:
            var = var.replace(var.get_value())  # a new Variable over the same (immutable) array
        out.append((path, var))
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(plain, rngs=nnx.Rngs(0))))
    return nnx.merge(graphdef, nnx.from_flat_state(out))
