"""`stare-jax plot RUN_DIR [RUN_DIR ...] [--out PNG]`: overlaid curves + summary table (a folder of runs: its
runs). The PNG is RUN_DIR/plot.png by default: a name no other command writes, so plotting the demo's folder leaves
its curves.png (titled, named in its summary.md) as it was."""

from __future__ import annotations

import argparse

from stare_jax.cli.common import UsageError
from stare_jax.experiments.plot import (
    DEFAULT_PLOT_NAME,
    default_plot_path,
    expand_run_dirs,
    is_run_dir,
    load_run,
    plot_runs,
    summary_table,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    p.add_argument(
        "--out",
        default=None,
        help=f"PNG path (default RUN_DIR/{DEFAULT_PLOT_NAME}, or ./{DEFAULT_PLOT_NAME} for several RUN_DIRs)",
    )
    p.add_argument("--target-entropy", type=float, default=None)


def run(args) -> int:
    run_dirs = expand_run_dirs(args.run_dirs)
    for d in run_dirs:
        if not d.is_dir():
            raise UsageError(f"run folder {d} does not exist")
        if not is_run_dir(d):
            raise UsageError(
                f"{d} holds no metrics.jsonl and no sub-folder does: give run folders written by "
                f"`stare-jax train --run-dir` or `stare-jax demo --run-dir`"
            )
        try:
            load_run(d)
        except ValueError as e:  # a bad line or no step records: the message names the file and line
            raise UsageError(str(e)) from None
    if len(run_dirs) > len(args.run_dirs):
        print(f"plot: {', '.join(map(str, args.run_dirs))} -> runs {', '.join(map(str, run_dirs))}")
    # one folder (a run, or the demo's folder of runs): the PNG goes in it, as plot.png (the demo's curves.png stays)
    out = args.out if args.out is not None else default_plot_path(args.run_dirs)
    out = plot_runs(run_dirs, out, target_entropy=args.target_entropy)
    print(summary_table(run_dirs, target_entropy=args.target_entropy), end="")
    print(f"wrote {out}")
    return 0
