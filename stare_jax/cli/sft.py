"""`stare-jax sft --config FILE [KEY=VALUE ...]`: cold-start SFT on multi-turn conversations (loss on assistant
tokens only), written as an HF folder an RL config's model.path points at."""

from __future__ import annotations

import argparse

from stare_jax.cli.common import UsageError, add_config_args, add_distributed_args
from stare_jax.training.setup import init_distributed
from stare_jax.training.sft import load_sft_config, run_conversation_sft


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_config_args(p)
    add_distributed_args(p)


def run(args) -> int:
    if not args.config:
        raise UsageError(
            "--config FILE is required: a YAML mapping with model.path, train_path, out_dir and the "
            "other sft options (see configs/sft_tool_cold_start.yaml)"
        )
    cfg = load_sft_config(args.config, args.overrides)
    init_distributed(args.coordinator_address, args.num_processes, args.process_id)
    run_conversation_sft(cfg)
    return 0
