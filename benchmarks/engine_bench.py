"""Rollout engine (continuous batching, paged KV) vs the static Sampler: useful tokens/s on CPU, side by side.

    JAX_PLATFORMS=cpu .venv/bin/python -m benchmarks.engine_bench                  # defaults below
    JAX_PLATFORMS=cpu .venv/bin/python -m benchmarks.engine_bench --prompts 8 --max-new 64 --reps 2 --json

Workload: --prompts prompts (lengths uniform in [--min-prompt, --max-prompt]) x --group samples, temperature 1,
the same random stare_jax Qwen2-shaped model (small initializer_range: near-uniform next-token distribution)
for both. --eos-ids (8) token ids end a row, so each step ends a row with probability ~8/vocab: response lengths
are geometric (long-tailed: median ~ vocab/8 * ln 2, a few rows run to --max-new). Both engines draw the same
keys, so they produce exactly the same tokens (checked on a first call of each, which also compiles). Useful
tokens = the generated tokens (EOS included), not padding. Timing: benchmarks/harness.py, --reps interleaved
calls A B A B ... after that first call; min / median / max per side, tokens/s from the median, the load average,
CPU count and thread settings, `busy` when the machine was oversubscribed. kv_bytes_static is the static
sampler's preallocated cache (batch x (prompt bucket + new-token bucket) slots), kv_bytes_engine the engine's page
pool and kv_peak_bytes_engine its peak pages in use.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from harness import compare, format_comparison  # noqa: E402


def _parse():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-new", type=int, default=192)
    ap.add_argument("--min-prompt", type=int, default=20)
    ap.add_argument("--max-prompt", type=int, default=100)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--slots", type=int, default=16, help="sampling.engine.max_slots")
    ap.add_argument("--page-size", type=int, default=16, help="sampling.engine.page_size")
    ap.add_argument("--num-pages", type=int, default=0, help="sampling.engine.num_pages (0 = auto)")
    ap.add_argument("--chunk", type=int, default=16, help="sampling.engine.decode_chunk")
    ap.add_argument("--prefill-chunk", type=int, default=128, help="sampling.engine.prefill_chunk")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return ap.parse_args()


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def main():
    args = _parse()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax.numpy as jnp

    from stare_jax.models import ModelConfig, init_model
    from stare_jax.sampling import Sampler
    from stare_jax.sampling.engine import Engine, EngineConfig, kv_bytes
    from stare_jax.sampling.sampler import new_token_bucket, next_bucket

    cfg = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=args.heads,
                      num_kv_heads=args.kv_heads, intermediate_size=args.intermediate, qkv_bias=True,
                      max_position_embeddings=4096, initializer_range=0.02, pad_token_id=0)
    model = init_model(cfg, seed=args.seed)
    rng = np.random.default_rng(args.seed)
    lens = rng.integers(args.min_prompt, args.max_prompt + 1, size=args.prompts)
    prompts = [rng.integers(10, args.vocab, size=n).tolist() for n in lens]
    eos = list(range(1, 9))
    kw = dict(max_new_tokens=args.max_new, num_samples=args.group, temperature=1.0, eos_ids=eos, seed=args.seed)
    static = Sampler(model)
    econf = EngineConfig(max_slots=args.slots, page_size=args.page_size, num_pages=args.num_pages,
                         decode_chunk=args.chunk, prefill_chunk=args.prefill_chunk)
    engine = Engine(model, config=econf)
    sides = {"static": lambda: static.generate(prompts, **kw), "engine": lambda: engine.generate(prompts, **kw)}
    warm = {name: _timed(fn) for name, fn in sides.items()}  # compilation
    ref, out = warm["static"][1], warm["engine"][1]
    if ref.tokens != out.tokens:
        raise SystemExit("engine and static sampler produced different tokens")
    useful = sum(out.lengths)
    cmp = compare(sides, repeats=args.reps, warmup=0, reference="static", label="engine / static sampler",
                  units=useful, unit_name="tokens")
    med = {n: cmp["sides"][n]["median_s"] for n in sides}
    kv_item = jnp.dtype(static.cache_dtype).itemsize
    slots_static = next_bucket(max(lens), static.min_prompt_bucket) + new_token_bucket(args.max_new, 16)
    rows_static = static.batch_bucket(args.prompts) * args.group
    kv_static = slots_static * rows_static * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * kv_item
    page_bytes = kv_bytes(engine) // engine.pool.num_pages
    result = {
        "comparison": cmp,
        "workload": {"prompts": args.prompts, "group": args.group, "max_new": args.max_new,
                     "prompt_lens": [int(min(lens)), int(max(lens))], "useful_tokens": useful,
                     "lengths_median": float(np.median(out.lengths)), "lengths_max": int(max(out.lengths)),
                     "rows_at_max": int(sum(n == args.max_new for n in out.lengths))},
        "model": {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab},
        "engine_config": {"max_slots": args.slots, "page_size": args.page_size, "num_pages": engine.pool.num_pages,
                          "decode_chunk": args.chunk, "prefill_chunk": args.prefill_chunk},
        "compile_s": {n: round(w[0], 2) for n, w in warm.items()},
        "tokens_per_s_engine": useful / med["engine"], "tokens_per_s_static": useful / med["static"],
        "speedup": med["static"] / med["engine"],
        "kv_bytes_static": int(kv_static), "kv_bytes_engine": kv_bytes(engine),
        "kv_peak_bytes_engine": int(engine.stats["peak_pages"] * page_bytes),
        "engine_stats": engine.stats,
    }
    if args.json:
        print(json.dumps(result))
        return
    print(format_comparison(cmp))
    print(f"workload {result['workload']}  (compile + first call: {result['compile_s']})")
    print(f"speedup engine/static {result['speedup']:.2f}x   kv bytes static {kv_static:,}  engine pool "
          f"{result['kv_bytes_engine']:,}  engine peak {result['kv_peak_bytes_engine']:,}")
    print(f"engine stats {engine.stats}")


if __name__ == "__main__":
    main()
