"""Logical-axis sharding: parameters name their dimensions ("embed", "mlp", ...); a rules table maps those
names onto mesh axes ("data", "fsdp", "tensor"). Changing the parallelism layout = changing the table.

Parameters are created with `nnx.Param(value, out_sharding=(...), eager_sharding=False)`; flax stores the
names under the Variable metadata key `out_sharding`.
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Mapping, Sequence

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

MESH_AXES = ("data", "fsdp", "tensor")
BATCH_AXES = ("data", "fsdp")  # the axes that split the batch, in every program (train step, sampler, evaluation)

# logical name -> mesh axis (str), tuple of mesh axes, or None (replicated)
Rules = Mapping[str, "str | tuple[str, ...] | None"]

DEFAULT_RULES: dict = {
    # parameters
    "vocab": "tensor",
    "embed": "fsdp",
    "q_heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "norm": None,
    "layers": None,  # the stacked-layer axis when ModelConfig.scan_layers
    # LoRA adapters (ModelConfig.lora_rank > 0): A [in axes..., lora_rank] is sharded like its base kernel's input
    # axes, B [lora_rank, out axes...] like its output axes; the small rank axis is replicated.
    "lora_rank": None,
    # activations
    "batch": BATCH_AXES,
    "seq": None,
    "act_embed": None,
    "act_heads": "tensor",
    "act_mlp": "tensor",
    "act_vocab": "tensor",
}


def no_sharding() -> dict:
    """Rules that replicate everything (tests, single device)."""
    return {k: None for k in DEFAULT_RULES}


def make_mesh(shape: Mapping[str, int], axis_types=None, devices=None) -> jax.sharding.Mesh:
    """Mesh with named axes, e.g. make_mesh({"data": 2, "fsdp": 4}). Missing standard axes get size 1.

    axis_types defaults to Auto for every axis (what the train step's shardings assume)."""
    shape = dict(shape)
    for name, size in shape.items():
        if not isinstance(size, int) or size <= 0:
            raise ValueError(f"mesh axis {name!r} must have a positive int size, got {size!r}")
    for ax in MESH_AXES:
        shape.setdefault(ax, 1)
    devices = jax.devices() if devices is None else list(devices)
    total = math.prod(shape.values())
    if total != len(devices):
        raise ValueError(
            f"mesh shape {shape} has {total} devices but there are {len(devices)} devices "
            f"(jax.devices() count={len(devices)})"
        )
    if axis_types is None:
        axis_types = jax.sharding.AxisType.Auto
    if not isinstance(axis_types, (tuple, list)):
        axis_types = (axis_types,) * len(shape)
    return jax.make_mesh(tuple(shape.values()), tuple(shape.keys()), axis_types=tuple(axis_types), devices=devices)


def resolve_mesh(mesh_cfg, num_devices: int) -> dict[str, int]:
    """Axis sizes of a run config's `mesh` section (data / fsdp / tensor) with at most one -1 filled from the
    device count; errors if they do not multiply to it."""
    sizes = {"data": mesh_cfg.data, "fsdp": mesh_cfg.fsdp, "tensor": mesh_cfg.tensor}
    free = [k for k, v in sizes.items() if v == -1]
    if len(free) > 1:
        raise ValueError(f"mesh: at most one axis may be -1, got {sizes}")
    fixed = math.prod(v for v in sizes.values() if v != -1)
    if free:
        if num_devices % fixed:
            raise ValueError(f"mesh {sizes} does not divide the {num_devices} devices (fixed axes multiply to {fixed})")
        sizes[free[0]] = num_devices // fixed
    if math.prod(sizes.values()) != num_devices:
        raise ValueError(f"mesh {sizes} has {math.prod(sizes.values())} devices but the accelerator has {num_devices}")
    return sizes


def mesh_for_config(mesh_cfg, devices=None) -> jax.sharding.Mesh | None:
    """The run's (data, fsdp, tensor) mesh over `devices` (default: all of jax.devices(); a TPU topology's
    abstract devices for ahead-of-time compiles); None for a single device (programs then run unsharded)."""
    devices = jax.devices() if devices is None else list(devices)
    if len(devices) == 1:
        return None
    return make_mesh(resolve_mesh(mesh_cfg, len(devices)), devices=devices)


def batch_axes(mesh: jax.sharding.Mesh, candidates: Sequence[str] = BATCH_AXES) -> tuple[str, ...]:
    """The mesh axes that split the batch dimension (those of `candidates` the mesh has), in mesh order."""
    return tuple(a for a in mesh.axis_names if a in candidates)


def batch_shards(mesh: jax.sharding.Mesh | Mapping[str, int] | None, candidates: Sequence[str] = BATCH_AXES) -> int:
    """Number of batch shards of a mesh, or of axis sizes (e.g. resolve_mesh's); 1 without a mesh. Batch sizes
    must be (or are padded to) a multiple of it."""
    if mesh is None:
        return 1
    sizes = mesh.shape if isinstance(mesh, jax.sharding.Mesh) else mesh
    return math.prod(sizes[a] for a in candidates if a in sizes)


def batch_sharding(mesh: jax.sharding.Mesh, candidates: Sequence[str] = BATCH_AXES) -> NamedSharding:
    """Leading (batch) dimension over the batch axes, the rest replicated."""
    axes = batch_axes(mesh, candidates)
    return NamedSharding(mesh, P(axes if axes else None))


# logical names a custom rules table may leave out (replicated then)
_REPLICATED_BY_DEFAULT = ("lora_rank",)


def _mesh_axes_for(name, rules: Rules):
    if name is None or (name in _REPLICATED_BY_DEFAULT and name not in rules):
        return None
    if name not in rules:
        raise ValueError(f"logical axis {name!r} has no entry in the sharding rules (known: {sorted(rules)})")
    return rules[name]


def logical_to_spec(
    names: Sequence[str | None],
    rules: Rules,
    shape: Sequence[int] | None = None,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
) -> P:
    """PartitionSpec for logical names. With shape+mesh, a dimension that the mesh axes do not divide evenly,
    or a mesh axis already used by an earlier dimension, is replicated instead."""
    out: list[str | tuple[str, ...] | None] = []
    used: set[str] = set()
    for i, name in enumerate(names):
        axes = _mesh_axes_for(name, rules)
        if axes is None:
            out.append(None)
            continue
        axes_t = (axes,) if isinstance(axes, str) else tuple(axes)
        if mesh is not None:
            axes_t = tuple(a for a in axes_t if a in mesh.shape and mesh.shape[a] > 1 and a not in used)
            if shape is not None:
                kept: list[str] = []
                for a in axes_t:  # keep the prefix of axes whose product divides the dim
                    if shape[i] % (math.prod(mesh.shape[x] for x in kept) * mesh.shape[a]) == 0:
                        kept.append(a)
                axes_t = tuple(kept)
        used.update(axes_t)
        out.append(None if not axes_t else axes_t[0] if len(axes_t) == 1 else axes_t)
    return P(*out)


def _var_names(var) -> tuple | None:
    meta = var.get_metadata()
    names = meta.get("out_sharding", None)
    return tuple(names) if names is not None else None


def state_shardings(state, mesh: jax.sharding.Mesh, rules: Rules | None = None):
    """Pytree (same structure as an nnx.State / abstract state) of NamedSharding for each Variable."""
    rules = DEFAULT_RULES if rules is None else rules

    def f(var):
        names = _var_names(var)
        shape = var.get_value().shape
        spec = P() if names is None else logical_to_spec(names, rules, shape, mesh)
        return var.replace(NamedSharding(mesh, spec))

    return jax.tree.map(f, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def shard_model(model: nnx.Module, mesh: jax.sharding.Mesh, rules: Rules | None = None) -> nnx.Module:
    """Move every parameter of `model` onto `mesh` per `rules` (in place; returns the model)."""
    state = nnx.state(model)
    shardings = state_shardings(state, mesh, rules)
    new_state = jax.tree.map(lambda x, s: jax.device_put(x, s), state, shardings)
    nnx.update(model, new_state)
    return model


# ---------------------------------------------------------------- activation constraints
class _Ctx(threading.local):
    rules: Rules | None = None


_ctx = _Ctx()


@contextlib.contextmanager
def activation_rules(rules: Rules | None):
    """Within this context (and a `jax.set_mesh(mesh)`), `constrain` pins activations to the rules."""
    prev, _ctx.rules = _ctx.rules, rules
    try:
        yield
    finally:
        _ctx.rules = prev


def program_context(mesh: jax.sharding.Mesh | None, rules: Rules | None = None):
    """What every sharded program (train step, sampler, engine) is traced and run under: `jax.set_mesh(mesh)` and
    activation_rules(rules, default DEFAULT_RULES); nothing without a mesh."""
    if mesh is None:
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(jax.set_mesh(mesh))
    stack.enter_context(activation_rules(DEFAULT_RULES if rules is None else rules))
    return stack


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """with_sharding_constraint by logical names, a no-op unless both an ambient mesh (jax.set_mesh) and
    activation_rules(...) are active. Dimensions the mesh does not divide are left replicated."""
    rules = _ctx.rules
    if rules is None:
        return x
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return x
    spec = logical_to_spec(names, rules, x.shape, mesh)
    return jax.lax.with_sharding_constraint(x, spec)


def shard_count(name: str | None, size: int) -> int:
    """Devices that `constrain` splits a dimension of `size` named `name` over, under the active mesh and
    activation rules (1 outside them): lets a program lay out a loop over a sharded dimension per device."""
    rules = _ctx.rules
    mesh = jax.sharding.get_abstract_mesh()
    if rules is None or mesh is None or mesh.empty:
        return 1
    axes = logical_to_spec((name,), rules, (size,), mesh)[0]
    axes_t = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    return math.prod(mesh.shape[a] for a in axes_t)


def describe(model_or_state) -> dict:
    """{param path: (shape, logical names)} for docs and debugging."""
    state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state)
    out = {}
    for path, var in nnx.to_flat_state(state):
        out[".".join(map(str, path))] = (tuple(np.shape(var.get_value())), _var_names(var))
    return out
