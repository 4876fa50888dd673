"""Sampler-side layouts: batch sharded over the data axes, parameters resharded once per RL step.

The trainer keeps parameters FSDP-sharded (sharded over "fsdp"/"data"); decoding one token at a time with
FSDP would all-gather every weight at every step, so the sampler instead keeps parameters replicated over the
data axes and only sharded over "tensor" (tensor parallel, if the mesh has such an axis of size > 1).
`reshard_for_sampling` does that with one `jax.device_put` onto the new NamedShardings: device to device,
no host round trip.
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

DATA_AXES = ("data", "fsdp")  # batch axes of the sampler (those present in the mesh are used)
PARAM_KEEP_AXES = ("tensor",)  # parameter axes the sampler keeps (everything else is replicated)


def data_axes(mesh: Mesh, candidates: Sequence[str] = DATA_AXES) -> tuple[str, ...]:
    """The mesh axes that shard the sampler's batch dimension, in mesh order."""
    return tuple(a for a in mesh.axis_names if a in candidates)


def data_size(mesh: Mesh | None, candidates: Sequence[str] = DATA_AXES) -> int:
    """Number of batch shards (1 without a mesh); batch sizes are padded to a multiple of it."""
    if mesh is None:
        return 1
    n = 1
    for a in data_axes(mesh, candidates):
        n *= mesh.shape[a]
    return n


def batch_sharding(mesh: Mesh, candidates: Sequence[str] = DATA_AXES) -> NamedSharding:
    """Leading (batch) dimension over the data axes, the rest replicated."""
    axes = data_axes(mesh, candidates)
    return NamedSharding(mesh, PartitionSpec(axes if axes else None))


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
    spec = x.sharding.spec if isinstance(getattr(x, "sharding", None), NamedSharding) else PartitionSpec()
    return NamedSharding(mesh, PartitionSpec(*(_keep(e, keep_axes, mesh) for e in spec)))


def reshard_for_sampling(state, mesh: Mesh | None, keep_axes: Sequence[str] = PARAM_KEEP_AXES):
    """Parameters (any pytree of arrays, e.g. an nnx.State) in the sampler's layout on `mesh`, on device.

    Without a mesh the state is returned unchanged. Arrays already in the target layout are not copied.
    """
    if mesh is None:
        return state
    leaves, treedef = jax.tree.flatten(state)
    targets = [sampler_param_sharding(x, mesh, keep_axes) if isinstance(x, jax.Array) else None for x in leaves]
    arrays = [x for x, t in zip(leaves, targets) if t is not None]
    moved = iter(jax.device_put(arrays, [t for t in targets if t is not None]))
    out = [next(moved) if t is not None else x for x, t in zip(leaves, targets)]
    return jax.tree.unflatten(treedef, out)
