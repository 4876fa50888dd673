"""What the subcommand modules share, without heavy imports: the one-line usage error and the argument groups
that several commands take."""

from __future__ import annotations

import argparse


class UsageError(Exception):
    """A wrong input found by a subcommand: `stare-jax CMD: <message naming the fix>` on stderr, exit status 2."""


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="YAML config file (default: built-in defaults)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. rl.stare.w=1.2")


def add_distributed_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--coordinator-address", default=None, help="multi-process: HOST:PORT of process 0")
    p.add_argument("--num-processes", type=int, default=None, help="multi-process: total number of processes")
    p.add_argument("--process-id", type=int, default=None, help="multi-process: this process's index")
