"""`stare-jax plan CONFIG [--accelerator A] [--compile [--topology T]] [--json]`: memory/FLOP estimate (or the TPU
compiler's own figures) of a config on an accelerator; --sft: CONFIG is an SFT config, its step compiled
(--compile)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys

from stare_jax.cli.common import UsageError
from stare_jax.config.loader import load_config
from stare_jax.planning.estimate import LengthModel, estimate, format_plan
from stare_jax.training import aot
from stare_jax.training.setup import TrainingError
from stare_jax.training.sft import load_sft_config


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("config_file", metavar="CONFIG")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    p.add_argument("--accelerator", default=None, help="e.g. v5p-64 or 2x8xH100 (default: launch.accelerator)")
    p.add_argument(
        "--compile",
        action="store_true",
        help="compile every program of the run for the config's TPU slice on this host (needs libtpu) "
        "and print the compiler's memory/FLOP figures beside the estimate",
    )
    p.add_argument(
        "--topology",
        default=None,
        help="TPU topology to compile for, e.g. v5p:2x4x4 or v6e:2x2 (default: from launch.accelerator; "
        "implies --compile)",
    )
    p.add_argument(
        "--reuse-sampler",
        default=None,
        metavar="REPORT_JSON",
        help="with --compile: take the sampler and weight-reshard figures from an earlier --json report "
        "of a config with the same sampler_key (same model, mesh, sampling, slice; e.g. another "
        "arm of the same setting) and compile only the train step",
    )
    p.add_argument(
        "--sft",
        action="store_true",
        help="CONFIG is a `stare-jax sft` config: with --compile, compile its SFT step for its slice",
    )
    p.add_argument(
        "--response-median",
        type=float,
        default=None,
        metavar="TOKENS",
        help="rl.packing's estimate: median response length of the assumed lognormal (default max_new_tokens / 8)",
    )
    p.add_argument("--response-sigma", type=float, default=1.0, help="its sigma (default 1.0)")
    p.add_argument(
        "--prompt-tokens", type=int, default=None, help="assumed prompt length (default data.max_prompt_len / 4)"
    )
    p.add_argument("--json", action="store_true", help="machine-readable output")


def run(args) -> int:
    if args.sft:
        return _plan_sft(args)
    cfg = load_config(args.config_file, args.overrides)
    if args.compile or args.topology or args.reuse_sampler:
        return _plan_compiled(cfg, args)
    try:
        lengths = LengthModel(args.response_median, args.response_sigma, args.prompt_tokens)
        plan = estimate(cfg, args.accelerator, lengths=lengths)
    except ValueError as e:
        print(f"stare-jax plan: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan, indent=1) if args.json else format_plan(plan))
    return 0


def _plan_compiled(cfg, args) -> int:
    """`plan --compile`: the compiler's figures for the config's TPU slice (stare_jax.training.aot)."""
    cfg = _with_accelerator(cfg, args.accelerator)
    reuse = None
    if args.reuse_sampler:
        try:
            reuse = json.loads(pathlib.Path(args.reuse_sampler).read_text())
        except (OSError, ValueError) as e:
            raise UsageError(f"--reuse-sampler {args.reuse_sampler}: not a readable JSON report ({e})") from None
    try:
        report = aot.compile_run(cfg, topology=args.topology, reuse_sampler=reuse, log=_log(args))
    except (aot.CompileError, TrainingError, ValueError) as e:
        print(f"stare-jax plan --compile: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=1) if args.json else aot.format_compiled(report))
    return 0


def _plan_sft(args) -> int:
    """`plan --sft CONFIG --compile`: the compiler's figures for an SFT config's step on its TPU slice."""
    if not (args.compile or args.topology):
        raise UsageError("--sft has no analytic estimate: add --compile (or --topology T)")
    if args.reuse_sampler:
        raise UsageError("--reuse-sampler is for run configs (an SFT config has no sampler)")
    cfg = _with_accelerator(load_sft_config(args.config_file, args.overrides), args.accelerator)
    try:
        report = aot.compile_sft(cfg, topology=args.topology, log=_log(args))
    except (aot.CompileError, ValueError) as e:
        print(f"stare-jax plan --sft --compile: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=1) if args.json else aot.format_compiled(report))
    return 0


def _with_accelerator(cfg, accelerator: str | None):
    """`cfg` with launch.accelerator set to --accelerator when given."""
    if not accelerator:
        return cfg
    return dataclasses.replace(cfg, launch=dataclasses.replace(cfg.launch, accelerator=accelerator))


def _log(args):
    """Progress lines: on stderr with --json (stdout is the report), else on stdout."""
    return (lambda m: print(m, file=sys.stderr)) if args.json else print
