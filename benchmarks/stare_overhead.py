"""STARE overhead: train-step time of STARE-O1 (gate on) vs GRPO-ds on the same batch, and the cost of the
surprisal selection itself at 1M and 16M tokens on a (2 x 4) mesh.

Default: a small model/batch that runs on 2 CPU cores in a couple of minutes. `--preset issue` is the ~50M-param,
64 x 512-token setting (use an accelerator). On CPU the selection part uses 8 fake host devices.

    .venv/bin/python benchmarks/stare_overhead.py [--preset small|issue] [--repeats 5] [--json]
           [--selection-tokens 1048576,16777216] [--skip-step] [--skip-selection]

Both parts time their sides interleaved through benchmarks/harness.py (an untimed warm-up call each, then A B A B
...; min/median/max, load average before/after, thread settings; `busy` when the load exceeded the core count).
The step ratio is GRPO-ds time / STARE-O1 time (speed of STARE-O1 relative to GRPO-ds: 1.0 = no overhead).
"""

from __future__ import annotations

import argparse
import builtins
import os
import sys
import time

if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import dataclasses  # noqa: E402
import functools  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from harness import add_harness_args, compare, emit  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from stare_jax.models import ModelConfig, init_model  # noqa: E402
from stare_jax.rl.stare import StareConfig, StareState, init_stare_state, stare_omega  # noqa: E402
from stare_jax.rl.step import OptimizerConfig, TrainStepConfig, init_train_state, make_train_step  # noqa: E402

print = functools.partial(print, flush=True)  # noqa: A001 (progress visible when piped)

PRESETS = {
    # name: (model kwargs, batch, seq_len, num_micro_batches)
    "small": (
        dict(vocab_size=2048, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=384),
        16,
        256,
        1,
    ),
    "issue": (
        dict(vocab_size=32768, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=8, intermediate_size=2048),
        64,
        512,
        4,
    ),
}


