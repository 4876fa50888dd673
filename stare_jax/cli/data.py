"""`stare-jax data list` and `stare-jax data prepare NAME [NAME ...|all] [--out DIR] [--from-local PATH]`: public
math datasets from the Hugging Face hub (GSM8K, MATH, MATH-500, AIME 2024/2025, AMC 2023, Minerva, OlympiadBench,
DAPO-Math-17k) written as the project's jsonl files, under the names `stare-jax eval` and the configs read
(stare_jax.data.prepare: the registry, the converters, the download). Downloading needs the optional 'data' extra
(`pip install 'stare-jax[data]'`); --from-local converts a local copy in the hub's format without it, offline."""

from __future__ import annotations

import argparse
import sys

from stare_jax.cli.common import UsageError
from stare_jax.data.prepare import DATASETS, PrepareError, prepare, resolve_names

DEFAULT_OUT = "data/math"  # the folder `stare-jax eval --data-dir` and the configs read by default


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="data_command", required=True, metavar="{list,prepare}")
    sub.add_parser("list", help="the datasets: name, Hugging Face hub id, split, output file")
    prep = sub.add_parser(
        "prepare",
        help="download datasets from the Hugging Face hub and write them as jsonl rows "
        '{"id", "problem", "answer", "source", ...}',
    )
    prep.add_argument("names", nargs="+", metavar="NAME", help=f"{', '.join(DATASETS)}, or all")
    prep.add_argument("--out", default=DEFAULT_OUT, help="folder to write the jsonl files into (default: %(default)s)")
    prep.add_argument(
        "--from-local",
        default=None,
        metavar="PATH",
        help="convert a local copy instead of downloading (one NAME): the dataset's file in the hub's format "
        "(.parquet or .jsonl), or a folder laid out like the hub repo",
    )


def run(args) -> int:
    if args.data_command == "list":
        rows = [("name", "hub dataset", "split", "output file")]
        rows += [(d.name, d.repo, d.split, d.out_file) for d in DATASETS.values()]
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        for r in rows:
            print("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[3])
        return 0
    try:
        names = resolve_names(args.names)
        if args.from_local is not None and len(names) > 1:
            raise UsageError(f"--from-local converts one dataset's file: name one dataset, not {' '.join(names)}")
        for name in names:
            if args.from_local is None:  # the hub client retries quietly for ~20 s before a network error
                print(f"stare-jax data: {name}: downloading {DATASETS[name].repo} ...", file=sys.stderr, flush=True)
            print(prepare(name, args.out, from_local=args.from_local).summary(), flush=True)
    except PrepareError as e:
        raise UsageError(str(e)) from None
    return 0
