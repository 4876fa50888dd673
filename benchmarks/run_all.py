"""Run every peer-comparing benchmark (each in its own process, default settings, `--json`) and print one table.

    .venv/bin/python benchmarks/run_all.py [--json] [--only model_fwd_bwd,sampler_bench] [--out results.json]
    .venv/bin/python benchmarks/run_all.py --from a.json b.json      # the table of records saved with --out

One row per comparison: the speed ratio of a side against its reference (median time of the reference / median
time of the side: > 1 means the side is faster), the ratio of medians and the median (min-max) of the per-round
ratios of the interleaved rounds, the load average before/after, `BUSY` where it exceeded the core count, and the
threads each framework used. logprob_memory compiles only: its rows are compiled temp-memory ratios. Each
benchmark's default run (rollout_engine: --quick) is sized to finish in about 3 minutes on a quiet 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BENCHMARKS = (
    "model_fwd_bwd",
    "sampler_bench",
    "stare_overhead",
    "stare_select_impls",
    "reward_throughput",
    "sandbox_throughput",
    "logprob_memory",
    "rollout_engine",
)
EXTRA_ARGS = {"rollout_engine": ["--quick"]}  # its full workload takes ~25 min on 2 cores: run it on its own


def run_one(name: str, timeout_s: float, extra: list[str]) -> dict:
    """One benchmark in a fresh process (its own JAX / XLA flags); its JSON record, or an error record."""
    cmd = [sys.executable, os.path.join(HERE, f"{name}.py"), "--json", *extra]
    env = dict(os.environ, JAX_PLATFORMS=os.environ.get("JAX_PLATFORMS", "cpu"))
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, stdout=subprocess.PIPE, stderr=None, text=True, timeout=timeout_s, env=env, cwd=os.path.dirname(HERE)
        )
    except subprocess.TimeoutExpired:
        return {"benchmark": name, "error": f"timed out after {timeout_s:.0f} s", "wall_s": timeout_s}
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"benchmark": name, "error": f"exit status {proc.returncode}", "wall_s": wall}
    rec = parse_record(proc.stdout)
    if rec is None:
        return {"benchmark": name, "error": "no JSON record on stdout", "wall_s": wall}
    rec["wall_s"] = wall
    return rec


def parse_record(stdout: str) -> dict | None:
    """The benchmark's JSON record: the whole stdout, else its last line that parses as a JSON object."""
    for text in [stdout] + stdout.splitlines()[::-1]:
        try:
            rec = json.loads(text)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict):
            return rec
    return None


def _threads(threads: dict) -> str:
    parts = []
    if "torch" in threads:
        parts.append(f"torch {threads['torch']['num_threads']}")
    if "jax" in threads:
        parts.append(f"jax {threads['jax']['backend']} x{threads['jax']['devices']}")
    return ", ".join(parts) or "-"


def table_rows(rec: dict) -> list[str]:
    """Markdown rows for one benchmark record."""
    name = rec["benchmark"]
    if "error" in rec:
        return [f"| {name} | - | ERROR: {rec['error']} | | | | | |"]
    rows = []
    for r in rec.get("rows", []) if name == "logprob_memory" else []:
        rows.append(
            f"| {name} | {r['pass']} temp memory | chunked / naive = {r['ratio']:.4f} | compile-only | "
            f"{r['chunked_temp_bytes'] / 2**20:.0f} / {r['naive_temp_bytes'] / 2**20:.0f} MiB | - | - | - |"
        )
    for c in rec.get("comparisons", []):
        ref = c["reference"]
        for side, r in c["ratios"].items():
            s, t = c["sides"][side], c["sides"][ref]
            rows.append(
                f"| {name} | {c['label']}: {side} / {ref} | {r['ratio_of_medians']:.3f} | "
                f"{r['median_of_pair_ratios']:.3f} ({r['pair_ratio_min']:.3f}-{r['pair_ratio_max']:.3f}), "
                f"{c['repeats']} rounds | {s['median_s']:.3f} / {t['median_s']:.3f} | "
                f"{c['loadavg_before'][0]:.2f} / {c['loadavg_after'][0]:.2f}"
                + (" BUSY" if c["busy"] else "")
                + f" | {c['cpus_usable']}/{c['cpu_count']} | {_threads(c['threads'])} |"
            )
    return rows


def table(records: list[dict]) -> str:
    head = [
        "| benchmark | comparison (side / reference) | speed ratio (of medians) | per-round ratio: median "
        "(min-max) | median s side / reference | load avg before / after | CPUs | threads |",
        "| --- | --- | ---: | --- | --- | --- | --- | --- |",
    ]
    return "\n".join(head + [row for rec in records for row in table_rows(rec)])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(BENCHMARKS), help="comma-separated benchmark names")
    ap.add_argument("--timeout-s", type=float, default=900, help="per benchmark")
    ap.add_argument("--json", action="store_true", help="print all records as one JSON object after the table")
    ap.add_argument("--out", default=None, help="also write all records as JSON to this file")
    ap.add_argument(
        "--from",
        dest="from_files",
        nargs="+",
        default=None,
        metavar="FILE",
        help="run nothing: print the table of records saved earlier with --out",
    )
    args = ap.parse_args(argv)
    if args.from_files:
        records = [rec for f in args.from_files for rec in json.load(open(f))["records"]]
        print(table(records))
        return records
    names = [n for n in args.only.split(",") if n]
    unknown = set(names) - set(BENCHMARKS)
    if unknown:
        raise SystemExit(f"unknown benchmarks {sorted(unknown)}; known: {BENCHMARKS}")
    records = []
    for name in names:
        print(f"=== {name} ===", file=sys.stderr, flush=True)
        records.append(run_one(name, args.timeout_s, EXTRA_ARGS.get(name, [])))
        print(f"=== {name}: {records[-1]['wall_s']:.0f} s ===", file=sys.stderr, flush=True)
        if args.out:  # after each benchmark, so an interrupted run keeps what it measured
            with open(args.out, "w") as f:
                json.dump({"records": records}, f, indent=1)
    text = table(records)
    busy = any(c.get("busy") for rec in records for c in rec.get("comparisons", []))
    if busy:
        text += (
            "\n\nWARNING: the load average exceeded the core count during at least one comparison (BUSY): "
            "these are not quiet-machine figures."
        )
    print(text)
    if args.json:
        print(json.dumps({"records": records}))
    return records


if __name__ == "__main__":
    main()
