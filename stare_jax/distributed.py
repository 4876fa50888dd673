"""Multi-process helpers (jax.distributed runs: several hosts, or several local CPU processes in tests).

The RL loop's convention: every process holds the same small global host data for a step (the prompt batch, the
train batch) and feeds only the rows its devices hold (`global_batch`, built on `process_batch_rows` +
`global_batch_from_process_local`: for the batch sharding P(("data", "fsdp")) on a mesh built from
jax.devices(), a contiguous block of rows per process); device results that every host needs (sampled tokens)
come back with `fetch_global`; work done on the host (decoding and scoring responses) is split into per-process
shares (`process_share`) whose results are gathered (`gather_shares`, `sum_across_processes`); and decisions
that every process must take together (stopping on a preemption signal) go through `any_process`.

Replicated SPMD host code (the rollout engine's scheduler): every process runs the same host logic on the same
host data and takes the same decisions; a host value every process holds becomes a program input with
`global_from_host` (each process places only its own devices' pieces, no cross-process traffic), the device
results the host logic reads come back with `fetch_global`, and a host result only one process may compute (a
sandboxed tool call, whose timing differs between hosts) is computed on process 0 and sent to the others with
`broadcast_from_process0`. In a single process every helper is the identity, a plain device_put or device_get.
"""

from __future__ import annotations

import json
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from stare_jax.models.sharding import BATCH_AXES, batch_sharding


def process_batch_rows(
    mesh: jax.sharding.Mesh, global_batch_size: int, batch_axes: Sequence[str] = BATCH_AXES
) -> np.ndarray:
    """Sorted indices of the rows of a [global_batch_size, ...] batch that this process's devices hold.

    These are the rows this process must feed to `global_batch_from_process_local`, in this order."""
    shards = int(np.prod([mesh.shape[a] for a in batch_axes]))
    if global_batch_size % shards:
        raise ValueError(
            f"global batch size {global_batch_size} must be divisible by the {shards} devices of "
            f"mesh axes {tuple(batch_axes)}"
        )
    idx = batch_sharding(mesh, batch_axes).addressable_devices_indices_map((global_batch_size,))
    rows: set[int] = set()
    for index in idx.values():
        assert index is not None  # typed Optional by jax, but every device of a sharding holds an index
        rows.update(range(*index[0].indices(global_batch_size)))
    return np.array(sorted(rows), dtype=np.int64)


def global_batch_from_process_local(
    batch_local: Mapping[str, np.ndarray],
    mesh: jax.sharding.Mesh,
    global_batch_size: int,
    batch_axes: Sequence[str] = BATCH_AXES,
) -> dict:
    """{key: global jax.Array [global_batch_size, ...]} sharded over batch_axes, from this process's rows.

    batch_local[k] must hold exactly the rows `process_batch_rows(mesh, global_batch_size)` of the global
    batch, in that order (same trailing shape on every process)."""
    sharding = batch_sharding(mesh, batch_axes)
    n_local = len(process_batch_rows(mesh, global_batch_size, batch_axes))
    out = {}
    for k, v in batch_local.items():
        v = np.asarray(v)
        if v.ndim < 1 or v.shape[0] != n_local:
            raise ValueError(
                f"process-local batch[{k!r}] has shape {v.shape}; process {jax.process_index()} "
                f"feeds {n_local} of the {global_batch_size} rows (leading axis)"
            )
        out[k] = jax.make_array_from_process_local_data(sharding, v, (global_batch_size,) + v.shape[1:])
    return out


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def global_batch(
    batch: Mapping[str, np.ndarray], mesh: jax.sharding.Mesh, batch_axes: Sequence[str] = BATCH_AXES
) -> dict:
    """{key: global jax.Array} from a host batch that is identical on every process: each process feeds only
    the rows its devices hold (`process_batch_rows`). Keys may differ in their leading length (the packed
    layout's rows and sequences)."""
    out = {}
    for k, v in batch.items():
        n = len(v)
        rows = process_batch_rows(mesh, n, batch_axes)
        out.update(global_batch_from_process_local({k: np.asarray(v)[rows]}, mesh, n, batch_axes))
    return out


def global_from_host(x, sharding: jax.sharding.Sharding) -> jax.Array:
    """A jax.Array with `sharding` (which may span every process's devices) from a host value that is identical
    on every process: each process places only the pieces its own devices hold (no cross-process check or
    transfer: the caller guarantees equality, e.g. a replicated host scheduler). One process: device_put."""
    x = np.asarray(x)
    if not is_multiprocess():
        return jax.device_put(x, sharding)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: np.asarray(x[index]))


