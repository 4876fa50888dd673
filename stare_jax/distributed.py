"""Multi-process helpers: which rows of a global train batch this process feeds, and the global jax.Array
batch built from those process-local rows (jax.make_array_from_process_local_data).

In a multi-process run (jax.distributed.initialize) the jitted train step's batch in_sharding spans devices of
every process, so a host NumPy batch cannot be passed as is: each process holds only some rows (for the batch
sharding P(("data", "fsdp")) on a mesh built from jax.devices(), a contiguous block of B / process_count rows),
and the global array is assembled from those local blocks. In a single process the helpers are the identity
(all rows are local).
"""
from __future__ import annotations

from typing import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P


def batch_sharding(mesh: jax.sharding.Mesh, batch_axes: Sequence[str] = ("data", "fsdp")) -> NamedSharding:
    """Leading (batch) axis over batch_axes, the rest replicated (what train_step.batch_shardings uses)."""
    return NamedSharding(mesh, P(tuple(batch_axes)))


def process_batch_rows(mesh: jax.sharding.Mesh, global_batch_size: int,
                       batch_axes: Sequence[str] = ("data", "fsdp")) -> np.ndarray:
    """Sorted indices of the rows of a [global_batch_size, ...] batch that this process's devices hold.

    These are the rows this process must feed to `global_batch_from_process_local`, in this order."""
    shards = int(np.prod([mesh.shape[a] for a in batch_axes]))
    if global_batch_size % shards:
        raise ValueError(f"global batch size {global_batch_size} must be divisible by the {shards} devices of "
                         f"mesh axes {tuple(batch_axes)}")
    idx = batch_sharding(mesh, batch_axes).addressable_devices_indices_map((global_batch_size,))
    rows = set()
    for index in idx.values():
        rows.update(range(*index[0].indices(global_batch_size)))
    return np.array(sorted(rows), dtype=np.int64)


def global_batch_from_process_local(batch_local: Mapping[str, np.ndarray], mesh: jax.sharding.Mesh,
                                    global_batch_size: int,
                                    batch_axes: Sequence[str] = ("data", "fsdp")) -> dict:
    """{key: global jax.Array [global_batch_size, ...]} sharded over batch_axes, from this process's rows.

    batch_local[k] must hold exactly the rows `process_batch_rows(mesh, global_batch_size)` of the global
    batch, in that order (same trailing shape on every process)."""
    sharding = batch_sharding(mesh, batch_axes)
    n_local = len(process_batch_rows(mesh, global_batch_size, batch_axes))
    out = {}
    for k, v in batch_local.items():
        v = np.asarray(v)
        if v.ndim < 1 or v.shape[0] != n_local:
            raise ValueError(f"process-local batch[{k!r}] has shape {v.shape}; process {jax.process_index()} "
                             f"feeds {n_local} of the {global_batch_size} rows (leading axis)")
        out[k] = jax.make_array_from_process_local_data(sharding, v, (global_batch_size,) + v.shape[1:])
    return out
