"""`stare-jax export RUN_DIR OUT_DIR [--step S] [--merged]`: a training run's checkpoint (or an HF folder) as an HF
folder; a LoRA run as a PEFT adapter folder (--merged: the merged weights as an HF folder)."""

from __future__ import annotations

import argparse
import pathlib

from stare_jax.cli.common import UsageError
from stare_jax.toy.assets import run_inputs
from stare_jax.training.policy import export_policy


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir")
    p.add_argument("out_dir")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    p.add_argument(
        "--merged",
        action="store_true",
        help="a LoRA run: write the full HF folder with the adapters merged into the weights (default: a "
        "PEFT adapter folder over the run's base)",
    )


def run(args) -> int:
    if "://" not in str(args.run_dir) and not pathlib.Path(args.run_dir).is_dir():
        raise UsageError(
            f"{args.run_dir} is not a folder: give a training run folder (config.yaml + checkpoints/) "
            f"or a Hugging Face folder"
        )
    out_dir = pathlib.Path(args.out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise UsageError(f"{out_dir} exists and is not empty: choose a new OUT_DIR or delete it")
    out = export_policy(args.run_dir, args.out_dir, step=args.step, merged=args.merged, inputs_for=run_inputs)
    print(
        f"wrote {'a PEFT adapter folder' if (out / 'adapter_config.json').is_file() else 'Hugging Face folder'} {out}"
    )
    return 0
