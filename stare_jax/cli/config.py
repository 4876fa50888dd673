"""`stare-jax config [--config FILE] [KEY=VALUE ...]`: print the resolved configuration."""

from __future__ import annotations

import argparse

import yaml

from stare_jax.cli.common import add_config_args
from stare_jax.config.loader import load_config, to_dict


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_args(p)


def run(args) -> int:
    cfg = load_config(args.config, args.overrides)
    print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
    return 0
