"""Sandbox throughput: calls/s of `print(1)` through SandboxPool at 1, 2 and 4 workers.

Every call is a fresh sandboxed process (stare_jax.tools.sandbox.run_python: namespaces, a new root, a uid of
its own, rlimits; see `sandbox_capabilities()`), so this is the cost of one tool call of the multi-turn rollout
apart from the code's own work. The three pool sizes are timed interleaved through benchmarks/harness.py (an
untimed warm-up batch each, then 1 2 4 1 2 4 ...; load average before/after, CPU count, `busy` when the load
exceeded the core count); the ratios are each pool's speed against the 1-worker pool.

    .venv/bin/python benchmarks/sandbox_throughput.py [--calls 32] [--workers 1,2,4] [--repeats 3]
                                                      [--isolation auto|rlimits] [--python PATH] [--json]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import add_harness_args, compare, emit  # noqa: E402

from stare_jax.tools import SandboxPool, sandbox_capabilities  # noqa: E402


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=32, help="print(1) calls per timed batch")
    ap.add_argument("--workers", default="1,2,4", help="pool sizes, comma-separated (the first is the reference)")
    ap.add_argument("--timeout-s", type=float, default=10.0)
    ap.add_argument("--isolation", choices=("auto", "namespaces", "rlimits"), default="auto")
    ap.add_argument("--python", default=None, help="interpreter of the sandboxed code (default: this one)")
    add_harness_args(ap, repeats=3)
    args = ap.parse_args(argv)
    out = sys.stderr if args.json else sys.stdout
    sizes = [int(w) for w in args.workers.split(",")]
    caps = sandbox_capabilities(args.python)
    isolation = caps["isolation"] if args.isolation == "auto" else args.isolation
    print(
        f"{args.calls} x print(1) per batch; isolation {isolation}; python {caps['python']}; {os.cpu_count()} CPUs",
        file=out,
    )

    pools = {
        f"{n} worker{'s' * (n > 1)}": SandboxPool(
            n, timeout_s=args.timeout_s, python=args.python, isolation=args.isolation
        )
        for n in sizes
    }
    failures: dict[str, int] = {}

    def batch(name: str):
        def run():
            results = pools[name].map(["print(1)"] * args.calls)
            bad = sum(r.stdout != "1\n" or not r.ok for r in results)
            failures[name] = failures.get(name, 0) + bad

        return run

    try:
        res = compare(
            {name: batch(name) for name in pools},
            repeats=args.repeats,
            reference=next(iter(pools)),
            label=f"sandbox print(1) calls ({isolation})",
            units=args.calls,
            unit_name="calls",
        )
    finally:
        for pool in pools.values():
            pool.close()
    if any(failures.values()):
        print(f"!!! failed calls per pool: {failures}", file=sys.stderr)
    result = {
        "benchmark": "sandbox_throughput",
        "calls": args.calls,
        "isolation": isolation,
        "python": caps["python"],
        "failed_calls": failures,
        "calls_per_s": {name: s["calls_per_s"] for name, s in res["sides"].items()},
        "comparisons": [res],
    }
    emit(result, args.json)
    return result


if __name__ == "__main__":
    main()
