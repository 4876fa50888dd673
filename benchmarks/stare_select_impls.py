"""STARE selection: select_impl "bisect" vs "jnp_quantile" on a (2 x 4) mesh at 1M and 16M tokens.

Times one jitted stare_omega call (STARE-O1, rule quantile, gate on) on [B, T] arrays sharded over the 8 devices,
the two implementations interleaved (A B A B ...) through benchmarks/harness.py so load changes on a shared machine
hit both alike; reports min / median / max per call, the compiled program's temp memory per device
(memory_analysis().temp_size_in_bytes), whether the two omegas agree, the load average before/after with the CPU
count and the thread settings (`busy` when the load exceeded the core count). Log-probs are rounded to bfloat16 (as
a bf16 trainer pass gives them), so ties are common. On CPU it uses 8 fake host devices.

    .venv/bin/python benchmarks/stare_select_impls.py [--tokens 1048576,16777216] [--repeats 3] [--seq 4096] [--json]
           [--aot-topology v5e:2x4]   # also compile both (no run) for a TPU slice: its compiled temp memory
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from harness import add_harness_args, compare, machine_state, thread_settings  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from stare_jax.rl.stare import StareConfig, StareState, stare_omega  # noqa: E402

IMPLS = ("bisect", "jnp_quantile")


def _omega_program(impl: str, out_sharding):
    """The jitted STARE-O1 omega (gate on) with selection implementation `impl`."""
    cfg = StareConfig(enabled=True, variant="O1", select_impl=impl)
    state = StareState(
        gate_on=jnp.asarray(True), w=jnp.float32(cfg.w), m=jnp.float32(cfg.m), last_entropy=jnp.float32(0.0)
    )
    return jax.jit(lambda a, b, c: stare_omega(a, b, c, state, cfg)[0], out_shardings=out_sharding)


def _inputs(n_tok: int, seq: int, sh2, sh1):
    B = max(n_tok // seq, 8)
    T = n_tok // B
    k1, k2, k3 = jax.random.split(jax.random.key(1), 3)

    def make():
        lp = (-jax.random.gamma(k1, 0.6, (B, T)) * 1.5).astype(jnp.bfloat16).astype(jnp.float32)
        lengths = jax.random.randint(k3, (B, 1), T // 4, T + 1)
        mask = (jnp.arange(T)[None, :] < lengths).astype(jnp.float32)
        return lp, jax.random.normal(k2, (B,)), mask

    return jax.jit(make, out_shardings=(sh2, sh1, sh2))(), (B, T)


def run(tokens_list, iters: int, seq: int, log=print) -> dict:
    devs = jax.devices()
    if len(devs) < 8:
        raise SystemExit(f"needs 8 devices, found {len(devs)}")
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2, devices=devs[:8])
    sh2, sh1 = NamedSharding(mesh, P(("data", "fsdp"), None)), NamedSharding(mesh, P(("data", "fsdp")))
    meta = {
        "backend": jax.default_backend(),
        "devices": 8,
        "mesh": dict(mesh.shape),
        "jax": jax.__version__,
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "loadavg_before": os.getloadavg(),
        "iters": iters,
    }
    rows, comparisons = [], []
    for n_tok in tokens_list:
        (lp, adv, mask), (B, T) = _inputs(n_tok, seq, sh2, sh1)
        fns, outs = {}, {}
        for impl in IMPLS:
            f = _omega_program(impl, sh2)
            t0 = time.perf_counter()
            compiled = f.lower(lp, adv, mask).compile()
            compile_s = time.perf_counter() - t0
            mem = compiled.memory_analysis()
            outs[impl] = jax.block_until_ready(compiled(lp, adv, mask))  # warm-up
            fns[impl] = compiled
            rows.append(
                {
                    "tokens": B * T,
                    "B": B,
                    "T": T,
                    "impl": impl,
                    "compile_s": compile_s,
                    "temp_bytes": int(mem.temp_size_in_bytes) if mem is not None else None,
                    "times_s": [],
                }
            )
        n_diff = int(jnp.sum(outs["bisect"] != outs["jnp_quantile"]))
        by_impl = {r["impl"]: r for r in rows[-len(IMPLS) :]}
        res = compare(
            {impl: (lambda f=fns[impl], xs=(lp, adv, mask): f(*xs)) for impl in IMPLS},
            repeats=iters,
            warmup=0,
            label=f"select_impl {B * T / 2**20:.0f}M tokens",
            reference="jnp_quantile",
        )
        comparisons.append(res)
        for impl, r in by_impl.items():
            side = res["sides"][impl]
            r.update(
                times_s=side["times_s"],
                min_s=side["min_s"],
                median_s=side["median_s"],
                max_s=side["max_s"],
                omega_tokens_differing=n_diff,
            )
            log(
                f"  {r['tokens'] / 2**20:5.1f}M tokens ({B}x{T}) {r['impl']:12s} median {r['median_s'] * 1e3:9.1f} ms"
                f"  temp {r['temp_bytes'] / 2**20:8.1f} MiB/device"
            )
        del lp, adv, mask, fns, outs
    meta.update(loadavg_after=os.getloadavg(), threads=thread_settings(), busy=any(c["busy"] for c in comparisons))
    return {"benchmark": "stare_select_impls", "meta": meta, "rows": rows, "comparisons": comparisons}


def aot(topology: str, tokens_list, seq: int, log=print) -> list[dict]:
    """Compile both implementations for a TPU slice's abstract devices (libtpu; nothing runs): temp bytes/device."""
    from stare_jax.training.aot import get_topology

    devices = list(get_topology(topology).devices)
    shape = (2, len(devices) // 2) if len(devices) >= 2 else (1, 1)
    mesh = jax.make_mesh(shape, ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2, devices=devices)
    sh2, sh1 = NamedSharding(mesh, P(("data", "fsdp"), None)), NamedSharding(mesh, P(("data", "fsdp")))
    out = []
    for n_tok in tokens_list:
        B = max(n_tok // seq, 8)
        T = n_tok // B
        args = (
            jax.ShapeDtypeStruct((B, T), jnp.float32, sharding=sh2),
            jax.ShapeDtypeStruct((B,), jnp.float32, sharding=sh1),
            jax.ShapeDtypeStruct((B, T), jnp.float32, sharding=sh2),
        )
        for impl in IMPLS:
            f = _omega_program(impl, sh2)
            mem = f.lower(*args).compile().memory_analysis()
            out.append(
                {
                    "topology": topology,
                    "mesh": dict(mesh.shape),
                    "tokens": B * T,
                    "B": B,
                    "T": T,
                    "impl": impl,
                    "temp_bytes": int(mem.temp_size_in_bytes),
                }
            )
            log(
                f"  [aot {topology}] {B * T / 2**20:5.1f}M tokens {impl:12s} temp "
                f"{out[-1]['temp_bytes'] / 2**20:8.1f} MiB/device"
            )
    return out


def table(res: dict) -> str:
    m, lines = res["meta"], []
    if m:
        lines.append(
            f"fake {m['devices']}-device {m['backend']} mesh {m['mesh']}, {m['cpus_usable']} usable of "
            f"{m['cpu_count']} CPUs, load average {m['loadavg_before'][0]:.2f} before / "
            f"{m['loadavg_after'][0]:.2f} after, {m['iters']} interleaved calls each"
            + (" (BUSY: load above the core count)" if m.get("busy") else "")
        )
    lines += [
        "| tokens | select_impl | min ms | median ms | max ms | compiled temp MiB/device | omega differs |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in res["rows"]:
        temp = "n/a" if r["temp_bytes"] is None else f"{r['temp_bytes'] / 2**20:.1f}"
        lines.append(
            f"| {r['tokens'] / 2**20:.0f}M ({r['B']}x{r['T']}) | {r['impl']} | {r['min_s'] * 1e3:.1f} | "
            f"{r['median_s'] * 1e3:.1f} | {r['max_s'] * 1e3:.1f} | {temp} | {r['omega_tokens_differing']} |"
        )
    for r in res.get("aot", []):
        lines.append(
            f"| {r['tokens'] / 2**20:.0f}M, compiled for {r['topology']} {r['mesh']} | {r['impl']} | - | - "
            f"| - | {r['temp_bytes'] / 2**20:.1f} | - |"
        )
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="1048576,16777216")
    ap.add_argument("--iters", type=int, default=None, help="old name of --repeats")
    ap.add_argument("--seq", type=int, default=4096, help="T of the [B, T] arrays")
    ap.add_argument("--aot-topology", default=None, help="also compile for this TPU slice, e.g. v5e:2x4 (libtpu)")
    ap.add_argument("--skip-run", action="store_true", help="only the --aot-topology compile")
    add_harness_args(ap, repeats=3)
    args = ap.parse_args(argv)
    iters = args.iters if args.iters is not None else args.repeats

    def log(*a):
        print(*a, file=sys.stderr, flush=True)

    tokens = [int(x) for x in args.tokens.split(",")]
    res = {"meta": {}, "rows": []} if args.skip_run else run(tokens, iters, args.seq, log=log)
    if args.aot_topology:
        res["aot"] = aot(args.aot_topology, tokens, args.seq, log=log)
    if args.json:
        print(table(res), file=sys.stderr)
        print(json.dumps(dict(res, machine=machine_state()), default=float))
    else:
        print(table(res))


if __name__ == "__main__":
    main()
