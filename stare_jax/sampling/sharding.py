"""Sampler-side layouts: batch sharded over the data axes, parameters resharded once per RL step.

The trainer keeps parameters FSDP-sharded (sharded over "fsdp"/"data"); decoding one token at a time with
FSDP would all-gather every weight at every step, so the sampler instead keeps parameters replicated over the
data axes and only sharded over "tensor" (tensor parallel, if the mesh has such an axis of size > 1).
`reshard_for_sampling` does that with one jitted program (cast to the compute dtype + the new NamedShardings):
device to device, no host round trip.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

PARAM_KEEP_AXES = ("tensor",)  # parameter axes the sampler keeps (everything else is replicated)


def _keep(entry, keep: Sequence[str], mesh: Mesh):
    """One PartitionSpec entry restricted to the axes the sampler keeps."""
    if entry is None:
        return None
    names = (entry,) if isinstance(entry, str) else tuple(entry)
    kept = tuple(n for n in names if n in keep and n in mesh.axis_names and mesh.shape[n] > 1)
    if not kept:
        return None
    return kept[0] if len(kept) == 1 else kept


def sampler_param_sharding(x: jax.Array, mesh: Mesh, keep_axes: Sequence[str] = PARAM_KEEP_AXES) -> NamedSharding:
    """The sampler's sharding of one parameter: its training spec with every axis but `keep_axes` dropped."""
    sharding = getattr(x, "sharding", None)
    spec = sharding.spec if isinstance(sharding, NamedSharding) else PartitionSpec()
    return NamedSharding(mesh, PartitionSpec(*(_keep(e, keep_axes, mesh) for e in spec)))


def _cast_dtype(x_dtype, dtype):
    """The sampler's dtype of a leaf: floating leaves take `dtype` (None: unchanged), integer / key leaves keep
    theirs."""
    return x_dtype if dtype is None or not jnp.issubdtype(x_dtype, jnp.floating) else dtype


def _cast(x, dtype):
    return x if _cast_dtype(x.dtype, dtype) == x.dtype else x.astype(dtype)


def reshard_for_sampling(state, mesh: Mesh | None, keep_axes: Sequence[str] = PARAM_KEEP_AXES, *, dtype=None):
    """Parameters (any pytree of arrays, e.g. an nnx.State) in the sampler's layout on `mesh`, on device, with
    floating leaves cast to `dtype` (the model's compute dtype; None keeps them).

    One jitted program (cast + reshard, device to device, the trainer's copy untouched); without a mesh and
    with nothing to cast the state is returned unchanged. jax.ShapeDtypeStruct leaves (an abstract state) give
    the abstract result, so the same function serves ahead-of-time compiles."""
    leaves, treedef = jax.tree.flatten(state)
    dtype = None if dtype is None else jnp.dtype(dtype)
    if mesh is None and all(_cast_dtype(x.dtype, dtype) == x.dtype for x in leaves):
        return state
    if mesh is None:
        targets = [getattr(x, "sharding", None) for x in leaves]
    else:
        targets = [sampler_param_sharding(x, mesh, keep_axes) for x in leaves]
    if any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
        out = [jax.ShapeDtypeStruct(x.shape, _cast_dtype(x.dtype, dtype), sharding=t) for x, t in zip(leaves, targets)]
        return jax.tree.unflatten(treedef, out)
    return jax.tree.unflatten(treedef, reshard_program(tuple(targets), dtype)(leaves))


@functools.lru_cache(maxsize=16)
def reshard_program(targets: tuple, dtype):
    """The jitted trainer -> sampler weight program: cast each leaf, then lay it out as `targets` (one
    NamedSharding per leaf, or None to keep it where it is)."""
    out_shardings = list(targets) if all(t is not None for t in targets) else None
    return jax.jit(lambda leaves: [_cast(x, dtype) for x in leaves], out_shardings=out_shardings)
