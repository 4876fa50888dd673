"""Hugging Face checkpoint import/export (config.json + safetensors) for Llama / Qwen2 / Qwen3.

Import reads tensors through a zero-copy memory map of each .safetensors file. With a mesh, every parameter is
built with jax.make_array_from_callback so each device (and host) reads only the slice it owns: the full model
is never materialised on one host. HF linear weights are [out, in]; ours put heads on their own axis
(q: [D, H, Dh], o: [H, Dh, D]), so each tensor has a (reshape, transpose) view recipe below.

LoRA (ModelConfig.lora_rank > 0): from_pretrained loads the base weights and initialises the adapters from
`lora_seed`; save_pretrained writes the base weights only (merged=True: W + scale * A B instead), never adapter
tensors: those go to a PEFT folder (stare_jax.models.lora.write_peft_adapter).
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import struct

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from stare_jax.models.config import ModelConfig
from stare_jax.models.sharding import state_shardings
from stare_jax.models.transformer import BASE_PARAMS, LoRAParam, Transformer, init_lora_state

_ST_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
_ST_NAMES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}
_IGNORABLE_SUFFIXES = ("rotary_emb.inv_freq",)
_DTYPE_NAMES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


# ----------------------------------------------------------------------------- safetensors (numpy, memmap)
class _SafetensorsFile:
    """Minimal safetensors reader: header parse + np.memmap views (bf16 via ml_dtypes)."""

    def __init__(self, path: pathlib.Path):
        self.path = path
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        header.pop("__metadata__", None)
        self.header = header
        self.base = 8 + n

    def names(self) -> list[str]:
        return list(self.header)

    def shape(self, name) -> tuple:
        return tuple(self.header[name]["shape"])

    def array(self, name) -> np.ndarray:
        info = self.header[name]
        dt = info["dtype"]
        if dt not in _ST_DTYPES:
            raise ValueError(f"tensor {name!r} in {self.path} has unsupported safetensors dtype {dt!r}")
        start, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end == start:
            return np.zeros(shape, _ST_DTYPES[dt])
        return np.memmap(self.path, dtype=_ST_DTYPES[dt], mode="r", offset=self.base + start, shape=shape)


def _write_safetensors(path, tensors: dict[str, np.ndarray], metadata=None):
    header, offset, order = {}, 0, sorted(tensors)
    for name in order:
        a = tensors[name]
        nbytes = a.size * a.dtype.itemsize
        header[name] = {"dtype": _ST_NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header["__metadata__"] = metadata or {"format": "pt"}
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * (-len(hb) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for name in order:
            f.write(np.ascontiguousarray(tensors[name]).tobytes())


class _Checkpoint:
    """All tensors of a HF folder: model.safetensors, or sharded files listed in model.safetensors.index.json."""

    def __init__(self, folder: pathlib.Path):
        self.folder = folder
        index = folder / "model.safetensors.index.json"
        single = folder / "model.safetensors"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
            missing = [fn for fn in files if not (folder / fn).exists()]
            if missing:
                raise FileNotFoundError(f"{index} lists shard files that are not in {folder}: {missing}")
        elif single.exists():
            files = ["model.safetensors"]
        else:
            found = sorted(p.name for p in folder.glob("*.safetensors"))
            if not found:
                raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {folder}")
            files = found
        self.files = {fn: _SafetensorsFile(folder / fn) for fn in files}
        self.where = {}
        for fn, f in self.files.items():
            for name in f.names():
                self.where[name] = fn

    def has(self, name):
        return name in self.where

    def shape(self, name):
        return self.files[self.where[name]].shape(name)

    def array(self, name):
        return self.files[self.where[name]].array(name)


# ----------------------------------------------------------------------------- name / layout mapping
# kind -> (HF shape from our shape, reshape of HF tensor, permutation to our layout, grouping of reshaped axes)
def _recipe(kind: str, shape: tuple):
    if kind == "same":
        return shape, shape, tuple(range(len(shape))), [[i] for i in range(len(shape))]
    if kind == "T":  # HF [O, I] -> ours [I, O]
        i, o = shape
        return (o, i), (o, i), (1, 0), [[0], [1]]
    if kind == "in_heads":  # HF [H*Dh, D] -> ours [D, H, Dh]
        d, h, dh = shape
        return (h * dh, d), (h, dh, d), (2, 0, 1), [[0, 1], [2]]
    if kind == "heads":  # HF [H*Dh] -> ours [H, Dh]
        h, dh = shape
        return (h * dh,), (h, dh), (0, 1), [[0, 1]]
    if kind == "out_heads":  # HF [D, H*Dh] -> ours [H, Dh, D]
        h, dh, d = shape
        return (d, h * dh), (d, h, dh), (1, 2, 0), [[0], [1, 2]]
    raise AssertionError(kind)


def hf_name_and_kind(path: tuple) -> tuple[str, str]:
    """Our nnx state path -> (HF tensor name, layout kind)."""
    p = tuple(str(x) for x in path)
    if p[-1] in ("lora_a", "lora_b"):
        raise ValueError(
            f"LoRA adapter {'.'.join(p)} has no HF tensor name (adapters are exported as a PEFT "
            "folder: stare_jax.models.lora.write_peft_adapter)"
        )
    if p == ("embed_tokens",):
        return "model.embed_tokens.weight", "same"
    if p == ("lm_head",):
        return "lm_head.weight", "same"
    if p == ("norm", "weight"):
        return "model.norm.weight", "same"
    if p[0] == "layers":
        i, rest = p[1], p[2:]
        prefix = f"model.layers.{i}."
        if rest[-1] == "weight":  # norms
            return prefix + ".".join(rest), "same"
        mod, proj, leaf = rest
        name = f"{prefix}{mod}.{proj}.{'weight' if leaf == 'kernel' else 'bias'}"
        if mod == "mlp":
            return name, "T"
        if leaf == "bias":
            return name, "heads"
        return name, ("out_heads" if proj == "o_proj" else "in_heads")
    raise ValueError(f"no HF name for parameter path {'.'.join(p)}")


def _norm_slices(index, shape):
    return (
        tuple(slice(*s.indices(n)) if isinstance(s, slice) else slice(s, s + 1) for s, n in zip(index, shape))
        if index
        else tuple(slice(0, n) for n in shape)
    )


def _read_view(ckpt: _Checkpoint, name: str, kind: str, my_shape: tuple, index, np_dtype) -> np.ndarray:
    """Slice `index` (in our layout) of HF tensor `name`, reading only the rows/cols it needs."""
    hf_shape, r_shape, perm, groups = _recipe(kind, my_shape)
    my_sl = _norm_slices(index, my_shape)
    r_sl = [None] * len(r_shape)
    for i, s in enumerate(my_sl):
        r_sl[perm[i]] = s
    hf_sl, post = [], []
    for grp in groups:
        outer, inner = grp[0], grp[1:]
        inner_n = math.prod(r_shape[j] for j in inner)
        hf_sl.append(slice(r_sl[outer].start * inner_n, r_sl[outer].stop * inner_n))
        post.append(slice(None))
        post.extend(r_sl[j] for j in inner)
    arr = np.asarray(ckpt.array(name)[tuple(hf_sl)])
    sub_shape = []
    for grp in groups:
        sub_shape.append(r_sl[grp[0]].stop - r_sl[grp[0]].start)
        sub_shape.extend(r_shape[j] for j in grp[1:])
    arr = arr.reshape(sub_shape)[tuple(post)]
    return np.ascontiguousarray(arr.transpose(perm)).astype(np_dtype)


# ----------------------------------------------------------------------------- import
def _np_dtype(dt):
    return np.dtype(ml_dtypes.bfloat16) if jnp.dtype(dt) == jnp.bfloat16 else np.dtype(jnp.dtype(dt).name)


def _dtype_name(dt) -> str:
    if isinstance(dt, str):
        return dt
    return jnp.dtype(dt).name


def from_pretrained(
    path, *, dtype=jnp.float32, param_dtype=None, mesh=None, rules=None, lora_seed: int = 0, **config_overrides
) -> Transformer:
    """Load a HF Llama/Qwen2/Qwen3 folder (config.json + safetensors) into a Transformer.

    dtype: compute dtype; param_dtype: storage dtype (None -> float32 master weights). With `mesh`, each tensor
    is placed straight into its sharded layout per `rules` (default sharding.DEFAULT_RULES), reading only the
    slices local devices need. Extra keyword arguments override ModelConfig fields (attention_impl=...,
    remat_policy=..., lora_rank=..., lora_alpha=..., lora_targets=...). With lora_rank > 0 the LoRA adapters get
    PEFT's default init (A kaiming-uniform, B = 0, so the model starts equal to the checkpoint) from
    jax.random.key(lora_seed), sharded like their base layers."""
    folder = pathlib.Path(path)
    cfg_file = folder / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"no config.json in {folder}")
    cfg = ModelConfig.from_hf_config(
        json.loads(cfg_file.read_text()),
        dtype=_dtype_name(dtype),
        param_dtype=_dtype_name(param_dtype if param_dtype is not None else jnp.float32),
        **config_overrides,
    )
    ckpt = _Checkpoint(folder)

    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, abs_state = nnx.split(abstract)
    if mesh is not None:
        sh_flat = dict(nnx.to_flat_state(state_shardings(abs_state, mesh, rules)))
    np_dt = _np_dtype(cfg.param_dtype)

    # Validate names and shapes before reading any data.
    flat = list(nnx.to_flat_state(nnx.state(abstract, BASE_PARAMS)))
    plan, used = [], set()
    for p, var in flat:
        shape = tuple(var.get_value().shape)
        names, kind, layer_shape = _hf_entries(p, shape, cfg)
        hf_shape = _recipe(kind, layer_shape)[0]
        for name in names:
            if not ckpt.has(name):
                raise ValueError(
                    f"tensor {name!r} (for parameter {'.'.join(map(str, p))}) is missing from the "
                    f"checkpoint folder {folder}"
                )
            found = ckpt.shape(name)
            if tuple(found) != tuple(hf_shape):
                raise ValueError(
                    f"tensor {name!r} in {folder / ckpt.where[name]} has shape {tuple(found)}, "
                    f"expected {tuple(hf_shape)} from config.json"
                )
            used.add(name)
        plan.append((p, var, names, kind, shape, layer_shape))
    extra = sorted(
        n
        for n in ckpt.where
        if n not in used
        and not n.endswith(_IGNORABLE_SUFFIXES)
        and not (cfg.tie_word_embeddings and n == "lm_head.weight")
    )
    if extra:
        raise ValueError(
            f"unexpected tensors in {folder} (not used by {cfg.architecture}): "
            f"{extra[:10]}{' ...' if len(extra) > 10 else ''} ({len(extra)} in all)"
        )

    single = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    new_flat = []
    for p, var, names, kind, shape, layer_shape in plan:
        sharding = sh_flat[p].get_value() if mesh is not None else single
        memo: dict[tuple, np.ndarray] = {}  # replicas of one shard (e.g. over "data") read the file once

        def cb(index, names=names, kind=kind, shape=shape, layer_shape=layer_shape, memo=memo):
            sl = _norm_slices(index, shape)
            key = tuple((x.start, x.stop) for x in sl)
            if key not in memo:
                if len(names) == 1 and layer_shape == shape:
                    memo[key] = _read_view(ckpt, names[0], kind, shape, sl, np_dt)
                else:  # stacked layers: leading axis indexes HF layers
                    memo[key] = np.stack(
                        [
                            _read_view(ckpt, names[i], kind, layer_shape, sl[1:], np_dt)
                            for i in range(sl[0].start, sl[0].stop)
                        ]
                    )
            return memo[key]

        arr = jax.make_array_from_callback(shape, sharding, cb)
        new_flat.append((p, var.replace(arr)))
    if cfg.lora_rank > 0:
        new_flat.extend(nnx.to_flat_state(_init_lora(abstract, cfg, lora_seed, mesh, rules)))
    return nnx.merge(graphdef, nnx.from_flat_state(new_flat))


def _init_lora(abstract: Transformer, cfg: ModelConfig, seed: int, mesh, rules):
    """The adapters' state (PEFT default init from jax.random.key(seed)), on `mesh` per `rules` if given."""
    abs_lora = nnx.state(abstract, LoRAParam)

    def make():
        return init_lora_state(abs_lora, jax.random.key(seed), cfg)

    if mesh is None:
        return jax.jit(make)()
    return jax.jit(make, out_shardings=state_shardings(abs_lora, mesh, rules))()


