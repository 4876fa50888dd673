"""Compile every paper config (configs/paper/*.yaml) for its TPU slice on this CPU host and tabulate the compiler's
per-chip peaks beside the analytic estimate (the BUILD.md table, and the calibration error of `stare-jax plan`).

    python benchmarks/aot_paper_configs.py [--only SUBSTRING ...] [--out-dir DIR] [--fresh] [--no-reuse] [--json]

Each config is compiled by `stare-jax plan CONFIG --compile --json` in its own process, one at a time (a 7B-32B
compile needs several GB of host memory), and its JSON report kept in --out-dir (default .cache/aot/, reused
when newer than the config and the code unless --fresh). Needs libtpu (requirements-test.txt).

The arms of one setting (GRPO-ds, STARE-O1, STARE-C2) differ only under rl.stare, so they run the same sampler and
weight-reshard programs (same aot.sampler_key: model, mesh, sampling section, slice): once one arm's report
exists, the others compile only their train step (`--reuse-sampler`), which saves the 5-20 minute sampler compile
per arm; `--no-reuse` compiles everything.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
GiB = 1024**3


def paper_configs(only: list[str]) -> list[pathlib.Path]:
    """The paper's run configs (not the cold-start SFT config: `stare-jax plan --sft CONFIG --compile`)."""
    from stare_jax.config.loader import is_sft_config_file

    files = sorted(
        p
        for p in (REPO / "configs" / "paper").glob("*.yaml")
        if not p.name.startswith("_") and not is_sft_config_file(p)
    )
    return [p for p in files if not only or any(s in p.name for s in only)]


def sampler_source(config: pathlib.Path, out_dir: pathlib.Path, newer_than: float = 0.0) -> pathlib.Path | None:
    """A report of another config with the same sampler_key as `config` (another arm of its setting), written after
    `newer_than` (the code's mtime: a report compiled by older code may hold other sampler programs), if any; a
    report from before sampler keys were recorded gets the key of the config it was compiled from."""
    from stare_jax.config.loader import load_config
    from stare_jax.training.aot import sampler_key, topology_for

    def key(path: pathlib.Path) -> str:
        cfg = load_config(path)
        return sampler_key(cfg, topology_for(cfg.launch.accelerator))

    mine = key(config)
    for other in paper_configs([]):
        report = out_dir / f"{other.stem}.json"
        if other == config or not report.is_file() or report.stat().st_mtime <= newer_than:
            continue
        data = json.loads(report.read_text())
        if "error" in data or data.get("sampler_reused"):
            continue
        if data.get("sampler_key", key(other)) == mine:
            data["sampler_key"] = mine
            tmp = out_dir / f".sampler_of_{config.stem}.json"
            tmp.write_text(json.dumps(data))
            return tmp
    return None


def compile_one(config: pathlib.Path, out: pathlib.Path, fresh: bool, reuse: bool = True) -> dict:
    """The report of one config (compiled now, or the cached one)."""
    code_mtime = max(p.stat().st_mtime for p in (REPO / "stare_jax").rglob("*.py"))
    if out.is_file() and not fresh and out.stat().st_mtime > max(code_mtime, config.stat().st_mtime):
        return json.loads(out.read_text())
    source = sampler_source(config, out.parent, newer_than=code_mtime) if reuse else None
    report = plan_compile([str(config), *(["--reuse-sampler", str(source)] if source else [])])
    out.write_text(json.dumps(report, indent=1))
    return report


def plan_compile(args: list[str]) -> dict:
    """`stare-jax plan ARGS --compile --json` in its own process: its report with `wall_s`, or {"error": the last
    line it printed to stderr, "wall_s"}."""
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "stare_jax.cli", "plan", *args, "--compile", "--json"],
        capture_output=True,
        text=True,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
        cwd=REPO,
    )
    if proc.returncode != 0:
        err = [ln for ln in proc.stderr.splitlines() if ln.strip()][-1:] or ["(no message)"]
        return {"error": err[0], "wall_s": time.time() - t0}
    report = json.loads(proc.stdout)
    report["wall_s"] = time.time() - t0
    return report


