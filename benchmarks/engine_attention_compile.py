"""The rollout engine's decode program compiled ahead of time for a TPU slice on this CPU host, with the gather
path vs jax's Pallas paged-attention kernel (sampling.engine.attention): the compiler's per-chip memory figures
(memory_analysis) and whether the Mosaic kernel is in the program. Needs libtpu (requirements-test.txt).

    python benchmarks/engine_attention_compile.py [--config configs/paper/qwen2.5-7b-tool_stare_o1.yaml]
        [--topology v5p:2x2x1] [--prefill] [--json]

Each backend is one decode compile (a 7B program: minutes and several GB of host memory). The full run
(`stare-jax plan CONFIG --compile`) compiles the train step, the weight reshard and both engine programs with the
config's own attention (auto: pallas on a TPU with head_dim % 128 == 0 and a bfloat16 KV cache).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

GiB = 1024**3
FIELDS = ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes", "generated_code_bytes", "peak_bytes")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="configs/paper/qwen2.5-7b-tool_stare_o1.yaml")
    ap.add_argument("--topology", default=None, help="libtpu topology (default: the config's launch.accelerator)")
    ap.add_argument("--prefill", action="store_true", help="also compile the prefill program (gathers either way)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    from stare_jax.config.loader import load_config
    from stare_jax.training import aot

    cfg = load_config(args.config)
    out = {}
    for attention in ("gather", "pallas"):
        r = aot.compile_engine(
            cfg,
            topology=args.topology,
            attention=attention,
            prefill=args.prefill,
            log=lambda m: print(m, file=sys.stderr),
        )
        out[attention] = {
            "topology": r["topology"],
            "mesh": r["mesh"],
            **{name: {k: p[k] for k in (*FIELDS, "mosaic_kernels", "compile_s")} for name, p in r["compiled"].items()},
        }
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    first = next(iter(out.values()))
    print(f"{args.config}: engine programs for {first['topology']} (mesh {first['mesh']}), GiB per chip")
    print(
        f"  {'attention':<10}{'program':<17}"
        + "".join(f"{f.split('_')[0][:8]:>10}" for f in FIELDS)
        + f"{'mosaic':>8}{'compile s':>11}"
    )
    for attention, r in out.items():
        for name in ("sampler", "sampler_prefill"):
            if name in r:
                p = r[name]
                print(
                    f"  {attention:<10}{('decode' if name == 'sampler' else 'prefill'):<17}"
                    + "".join(f"{p[f] / GiB:10.2f}" for f in FIELDS)
                    + f"{p['mosaic_kernels']:8d}"
                    + f"{p['compile_s']:11.1f}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
