"""Which per-chip figure does the TPU compiler enforce: memory_analysis().temp_size_in_bytes or peak_memory_in_bytes?

A train-step-like program (a scan over L remat'ed MLP layers with fp32 weights split over tensor 4, bf16 compute,
gradients accumulated over 8 micro-batches, donated SGD update) is compiled for v5p:2x2x1 (4 chips of 95.74 GiB) on
this CPU host for growing L until the compiler refuses it. At the last L that compiles and the first that does not,
it prints arguments + outputs - aliases + temp_size (the sum stare_jax.training.aot reported as the peak until
2026-12-06)
beside peak_memory_in_bytes and HBM, and the compiler's own refusal message.

    python benchmarks/tpu_peak_memory.py [--json]

Seen on 2026-12-06 (jax 0.10.2, libtpu 0.0.42.1; 24 s on this 2-core host): L=134 compiles with
peak_memory_in_bytes 95.46 GiB although arguments + temp_size come to 130.32 GiB; L=135 is refused: "the total
memory required for HLO temporaries (96.15G) exceeds available HBM (95.74G)". peak_memory_in_bytes (arguments +
outputs - aliases + the buffer assignment's temp allocation) is the enforced figure.

Second part, host memory (memory kind pinned_host, the rl.offload.optimizer state): a step that takes 60 GiB per
chip of host-resident and 60 GiB of device-resident arguments compiles, although peak_memory_in_bytes reports 120
GiB > HBM: the host buffers are in peak_memory_in_bytes but not in what the compiler holds against HBM, so
stare_jax.training.aot takes them out of the device peak.
Bringing 60 GiB in from host while 30 GiB are on device is refused
(150 GiB of device memory needed). Seen on 2026-12-06 (61 s in all): both, as described.
"""

from __future__ import annotations

import argparse
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from stare_jax.training.aot import get_topology

GiB = 2**30
B, T, D, F, MICRO = 4, 9216, 3584, 18944, 8


