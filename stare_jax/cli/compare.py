"""`stare-jax compare`: the entropy-control methods on the embedded CPU default: compare.png + compare.md/json in
the run folder."""

from __future__ import annotations

import argparse
import sys

from stare_jax.cli.common import UsageError, add_config_args
from stare_jax.cli.signals import stop_status
from stare_jax.experiments.compare import DEFAULT_METHODS, METHODS, parse_methods, run_compare


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", default="runs/compare")
    p.add_argument(
        "--methods",
        default=",".join(DEFAULT_METHODS),
        help=f"comma-separated, from: {', '.join(METHODS)} (default: %(default)s)",
    )
    p.add_argument("--seeds", default="0", help="comma-separated seeds (default: %(default)s)")
    add_config_args(p)


def run(args) -> int:
    if args.config:
        raise UsageError(
            "--config is not used (compare runs configs/tiny_cpu_<method>.yaml); pass KEY=VALUE overrides instead"
        )
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--seeds {args.seeds!r}: expected comma-separated integers, e.g. 0,1,2") from None
    result = run_compare(args.run_dir, parse_methods(args.methods), seeds, args.overrides)
    if result["stopped"]:  # interrupted and saved: the last line says which signal and where; Ctrl-C exits 130
        print(f"stare-jax compare: {result['stopped']}; run the same command again to continue", file=sys.stderr)
        return stop_status(result.get("stop_signal"))
    return 0
