"""The long-CoT and tool configs' train step compiled for their TPU slice in three train-batch layouts - padded (as
the configs are), packed (rl.packing), packed + optimizer offload (rl.offload.optimizer) - beside `stare-jax plan`'s
estimate with the same overrides (BUILD.md, "Long CoT: padding vs packing vs packing + optimizer offload").

    python benchmarks/aot_layouts.py [--only SUBSTRING ...] [--out-dir DIR] [--json]

The padded rows are benchmarks/aot_paper_configs.py's reports (--out-dir, default .cache/aot/CONFIG.json: run that
first); the other layouts compile only their train step (`--reuse-sampler` that report: the sampler programs do not
depend on rl.*). Each compile runs `stare-jax plan CONFIG OVERRIDES --compile --json` in its own process.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

from aot_paper_configs import REPO, plan_compile

GiB = 1024**3

# (config, micro_batch_tokens of the packed layouts: the padded configs' micro-batch in tokens)
CONFIGS = [
    ("r1-distill-qwen-1.5b_stare_o1", 16384),
    ("r1-distill-qwen-1.5b_grpo_ds", 16384),
    ("qwen3-8b-base_stare_o1", 16384),
    ("qwen3-8b-base_grpo_ds", 16384),
    ("qwen2.5-7b-tool_stare_o1", 36864),
]
LAYOUTS = {
    "padded": [],
    "packed": ["rl.packing.enabled=true", "rl.micro_batch_tokens={mbt}"],
    "packed + offload": ["rl.packing.enabled=true", "rl.micro_batch_tokens={mbt}", "rl.offload.optimizer=true"],
}


def compile_layout(config: str, overrides: list[str], padded_report: pathlib.Path) -> dict:
    """`stare-jax plan CONFIG OVERRIDES --compile --json --reuse-sampler PADDED` in its own process."""
    return plan_compile([f"configs/paper/{config}.yaml", *overrides, "--reuse-sampler", str(padded_report)])


def row(config: str, layout: str, overrides: list[str], r: dict) -> str:
    """One markdown row: train step peak compiled / estimate, its args / temp, host bytes, sampling phase,
    headroom, fits, train-step compile seconds, the command."""
    from stare_jax.config.loader import load_config
    from stare_jax.planning.estimate import estimate, phase_peaks

    if "error" in r:
        return f"| {config} | {layout} | {r['error']} | | | | | no | | |"
    est = phase_peaks(estimate(load_config(REPO / "configs" / "paper" / f"{config}.yaml", overrides)))
    t = r["compiled"]["train_step"]
    s_peak, t_peak = r["phases"]["sampling"]["peak_bytes"], r["phases"]["training"]["peak_bytes"]
    hbm = r["hbm_bytes_per_device"]
    cmd = f"`stare-jax plan configs/paper/{config}.yaml {' '.join(overrides)} --compile --json`".replace("  ", " ")
    return (
        f"| {config} | {layout} | {t_peak / GiB:.2f} / {est['training'] / GiB:.1f} | "
        f"{t['argument_bytes'] / GiB:.2f} / {t['temp_bytes'] / GiB:.2f} | {t.get('host_bytes', 0) / GiB:.2f} | "
        f"{s_peak / GiB:.1f} / {est['sampling'] / GiB:.1f} | {1 - max(s_peak, t_peak) / hbm:.0%} | "
        f"{'yes' if r['fits'] else 'NO'} | {t['compile_s']:.0f} | {cmd} |"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=[], help="config-name substrings (default: all five)")
    ap.add_argument("--out-dir", default=str(REPO / ".cache" / "aot"))
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    out_dir = pathlib.Path(args.out_dir)
    lines = [
        "| config | layout | train step peak: compiled / estimate | train step args / temp | host | sampling "
        "phase: compiled / estimate | headroom | fits (>= 10%) | train step compile s | command |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | :---: | ---: | --- |",
    ]
    reports = {}
    for config, mbt in CONFIGS:
        if args.only and not any(s in config for s in args.only):
            continue
        padded = out_dir / f"{config}.json"
        if not padded.is_file():
            print(f"{padded} missing: run benchmarks/aot_paper_configs.py first", file=sys.stderr)
            return 2
        for layout, over in LAYOUTS.items():
            if "grpo_ds" in config and layout != "packed":
                continue  # the GRPO-ds arms: the packed layout only (STARE off changes the step, not the layout)
            overrides = [o.format(mbt=mbt) for o in over]
            r = json.loads(padded.read_text()) if not overrides else compile_layout(config, overrides, padded)
            reports[f"{config} {layout}"] = r
            lines.append(row(config, layout, overrides, r))
            print(lines[-1], file=sys.stderr, flush=True)
    print(json.dumps(reports, indent=1) if args.json else "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
