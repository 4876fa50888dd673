"""`stare-jax train --run-dir DIR [--config FILE] [--resume [--allow-config-change]] [KEY=VALUE ...]`: RL training
(GRPO-ds or STARE) of a config. A stop signal ends it after the step under way, saved: the last line (stderr) names
the signal and the checkpoint; exit status 130 for Ctrl-C, 0 for a preemption's SIGTERM."""

from __future__ import annotations

import argparse
import sys

from stare_jax.cli.common import UsageError, add_config_args, add_distributed_args
from stare_jax.cli.signals import stop_status
from stare_jax.config.loader import load_config
from stare_jax.toy.assets import run_inputs
from stare_jax.training.loop import run_training


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", required=True, help="output folder: metrics.jsonl, checkpoints/, config.yaml, ...")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in RUN_DIR if it has one, else start a new run there",
    )
    p.add_argument(
        "--require-checkpoint",
        action="store_true",
        help="with --resume: fail (instead of starting fresh) when RUN_DIR has no checkpoint",
    )
    p.add_argument(
        "--allow-config-change",
        action="store_true",
        help="with --resume: continue even though the config differs from the run's config.yaml in keys "
        "that change what is trained (without it such a resume is refused; the change is recorded "
        "in RUN_DIR/config_changes.jsonl)",
    )
    add_distributed_args(p)
    add_config_args(p)


def run(args) -> int:
    if args.require_checkpoint and not args.resume:
        raise UsageError("--require-checkpoint only applies with --resume: add --resume, or drop it")
    if args.allow_config_change and not args.resume:
        raise UsageError("--allow-config-change only applies with --resume: add --resume, or drop it")
    cfg = load_config(args.config, args.overrides)
    summary = run_training(
        cfg,
        args.run_dir,
        resume=args.resume,
        require_checkpoint=args.require_checkpoint,
        allow_config_change=args.allow_config_change,
        distributed=(args.coordinator_address, args.num_processes, args.process_id),
        inputs_for=run_inputs,
    )
    print(f"train: {summary['steps_run']} steps in {summary['wall_s']:.1f}s; outputs in {summary['run_dir']}")
    if summary["stopped"]:  # the last line: which signal, the checkpoint; Ctrl-C exits 130, SIGTERM 0
        print(
            f"stare-jax train: {summary['stop_reason']}: saved checkpoint {summary['checkpoint']}; continue with "
            f"the same command plus --resume",
            file=sys.stderr,
            flush=True,
        )
        return stop_status(summary["stop_signal"])
    return 0