def program(L: int, mesh):
    """The traced step for L layers (abstract arguments only)."""

    def layer(x, w):
        h = jax.nn.silu(jnp.einsum("btd,df->btf", x, w[0].astype(jnp.bfloat16)))
        return x + jnp.einsum("btf,fd->btd", h, w[1].astype(jnp.bfloat16))

    def loss(ws, x):
        y, _ = jax.lax.scan(jax.checkpoint(lambda c, w: (layer(c, w), None)), x, ws)
        return jnp.mean(y.astype(jnp.float32) ** 2)

    def step(ws, xs):
        def micro(acc, x):
            return jax.tree.map(jnp.add, acc, jax.grad(loss)(ws, x)), None

        acc, _ = jax.lax.scan(micro, jax.tree.map(jnp.zeros_like, ws), xs)
        return jax.tree.map(lambda w, a: w - 1e-3 * a, ws, acc)

    ws = (
        jax.ShapeDtypeStruct((L, D, F), jnp.float32, sharding=NamedSharding(mesh, P(None, None, "tensor"))),
        jax.ShapeDtypeStruct((L, F, D), jnp.float32, sharding=NamedSharding(mesh, P(None, "tensor", None))),
    )
    xs = jax.ShapeDtypeStruct((MICRO, B, T, D), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
    return jax.jit(step, donate_argnums=0).trace(ws, xs)


def try_compile(L: int, mesh) -> dict:
    """Figures of the compiled program for L layers, or the compiler's refusal."""
    try:
        ma = program(L, mesh).lower().compile().memory_analysis()
    except Exception as e:  # noqa: BLE001 - the refusal is the measurement
        msg = str(e)
        m = re.search(r"required for HLO temporaries \(([\d.]+)G\) exceeds available HBM \(([\d.]+)G\)", msg)
        if not m:
            raise
        return {
            "layers": L,
            "compiles": False,
            "required_gib": float(m.group(1)),
            "hbm_gib": float(m.group(2)),
            "message": msg.splitlines()[0][:300],
        }
    resident = ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
    return {
        "layers": L,
        "compiles": True,
        "args_plus_temp_size_gib": (resident + ma.temp_size_in_bytes) / GiB,
        "peak_memory_gib": ma.peak_memory_in_bytes / GiB,
        "temp_size_gib": ma.temp_size_in_bytes / GiB,
        "arguments_gib": ma.argument_size_in_bytes / GiB,
    }


def host_memory_rows(mesh) -> list[dict]:
    """(host GiB, device GiB, brought in) per chip -> peak_memory_in_bytes, host figures, or the refusal."""
    hs = NamedSharding(mesh, P("tensor"), memory_kind="pinned_host")
    ds = NamedSharding(mesh, P("tensor"))
    rows = []
    for host_gib, dev_gib, bring_in in ((60, 60, False), (60, 30, True)):

        def step(h, d, bring_in=bring_in):
            if bring_in:  # the moments' round trip: in, updated, back out
                return jax.device_put(jax.device_put(h, jax.memory.Space.Device) * 2, jax.memory.Space.Host), d + 1
            return h, d + 1

        n = mesh.size
        h = jax.ShapeDtypeStruct((host_gib * GiB // 4 * n,), jnp.float32, sharding=hs)
        d = jax.ShapeDtypeStruct((dev_gib * GiB // 4 * n,), jnp.float32, sharding=ds)
        row = {"host_gib": host_gib, "device_gib": dev_gib, "brought_in": bring_in}
        try:
            ma = jax.jit(step, out_shardings=(hs, ds), donate_argnums=(0, 1)).lower(h, d).compile().memory_analysis()
            row.update(
                compiles=True,
                peak_memory_gib=ma.peak_memory_in_bytes / GiB,
                host_arguments_gib=ma.host_argument_size_in_bytes / GiB,
                arguments_gib=ma.argument_size_in_bytes / GiB,
            )
        except Exception as e:  # noqa: BLE001 - the refusal is the measurement
            row.update(compiles=False, message=str(e).splitlines()[0][:200])
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    topo = get_topology("v5p:2x2x1")  # stare_jax.training.aot's: never takes libtpu's one-process lock
    mesh = jax.sharding.Mesh(np.array(topo.devices).reshape(4), ("tensor",))
    lo, hi = 8, 256  # compiles at lo (checked), refused at hi (checked): bisect the boundary
    rows = {L: try_compile(L, mesh) for L in (lo, hi)}
    assert rows[lo]["compiles"] and not rows[hi]["compiles"], rows
    while hi - lo > 1:
        mid = (lo + hi) // 2
        rows[mid] = try_compile(mid, mesh)
        lo, hi = (mid, hi) if rows[mid]["compiles"] else (lo, mid)
    out = {"last_compiling": rows[lo], "first_refused": rows[hi], "host_memory": host_memory_rows(mesh)}
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    a, r = rows[lo], rows[hi]
    print(
        f"last L that compiles: {lo}: arguments + outputs - aliases + temp_size = {a['args_plus_temp_size_gib']:.2f} "
        f"GiB, peak_memory_in_bytes = {a['peak_memory_gib']:.2f} GiB, HBM {r['hbm_gib']:.2f} GiB"
    )
    print(f"first L refused: {hi}: the compiler's required figure {r['required_gib']:.2f} GiB ({r['message']})")
    print(
        "enforced: "
        + (
            "peak_memory_in_bytes"
            if a["peak_memory_gib"] <= r["hbm_gib"] * 1.0001 < a["args_plus_temp_size_gib"]
            else "inconclusive"
        )
    )
    for h in out["host_memory"]:
        what = f"{h['host_gib']} GiB host + {h['device_gib']} GiB device arguments per chip" + (
            ", the host ones brought in and sent back" if h["brought_in"] else ""
        )
        print(
            f"{what}: "
            + (
                f"compiles, peak_memory_in_bytes {h['peak_memory_gib']:.2f} GiB (host arguments "
                f"{h['host_arguments_gib']:.2f}, device arguments {h['arguments_gib']:.2f})"
                if h["compiles"]
                else f"refused ({h['message']})"
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
