"""`stare-jax convert GGUF_FILE OUT_DIR`: a GGUF checkpoint (e.g. SmolLM2) as a Hugging Face folder."""

from __future__ import annotations

import argparse
import pathlib

from stare_jax.cli.common import UsageError
from stare_jax.models.gguf_convert import convert_gguf_to_hf


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("gguf")
    p.add_argument("out_dir")


def run(args) -> int:
    if not pathlib.Path(args.gguf).is_file():
        raise UsageError(f"GGUF file {args.gguf} not found")
    if pathlib.Path(args.out_dir).exists():
        raise UsageError(f"{args.out_dir} exists: choose a new OUT_DIR or delete it")
    try:
        out = convert_gguf_to_hf(args.gguf, args.out_dir)
    except ImportError as e:  # the optional 'convert' extra is not installed
        raise UsageError(str(e)) from None
    print(f"wrote Hugging Face folder {out}")
    return 0