def _is_stacked(path, cfg: ModelConfig) -> bool:
    return cfg.scan_layers and str(path[0]) == "layers"


def _hf_entries(path, shape, cfg: ModelConfig):
    """(HF names, layout kind, per-tensor shape): one name, or one per layer for stacked (scan) params."""
    if _is_stacked(path, cfg):
        names = [hf_name_and_kind(("layers", i) + tuple(path[1:]))[0] for i in range(cfg.num_layers)]
        return names, hf_name_and_kind(("layers", 0) + tuple(path[1:]))[1], tuple(shape[1:])
    name, kind = hf_name_and_kind(path)
    return [name], kind, tuple(shape)


# ----------------------------------------------------------------------------- export
def _to_host(x) -> np.ndarray:
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        x = multihost_utils.process_allgather(x, tiled=True)
    return np.asarray(jax.device_get(x))


# (HF name, our param path, variable, layer index or None)
_ExportItem = tuple[str, tuple, nnx.Variable, int | None]


def _export_plan(model: Transformer) -> list[_ExportItem]:
    """[(HF name, our param path, variable, layer index or None)] in a stable order (base weights only)."""
    out: list[_ExportItem] = []
    for p, var in nnx.to_flat_state(nnx.state(model, BASE_PARAMS)):
        names, _, _ = _hf_entries(p, var.get_value().shape, model.config)
        stacked = _is_stacked(p, model.config)
        out.extend((name, p, var, i if stacked else None) for i, name in enumerate(names))
    return out