def estimate_phases(config: pathlib.Path) -> dict:
    """The analytic model's per-phase peaks now (same phase definitions as the compiled ones)."""
    from stare_jax.config.loader import load_config
    from stare_jax.planning.estimate import estimate, phase_peaks

    return phase_peaks(estimate(load_config(config)))


def table(rows: list[tuple[pathlib.Path, dict]]) -> str:
    lines = [
        "| config | slice (topology) | sampling peak GiB: compiled / estimate | training peak GiB: compiled / "
        "estimate | HBM GiB | headroom | fits (>= 10%) | compile s |",
        "| --- | --- | ---: | ---: | ---: | ---: | :---: | ---: |",
    ]
    for config, r in rows:
        name = config.stem
        if "error" in r:
            lines.append(f"| {name} | | {r['error']} | | | | no | |")
            continue
        est = estimate_phases(config)
        hbm = r["hbm_bytes_per_device"]
        s, t = r["phases"]["sampling"]["peak_bytes"], r["phases"]["training"]["peak_bytes"]
        # compile time of what was compiled for this config (a reused sampler's time is not counted again)
        compile_s = sum(
            p["compile_s"] for k, p in r["compiled"].items() if k == "train_step" or not r.get("sampler_reused")
        )
        lines.append(
            f"| {name} | {r['accelerator']} ({r['topology']}) | {s / GiB:.1f} / {est['sampling'] / GiB:.1f} | "
            f"{t / GiB:.1f} / {est['training'] / GiB:.1f} | {hbm / GiB:.1f} | {1 - max(s, t) / hbm:.0%} | "
            f"{'yes' if r['fits'] else 'NO'} | {compile_s:.0f}{'*' if r.get('sampler_reused') else ''} |"
        )
    return "\n".join(lines)


def calibration(rows: list[tuple[pathlib.Path, dict]]) -> dict:
    """Relative error of the estimate vs the compiled figure per phase: (estimate - compiled) / compiled."""
    errs = {}
    for config, r in rows:
        if "error" in r:
            continue
        est = estimate_phases(config)
        errs[config.stem] = {
            ph: (est[ph] - r["phases"][ph]["peak_bytes"]) / r["phases"][ph]["peak_bytes"]
            for ph in ("sampling", "training")
        }
    return errs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=[], help="config-name substrings to compile (default: all)")
    ap.add_argument("--out-dir", default=str(REPO / ".cache" / "aot"))
    ap.add_argument("--fresh", action="store_true", help="recompile even when a newer report exists")
    ap.add_argument(
        "--no-reuse",
        action="store_true",
        help="compile every program of every config (no sampler reuse between the arms of a setting)",
    )
    ap.add_argument("--cached-only", action="store_true", help="tabulate the reports already in --out-dir")
    ap.add_argument("--json", action="store_true", help="print the rows and calibration as JSON")
    args = ap.parse_args(argv)
    out_dir = pathlib.Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for config in paper_configs(args.only):
        if args.cached_only:
            if (out_dir / f"{config.stem}.json").is_file():
                rows.append((config, json.loads((out_dir / f"{config.stem}.json").read_text())))
            continue
        print(f"compiling {config.name} ...", file=sys.stderr, flush=True)
        rows.append((config, compile_one(config, out_dir / f"{config.stem}.json", args.fresh, not args.no_reuse)))
    cal = calibration(rows)
    if args.json:
        print(json.dumps({"rows": {c.stem: r for c, r in rows}, "calibration": cal}, indent=1))
        return 0
    print(table(rows))
    worst = max((abs(e) for c in cal.values() for e in c.values()), default=float("nan"))
    print(f"\nestimate vs compiled, worst relative error over {len(cal)} configs and both phases: {worst:.0%}")
    for name, c in cal.items():
        print(f"  {name:<40} sampling {c['sampling']:+.0%}  training {c['training']:+.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
