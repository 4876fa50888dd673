"""Compiled temporary memory of the chunked log-prob/entropy pass vs naive full [B, T, V] logits.

Only lowers and compiles (never runs): XLA's memory_analysis().temp_size_in_bytes for
  - forward: (logprobs, entropy) of all positions,
  - forward+backward: grad of sum(logprobs * a) + sum(entropy * b) w.r.t. hidden and unembed,
at Qwen-like sizes (V = 151936, T = 4096, hidden 1536 by default). Goal: chunked / naive <= 1/8.

    .venv/bin/python benchmarks/logprob_memory.py [--batch 1] [--seq 4096] [--vocab 151936] [--hidden 1536]
                                                  [--chunk 256] [--dtype bfloat16] [--json]

Nothing is timed, so nothing is interleaved: the figures are the compiler's and do not move with the load.
`--json` prints the rows with the machine state (benchmarks/harness.py) on stdout.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from harness import emit  # noqa: E402

from stare_jax.rl.logprobs import naive_logprobs_and_entropy, token_logprobs_and_entropy  # noqa: E402


def temp_bytes(fn, *args):
    compiled = jax.jit(fn).lower(*args).compile()
    mem = compiled.memory_analysis()
    return int(mem.temp_size_in_bytes)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--chunk", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="hidden-state dtype")
    ap.add_argument(
        "--param-dtype",
        default="float32",
        choices=["bfloat16", "float32"],
        help="unembed table dtype (fp32 master weights by default)",
    )
    ap.add_argument("--json", action="store_true", help="print the rows as JSON on stdout (text to stderr)")
    args = ap.parse_args(argv)
    out = sys.stderr if args.json else sys.stdout
    dt = jnp.dtype(args.dtype)
    B, T, V, D = args.batch, args.seq, args.vocab, args.hidden
    h = jax.ShapeDtypeStruct((B, T, D), dt)
    w = jax.ShapeDtypeStruct((V, D), jnp.dtype(args.param_dtype))
    t = jax.ShapeDtypeStruct((B, T), jnp.int32)
    m = jax.ShapeDtypeStruct((B, T), jnp.float32)

    def chunked(hh, ww, tt, mm):
        return token_logprobs_and_entropy(hh, ww, tt, mm, chunk_size=args.chunk)

    def naive(hh, ww, tt, mm):
        return naive_logprobs_and_entropy(hh, ww, tt, mm)

    def grad_of(fn):
        def g(hh, ww, tt, mm):
            def loss(hh, ww):
                lp, ent = fn(hh, ww, tt, mm)
                return jnp.sum(lp * mm) + jnp.sum(ent * mm)

            return jax.grad(loss, argnums=(0, 1))(hh, ww)

        return g

    logits_gib = B * T * V * 4 / 2**30
    print(
        f"backend={jax.default_backend()} B={B} T={T} V={V} D={D} dtype={args.dtype} "
        f"param_dtype={args.param_dtype} chunk={args.chunk} (one fp32 [B,T,V] logits array = {logits_gib:.2f} GiB)",
        file=out,
    )
    rows = []
    for name, fc, fn in (("forward", chunked, naive), ("forward+backward", grad_of(chunked), grad_of(naive))):
        c = temp_bytes(fc, h, w, t, m)
        n = temp_bytes(fn, h, w, t, m)
        rows.append({"pass": name, "chunked_temp_bytes": c, "naive_temp_bytes": n, "ratio": c / max(n, 1)})
        print(
            f"{name:17s} chunked temp = {c / 2**20:10.1f} MiB   naive temp = {n / 2**20:10.1f} MiB   "
            f"ratio = {c / max(n, 1):.4f}  (goal <= {1 / 8:.3f})",
            file=out,
        )
    if args.json:
        emit(
            {
                "benchmark": "logprob_memory",
                "batch": B,
                "seq": T,
                "vocab": V,
                "hidden": D,
                "chunk": args.chunk,
                "rows": rows,
                "comparisons": [],
            },
            as_json=True,
        )
    return rows


if __name__ == "__main__":
    main()
