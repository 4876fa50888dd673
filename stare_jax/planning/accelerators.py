"""The accelerators `stare-jax plan` knows: per-device HBM and bf16 peak FLOP/s of TPU slice types and GPU
clusters by name, and the one this process runs on (its devices' reported memory limit)."""

from __future__ import annotations

import dataclasses
import math
import re

import jax

GiB = 1024**3


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """One device of a slice/cluster: HBM per device and bf16 dense peak FLOP/s."""

    name: str
    kind: str  # "tpu" | "gpu"
    num_devices: int
    hbm_bytes: int
    peak_flops: float
    num_hosts: int


# per-chip HBM available to a program (bytes: libtpu's own figure, what the compiler enforces;
# stare_jax.training.aot reads
# it from the topology), bf16 dense peak, TensorCores per chip in the type name, chips per host
_TPU = {
    "v4": (int(30.5 * GiB), 275e12, 2, 4),
    "v5litepod": (int(15.75 * GiB), 197e12, 1, 4),
    "v5e": (int(15.75 * GiB), 197e12, 1, 4),
    "v5p": (int(95.74 * GiB), 459e12, 2, 4),
    "v6e": (int(31.25 * GiB), 918e12, 1, 4),
}
_GPU = {
    "A100": (80 * 10**9, 312e12),
    "H100": (80 * 10**9, 989e12),
    "H200": (141 * 10**9, 989e12),
    "B200": (180 * 10**9, 2250e12),
}


def parse_accelerator(name: str) -> Accelerator:
    """'v5p-64' (TPU type: cores for v4/v5p, chips for v5e/v6e) or 'NxGPU' / 'NODESxNxGPU' (e.g. '2x8xH100')."""
    m = re.fullmatch(r"(v4|v5litepod|v5e|v5p|v6e)-(\d+)", name)
    if m:
        family, n = m.group(1), int(m.group(2))
        hbm, peak, cores_per_chip, chips_per_host = _TPU[family]
        if n <= 0 or n % cores_per_chip:
            raise ValueError(f"accelerator {name!r}: the size must be a positive multiple of {cores_per_chip}")
        chips = n // cores_per_chip
        return Accelerator(name, "tpu", chips, hbm, peak, max(1, math.ceil(chips / chips_per_host)))
    m = re.fullmatch(r"(?:(\d+)x)?(\d+)x(A100|H100|H200|B200)", name)
    if m:
        nodes, per_node, gpu = int(m.group(1) or 1), int(m.group(2)), m.group(3)
        if nodes <= 0 or per_node <= 0:
            raise ValueError(f"accelerator {name!r}: node and GPU counts must be positive")
        hbm, peak = _GPU[gpu]
        return Accelerator(name, "gpu", nodes * per_node, hbm, peak, nodes)
    raise ValueError(
        f"unknown accelerator type {name!r}; accepted: TPU types v4-N, v5litepod-N (v5e), v5p-N, v6e-N, or GPUs "
        f"as [NODESx]GPUSx{{{','.join(_GPU)}}} (e.g. 8xH100, 2x8xH100)"
    )


def live_accelerator(devices=None) -> Accelerator | None:
    """The accelerator this process runs on, from its devices (all processes'): HBM per device as the runtime
    reports it (memory_stats()["bytes_limit"]); None where it reports none (the CPU)."""
    devices = list(jax.devices() if devices is None else devices)
    try:
        stats = devices[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - a backend without memory stats
        stats = {}
    limit = int(stats.get("bytes_limit", 0) or 0)
    if not limit:
        return None
    d = devices[0]
    return Accelerator(
        name=f"{len(devices)}x{d.device_kind}",
        kind=d.platform,
        num_devices=len(devices),
        hbm_bytes=limit,
        peak_flops=0.0,
        num_hosts=len({x.process_index for x in devices}),
    )


def as_accelerator(accelerator: "str | Accelerator") -> Accelerator:
    return accelerator if isinstance(accelerator, Accelerator) else parse_accelerator(accelerator)