# our kernel path -> (lora_a variable, lora_b variable, scale), for merged export
_LoraMap = dict[tuple, tuple[nnx.Variable, nnx.Variable, float]]


def _lora_map(model: Transformer) -> _LoraMap:
    flat = dict(nnx.to_flat_state(nnx.state(model, LoRAParam)))
    return {
        p[:-1] + ("kernel",): (var, flat[p[:-1] + ("lora_b",)], model.config.lora_scale)
        for p, var in flat.items()
        if p[-1] == "lora_a"
    }


def merged_kernel(w: np.ndarray, a: np.ndarray, b: np.ndarray, scale: float) -> np.ndarray:
    """W + scale * A B for one layer's kernel (our layout: A [in..., r], B [r, out...]), computed in float32 and
    returned in W's dtype."""
    delta = np.tensordot(np.asarray(a, np.float32), np.asarray(b, np.float32), axes=1)
    return (np.asarray(w, np.float32) + np.float32(scale) * delta).astype(w.dtype)


def _export_tensor(path, var, np_dt, layer=None, lora: _LoraMap | None = None) -> np.ndarray:
    if layer is None:
        name, kind = hf_name_and_kind(path)
        a = _to_host(var.get_value())
    else:
        name, kind = hf_name_and_kind(("layers", layer) + tuple(path[1:]))
        a = _to_host(var.get_value()[layer])
    if lora is not None and tuple(path) in lora:
        va, vb, scale = lora[tuple(path)]
        la, lb = va.get_value(), vb.get_value()
        if layer is not None:
            la, lb = la[layer], lb[layer]
        a = merged_kernel(a, _to_host(la), _to_host(lb), scale)
    hf_shape, _, perm, _ = _recipe(kind, a.shape)
    a = np.ascontiguousarray(a.transpose(np.argsort(perm)).reshape(hf_shape))
    return a.astype(np_dt) if np_dt is not None else a