def _identity(*xs):
    return xs


def fetch_global(tree):
    """Every array of `tree` as a full host NumPy array on every process: the global arrays spanning several
    processes are all-gathered together (ONE jitted program replicates all of them over their meshes, then each
    process reads its own copy), any other leaf (a host value, an array of this process's devices) is copied as
    it is. One process: a plain device_get."""
    if not is_multiprocess():
        return jax.tree.map(np.asarray, jax.device_get(tree))

    leaves, treedef = jax.tree.flatten(tree)
    spanning = [i for i, x in enumerate(leaves) if isinstance(x, jax.Array) and not x.is_fully_addressable]
    out = {}
    if spanning:
        xs = [leaves[i] for i in spanning]
        replicated = tuple(
            x.sharding.update(spec=jax.sharding.PartitionSpec())
            if isinstance(x.sharding, jax.sharding.NamedSharding)
            else None
            for x in xs
        )
        if all(r is not None for r in replicated):
            gathered = [x.addressable_data(0) for x in jax.jit(_identity, out_shardings=replicated)(*xs)]
        else:  # another sharding type: jax's own gather, one array at a time
            gathered = multihost_utils.process_allgather(xs, tiled=True)
        out = dict(zip(spanning, gathered))
    return jax.tree.unflatten(
        treedef, [np.asarray(out[i] if i in out else jax.device_get(x)) for i, x in enumerate(leaves)]
    )


def broadcast_from_process0(value: Any) -> Any:
    """Process 0's JSON-able `value` on every process (the other processes' argument is ignored): a host result
    that only process 0 computes, e.g. sandboxed tool calls (their timing differs between hosts, so each host
    running them could append different observations). Two small broadcasts (length, then the UTF-8 bytes).
    One process: the value itself."""
    if not is_multiprocess():
        return value
    mine = jax.process_index() == 0
    data = np.frombuffer(json.dumps(value).encode() if mine else b"", np.uint8)
    size = int(multihost_utils.broadcast_one_to_all(np.asarray([data.size], np.int32), is_source=mine)[0])
    buf = np.zeros((size,), np.uint8)
    buf[: data.size] = data
    got = np.asarray(multihost_utils.broadcast_one_to_all(buf, is_source=mine))
    return json.loads(got.astype(np.uint8).tobytes().decode())


def _share(k: int, count: int, n: int) -> tuple[int, int]:
    """[lo, hi) of share k when n items are split into count contiguous shares as evenly as possible."""
    return k * n // count, (k + 1) * n // count


def process_share(n: int) -> tuple[int, int]:
    """[lo, hi) of this process's contiguous share of n items (the rows it decodes and scores)."""
    return _share(jax.process_index(), jax.process_count(), n)


def gather_shares(local: np.ndarray, n: int) -> np.ndarray:
    """The n items [n, ...] from every process's `process_share(n)` slice `local` (concatenated in process
    order); the identity in a single process."""
    local = np.asarray(local)
    if not is_multiprocess():
        return local

    count = jax.process_count()
    width = -(-n // count)  # shares differ by at most one item: pad each to the widest
    padded = np.zeros((width,) + local.shape[1:], local.dtype)
    padded[: len(local)] = local
    gathered = np.asarray(multihost_utils.process_allgather(padded, tiled=False))  # [count, width, ...]
    sizes = [hi - lo for lo, hi in (_share(k, count, n) for k in range(count))]
    return np.concatenate([gathered[k, :size] for k, size in enumerate(sizes)], axis=0)


def sum_across_processes(counts: Mapping[str, float], keys: Sequence[str]) -> dict:
    """{key: sum over processes of counts.get(key, 0)} for a fixed key list (the same on every process, so the
    collective matches even where a process had nothing to count)."""
    local = np.asarray([float(counts.get(k, 0)) for k in keys], np.float64)
    if is_multiprocess() and keys:
        local = np.asarray(multihost_utils.process_allgather(local)).sum(axis=0)
    return {k: float(v) for k, v in zip(keys, local)}


def any_process(flag: bool) -> bool:
    """True on every process when `flag` is True on any of them (a stop decision all processes must share)."""
    if not is_multiprocess():
        return bool(flag)

    return bool(np.asarray(multihost_utils.process_allgather(np.asarray([int(bool(flag))], np.int32))).any())


def barrier(name: str) -> None:
    """Wait until every process reaches this point (no-op in a single process)."""
    if is_multiprocess():
        multihost_utils.sync_global_devices(name)
