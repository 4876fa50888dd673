"""`stare-jax demo`: the README's main job, both arms of the embedded CPU default, the overlaid plot and the summary
table. Exit status 1 when a check of the summary fails (its last line names which), 0 when all pass; a stop signal
ends it after saving the step under way (the last line names the checkpoint): 130 for Ctrl-C, 0 for SIGTERM."""

from __future__ import annotations

import argparse
import sys

from stare_jax.cli.common import add_config_args
from stare_jax.cli.signals import stop_status
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
    result = run_demo(args.run_dir, args.overrides, scenario=args.scenario)
    if result["stopped"]:  # interrupted and saved: the last line says which signal and where; Ctrl-C exits 130
        print(f"stare-jax demo: {result['stopped']}; run the same command again to continue", file=sys.stderr)
        return stop_status(result.get("stop_signal"))
    # a demo whose claims do not hold on this machine ends with the verdict line and a non-zero status
    return 0 if all(c.passed for c in result["checks"]) else 1
