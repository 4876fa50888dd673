"""`stare-jax demo`: the README's main job, both arms of the embedded CPU default, the overlaid plot and the summary
table."""

from __future__ import annotations

import argparse
import sys

from stare_jax.cli.common import add_config_args
from stare_jax.experiments.demo import SCENARIOS, run_demo


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", default="runs/demo")
    p.add_argument(
        "--scenario",
        default="default",
        choices=sorted(SCENARIOS),
        help="default: the digit-set task; tool: multi-turn tool use with the code interpreter "
        "(tool_mul task) (default: %(default)s)",
    )
    add_config_args(p)


def run(args) -> int:
    if args.config:
        print(
            "stare-jax demo: --config is not used (the demo runs configs/tiny_cpu_*.yaml); pass KEY=VALUE "
            "overrides instead",
            file=sys.stderr,
        )
        return 2
    run_demo(args.run_dir, args.overrides, scenario=args.scenario)
    return 0
