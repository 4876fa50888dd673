"""STARE overhead: train-step time of STARE-O1 (gate on) vs GRPO-ds on the same batch, and the cost of the
surprisal selection itself at 1M and 16M tokens on a (2 x 4) mesh.

Default: a small model/batch that runs on 2 CPU cores in a couple of minutes. `--preset issue` is the ~50M-param,
64 x 512-token setting (use an accelerator). On CPU the selection part uses 8 fake host devices.

    .venv/bin/python benchmarks/stare_overhead.py [--preset small|issue] [--iters 3]
           [--selection-tokens 1048576,16777216] [--skip-step] [--skip-selection]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import dataclasses  # noqa: E402
import functools  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from stare_jax.models import ModelConfig, init_model  # noqa: E402
from stare_jax.rl.stare import StareConfig, StareState, init_stare_state, stare_omega  # noqa: E402
from stare_jax.rl.train_step import OptimizerConfig, TrainStepConfig, init_train_state, make_train_step  # noqa: E402

print = functools.partial(print, flush=True)  # noqa: A001 (progress visible when piped)

PRESETS = {
    # name: (model kwargs, batch, seq_len, num_micro_batches)
    "small": (dict(vocab_size=2048, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                   intermediate_size=384), 16, 256, 1),
    "issue": (dict(vocab_size=32768, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=8,
                   intermediate_size=2048), 64, 512, 4),
}


def _batch(rng, B, L, V):
    ids = rng.integers(0, V, (B, L)).astype(np.int32)
    attn = np.ones((B, L), np.int32)
    resp = np.zeros((B, L), np.int32)
    resp[:, L // 4:] = 1
    adv = rng.normal(size=B).astype(np.float32)
    return dict(input_ids_BxT=ids, attention_mask_BxT=attn, response_mask_BxT=resp, advantages_B=adv)


def _time(fn, iters):
    out = fn()  # compile + warm-up
    jax.block_until_ready(out)
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        ts.append(time.perf_counter() - t)
    return float(np.median(ts)), ts


def bench_step(preset, iters):
    mkw, B, L, n_micro = PRESETS[preset]
    mcfg = ModelConfig(**mkw, tie_word_embeddings=False, max_position_embeddings=max(L, 64),
                       dtype="bfloat16" if jax.default_backend() != "cpu" else "float32")
    model = init_model(mcfg, seed=0)
    from flax import nnx
    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    batch = _batch(np.random.default_rng(0), B, L, mcfg.vocab_size)
    stare = StareConfig(enabled=True, variant="O1", target_entropy=1e3)  # gate always on
    configs = {"GRPO-ds": dataclasses.replace(stare, enabled=False), "STARE-O1 (gate on)": stare}
    print(f"[step] preset={preset} params={n_params / 1e6:.1f}M batch={B}x{L} micro_batches={n_micro} "
          f"backend={jax.default_backend()}")
    steps = {}
    for name, scfg in configs.items():
        cfg = TrainStepConfig(optimizer=OptimizerConfig(lr=1e-6), stare=scfg, num_micro_batches=n_micro)
        graphdef, ts = init_train_state(model, cfg)
        step = make_train_step(graphdef, cfg, donate=False)
        ss = init_stare_state(scfg)
        t0 = time.perf_counter()
        jax.block_until_ready(step(ts, batch, ss))
        print(f"[step] {name:20s} first call incl. compile {time.perf_counter() - t0:.1f} s")
        steps[name] = (lambda step=step, ts=ts, ss=ss: step(ts, batch, ss))
    times = {name: [] for name in steps}
    for _ in range(iters):  # interleaved, so load changes on a shared machine hit both alike
        for name, fn in steps.items():
            t = time.perf_counter()
            jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - t)
    results = {name: float(np.median(ts_)) for name, ts_ in times.items()}
    for name, ts_ in times.items():
        print(f"[step] {name:20s} median {results[name] * 1e3:9.1f} ms  (runs {[round(t * 1e3, 1) for t in ts_]})")
    g, s = results["GRPO-ds"], results["STARE-O1 (gate on)"]
    print(f"[step] STARE-O1 / GRPO-ds step time = {s / g:.4f}  (overhead {100 * (s / g - 1):+.2f}%)")
    return results


def bench_selection(tokens_list, iters, seq=4096):
    devs = jax.devices()
    shape = (2, 4) if len(devs) >= 8 else (1, len(devs))
    mesh = jax.make_mesh(shape, ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                         devices=devs[:shape[0] * shape[1]])
    sh2 = NamedSharding(mesh, P(("data", "fsdp"), None))
    sh1 = NamedSharding(mesh, P(("data", "fsdp")))
    print(f"[selection] mesh {dict(mesh.shape)} backend={jax.default_backend()}")
    out = {}
    for n_tok in tokens_list:
        B = max(n_tok // seq, shape[0] * shape[1])
        T = n_tok // B
        key = jax.random.key(1)
        k1, k2 = jax.random.split(key)
        make = jax.jit(lambda: (-jax.random.gamma(k1, 0.6, (B, T)) * 1.5,
                                jax.random.normal(k2, (B,)), jnp.ones((B, T), jnp.float32)),
                       out_shardings=(sh2, sh1, sh2))
        lp, adv, mask = make()
        for rule in ("quantile", "exact_top_k"):
            cfg = StareConfig(enabled=True, variant="O1", rule=rule)
            state = StareState(gate_on=jnp.asarray(True), w=jnp.float32(cfg.w), m=jnp.float32(cfg.m),
                               last_entropy=jnp.float32(0.0))
            f = jax.jit(lambda a, b, c, cfg=cfg, state=state: stare_omega(a, b, c, state, cfg)[0],
                        out_shardings=sh2)
            med, all_t = _time(lambda: f(lp, adv, mask), iters)
            out[(n_tok, rule)] = med
            print(f"[selection] {B * T / 2**20:5.1f}M tokens ({B}x{T}) rule={rule:11s} median {med * 1e3:9.1f} ms "
                  f"(runs {[round(t * 1e3, 1) for t in all_t]})")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small", choices=sorted(PRESETS))
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--selection-tokens", default="1048576,16777216")
    ap.add_argument("--skip-step", action="store_true")
    ap.add_argument("--skip-selection", action="store_true")
    args = ap.parse_args(argv)
    if not args.skip_step:
        bench_step(args.preset, args.iters)
    if not args.skip_selection:
        bench_selection([int(x) for x in args.selection_tokens.split(",")], args.iters)


if __name__ == "__main__":
    main()