def hf_state_dict(model: Transformer, dtype=None, *, merged: bool = False) -> dict[str, np.ndarray]:
    """{HF tensor name: numpy array in HF layout} (gathered to host): the base weights, or with merged=True the
    LoRA-merged ones (W + scale * A B on the targeted projections)."""
    np_dt = None if dtype is None else _np_dtype(dtype)
    lora = _lora_map(model) if merged else None
    return {name: _export_tensor(p, var, np_dt, layer, lora) for name, p, var, layer in _export_plan(model)}


def save_pretrained(
    model: Transformer, path, *, dtype=None, max_shard_bytes: int = 5 * 2**30, merged: bool = False
) -> pathlib.Path:
    """Write config.json, generation_config.json and model.safetensors (HF layout) that
    transformers.AutoModelForCausalLM.from_pretrained loads. dtype: saved dtype (default: param dtype).
    Above max_shard_bytes the weights go to model-0000k-of-0000n.safetensors + model.safetensors.index.json;
    tensors are gathered to host one at a time, so host memory holds at most one shard.
    LoRA adapters are never written here: merged=False saves the base weights, merged=True the merged ones
    (W + lora_alpha / lora_rank * A B, in float32 then cast to the saved dtype); the adapters alone go to a PEFT
    folder with stare_jax.models.lora.write_peft_adapter."""
    folder = pathlib.Path(path)
    lora = _lora_map(model) if merged else None
    cfg = model.config
    saved_dt = _dtype_name(dtype) if dtype is not None else cfg.param_dtype
    np_dt = _np_dtype(saved_dt)
    plan = _export_plan(model)
    sizes = [math.prod(var.get_value().shape[layer is not None :]) * np_dt.itemsize for _, _, var, layer in plan]
    shards: list[list[_ExportItem]] = []
    cur: list[_ExportItem] = []
    cur_bytes = 0
    for item, nbytes in zip(plan, sizes):
        if cur and cur_bytes + nbytes > max_shard_bytes:
            shards.append(cur)
            cur, cur_bytes = [], 0
        cur.append(item)
        cur_bytes += nbytes
    shards.append(cur)
    writer = jax.process_index() == 0
    if writer:
        folder.mkdir(parents=True, exist_ok=True)
        for old in list(folder.glob("model*.safetensors")) + [folder / "model.safetensors.index.json"]:
            if old.exists():
                os.remove(old)
    weight_map = {}
    for k, shard in enumerate(shards):
        fn = "model.safetensors" if len(shards) == 1 else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: _export_tensor(p, var, np_dt, layer, lora) for name, p, var, layer in shard}  # collective
        if writer:
            _write_safetensors(folder / fn, tensors)
        weight_map.update({name: fn for name in tensors})
    if not writer:
        return folder
    if len(shards) > 1:
        index = {"metadata": {"total_size": int(sum(sizes))}, "weight_map": dict(sorted(weight_map.items()))}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    hf_cfg = cfg.to_hf_config()
    hf_cfg["torch_dtype"] = saved_dt
    (folder / "config.json").write_text(json.dumps(hf_cfg, indent=2))
    gen = {k: hf_cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if hf_cfg[k] is not None}
    (folder / "generation_config.json").write_text(json.dumps(gen, indent=2))
    return folder