def _batch(rng, B, L, V):
    ids = rng.integers(0, V, (B, L)).astype(np.int32)
    attn = np.ones((B, L), np.int32)
    resp = np.zeros((B, L), np.int32)
    resp[:, L // 4 :] = 1
    adv = rng.normal(size=B).astype(np.float32)
    return dict(input_ids_BxT=ids, attention_mask_BxT=attn, response_mask_BxT=resp, advantages_B=adv)


def bench_step(preset, iters):
    mkw, B, L, n_micro = PRESETS[preset]
    mcfg = ModelConfig(
        **mkw,
        tie_word_embeddings=False,
        max_position_embeddings=max(L, 64),
        dtype="bfloat16" if jax.default_backend() != "cpu" else "float32",
    )
    model = init_model(mcfg, seed=0)
    from flax import nnx

    n_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    batch = _batch(np.random.default_rng(0), B, L, mcfg.vocab_size)
    stare = StareConfig(enabled=True, variant="O1", target_entropy=1e3)  # gate always on
    configs = {"GRPO-ds": dataclasses.replace(stare, enabled=False), "STARE-O1 (gate on)": stare}
    print(
        f"[step] preset={preset} params={n_params / 1e6:.1f}M batch={B}x{L} micro_batches={n_micro} "
        f"backend={jax.default_backend()}"
    )
    steps, costs = {}, {}
    for name, scfg in configs.items():
        cfg = TrainStepConfig(optimizer=OptimizerConfig(lr=1e-6), stare=scfg, num_micro_batches=n_micro)
        graphdef, ts = init_train_state(model, cfg)
        step = make_train_step(graphdef, cfg, donate=False)
        ss = init_stare_state(scfg)
        costs[name] = compiled_cost(step, ts, batch, ss)
        t0 = time.perf_counter()
        jax.block_until_ready(step(ts, batch, ss))
        print(f"[step] {name:20s} first call incl. compile {time.perf_counter() - t0:.1f} s")
        steps[name] = lambda step=step, ts=ts, ss=ss: step(ts, batch, ss)
    res = compare(steps, repeats=iters, label=f"train step ({preset})", reference="GRPO-ds")
    r = res["ratios"]["STARE-O1 (gate on)"]["ratio_of_medians"]
    print(f"[step] STARE-O1 / GRPO-ds step time = {1 / r:.4f}  (overhead {100 * (1 / r - 1):+.2f}%)")
    ref, side = costs["GRPO-ds"], costs["STARE-O1 (gate on)"]
    res["compiled_cost_ratio"] = {k: side[k] / ref[k] for k in ref if ref[k]}
    print(
        "[step] compiled cost STARE-O1 / GRPO-ds (XLA cost analysis, no timing noise): "
        + ", ".join(f"{k} {v:.4f}" for k, v in res["compiled_cost_ratio"].items())
    )
    return res


def compiled_cost(step, *args) -> dict[str, float]:
    """flops, bytes accessed and transcendentals of the compiled step (XLA's cost analysis): the work a side does,
    which timing noise on a shared machine cannot blur."""
    cost = step.lower(*args).compile().cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return {k: float(cost.get(k, 0.0)) for k in ("flops", "bytes accessed", "transcendentals")}


def bench_selection(tokens_list, iters, seq=4096):
    devs = jax.devices()
    shape = (2, 4) if len(devs) >= 8 else (1, len(devs))
    mesh = jax.make_mesh(
        shape, ("data", "fsdp"), axis_types=(jax.sharding.AxisType.Auto,) * 2, devices=devs[: shape[0] * shape[1]]
    )
    sh2 = NamedSharding(mesh, P(("data", "fsdp"), None))
    sh1 = NamedSharding(mesh, P(("data", "fsdp")))
    print(f"[selection] mesh {dict(mesh.shape)} backend={jax.default_backend()}")
    out = []
    for n_tok in tokens_list:
        B = max(n_tok // seq, shape[0] * shape[1])
        T = n_tok // B
        key = jax.random.key(1)
        k1, k2 = jax.random.split(key)
        make = jax.jit(
            lambda: (
                -jax.random.gamma(k1, 0.6, (B, T)) * 1.5,
                jax.random.normal(k2, (B,)),
                jnp.ones((B, T), jnp.float32),
            ),
            out_shardings=(sh2, sh1, sh2),
        )
        lp, adv, mask = make()
        fns = {}
        for rule in ("quantile", "exact_top_k"):
            cfg = StareConfig(enabled=True, variant="O1", rule=rule)
            state = StareState(
                gate_on=jnp.asarray(True), w=jnp.float32(cfg.w), m=jnp.float32(cfg.m), last_entropy=jnp.float32(0.0)
            )
            f = jax.jit(lambda a, b, c, cfg=cfg, state=state: stare_omega(a, b, c, state, cfg)[0], out_shardings=sh2)
            fns[rule] = lambda f=f, xs=(lp, adv, mask): f(*xs)
        out.append(
            compare(
                fns, repeats=iters, label=f"selection {B * T / 2**20:.0f}M tokens ({B}x{T})", reference="exact_top_k"
            )
        )
        print(
            f"[selection] {B * T / 2**20:5.1f}M tokens: quantile median "
            f"{out[-1]['sides']['quantile']['median_s'] * 1e3:.1f} ms, exact_top_k "
            f"{out[-1]['sides']['exact_top_k']['median_s'] * 1e3:.1f} ms"
        )
        del fns
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small", choices=sorted(PRESETS))
    ap.add_argument("--iters", type=int, default=None, help="old name of --repeats")
    ap.add_argument("--selection-tokens", default="1048576,16777216")
    ap.add_argument("--skip-step", action="store_true")
    ap.add_argument("--skip-selection", action="store_true")
    add_harness_args(ap, repeats=5)
    args = ap.parse_args(argv)
    repeats = args.iters if args.iters is not None else args.repeats
    if args.json:  # progress lines to stderr, the JSON record alone on stdout
        globals()["print"] = functools.partial(builtins.print, flush=True, file=sys.stderr)
    comparisons = []
    if not args.skip_step:
        comparisons.append(bench_step(args.preset, repeats))
    if not args.skip_selection:
        comparisons += bench_selection([int(x) for x in args.selection_tokens.split(",")], repeats)
    result = {"benchmark": "stare_overhead", "preset": args.preset, "comparisons": comparisons}
    emit(result, args.json)
    return result


if __name__ == "__main__":
    main()
