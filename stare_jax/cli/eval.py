"""`stare-jax eval --checkpoint DIR --benchmarks a,b [--limit N] [--n N] [--tool on [--config RUN.yaml]]
[tool.KEY=VALUE ...]`: avg@N / pass@k / mean length per benchmark for an HF folder or a training run's checkpoint
(multi-turn with the code interpreter with --tool on).

The options that are run-config keys are read through the config loader: each of those flags is a KEY=VALUE
override of its key (FLAG_KEYS) on the config defaults, so the defaults and the range checks are the config's.
The tool section comes from --config, else the run folder's config.yaml, else the defaults, with tool.KEY=VALUE
overrides on top."""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import sys
import time

import jax

from stare_jax.cli.common import UsageError, add_distributed_args
from stare_jax.config.loader import Config, load_config
from stare_jax.data.prompts import PromptRow
from stare_jax.data.tokenizer import load_tokenizer
from stare_jax.eval.benchmarks import DEFAULT_PROTOCOL, format_results_json, format_results_markdown, load_benchmark
from stare_jax.eval.runner import EvalProgress, EvalSet, evaluate_sets
from stare_jax.models.sharding import make_mesh
from stare_jax.sampling import Engine, next_bucket
from stare_jax.sampling.engine import make_generator
from stare_jax.tools.config import ToolConfig, make_pool
from stare_jax.tools.rollout import tool_metrics
from stare_jax.toy.assets import run_inputs
from stare_jax.training.collect import RewardFn
from stare_jax.training.policy import load_policy
from stare_jax.training.setup import encode_rows, init_distributed

# flag (argparse dest) -> the run-config key it overrides; the flag's default is that key's default
FLAG_KEYS = {
    "n": "sampling.eval_num_samples",
    "max_new_tokens": "sampling.max_new_tokens",
    "max_prompt_len": "data.max_prompt_len",
    "prompt_template": "data.prompt_template",
    "engine": "sampling.engine.enabled",
    "slots": "sampling.engine.max_slots",
    "seed": "seed",
}
_ENGINE_VALUES = {"auto": "auto", "on": "true", "off": "false"}  # --engine -> sampling.engine.enabled
_DEFAULTS = Config()
DEFAULT_DATA_DIR = "data/math"  # what `stare-jax data prepare` writes by default (stare_jax.cli.data)
KS = (1, 4, 8, 16, 32)  # pass@k reported where k <= the samples per problem


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = _DEFAULTS
    p.add_argument("--checkpoint", required=True, help="HF folder or training run folder")
    p.add_argument(
        "--benchmarks",
        default="aime24,aime25,amc23,math500,minerva,olympiadbench",
        help=f"comma-separated, from: {', '.join(DEFAULT_PROTOCOL)} (default: %(default)s); each is read "
        f"from DATA_DIR/<file>: " + ", ".join(f"{k} {v['file']}" for k, v in DEFAULT_PROTOCOL.items()),
    )
    p.add_argument(
        "--data-dir",
        default=DEFAULT_DATA_DIR,
        help="folder with the benchmark jsonl files (default: %(default)s, relative to the current folder; "
        "`stare-jax data prepare NAME ... --out DIR` downloads them)",
    )
    p.add_argument("--limit", type=int, default=0, help="first N problems of each benchmark (default: 0 = all)")
    p.add_argument(
        "--n",
        "--samples",
        dest="n",
        type=int,
        default=None,
        help=f"samples per problem, sampling.eval_num_samples (default: {d.sampling.eval_num_samples} = "
        f"the paper's protocol: " + ", ".join(f"{k} {v['n']}" for k, v in DEFAULT_PROTOCOL.items()) + ")",
    )
    p.add_argument(
        "--temperature", type=float, default=None, help="sampling temperature (default: the protocol's 0.7; top-p 0.95)"
    )
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help=f"response budget in tokens, sampling.max_new_tokens (default: {d.sampling.max_new_tokens}); "
        f"prompt + response must fit the model's context (max_position_embeddings)",
    )
    p.add_argument(
        "--max-prompt-len",
        type=int,
        default=None,
        help=f"longest prompt accepted, data.max_prompt_len (default: {d.data.max_prompt_len})",
    )
    p.add_argument(
        "--prompt-template",
        choices=["paper", "chat", "raw"],
        default=None,
        help=f"paper instruction, the model's chat template, or the raw problem, data.prompt_template "
        f"(default: {d.data.prompt_template})",
    )
    p.add_argument("--batch-prompts", type=int, default=256, help="prompts per sampler call (default: %(default)s)")
    p.add_argument(
        "--engine",
        choices=list(_ENGINE_VALUES),
        default=None,
        help="generate with the rollout engine (continuous batching, paged KV), sampling.engine.enabled: "
        "auto = wherever it runs (any mesh, one process or several), else the static sampler "
        f"(default: {_engine_flag(d.sampling.engine.enabled)})",
    )
    p.add_argument(
        "--slots",
        type=int,
        default=None,
        help=f"the engine's decode slots, sampling.engine.max_slots (default: {d.sampling.engine.max_slots})",
    )
    p.add_argument("--workers", type=int, default=2, help="reward worker processes (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per scored item (default: %(default)s)")
    p.add_argument("--seed", type=int, default=None, help=f"sampling seed, the config key seed (default: {d.seed})")
    p.add_argument("--out", default=None, help="folder for eval.md and eval.json")
    p.add_argument(
        "--tensor",
        type=int,
        default=1,
        help="tensor-parallel size of the sampler on several devices (the rest shard the batch)",
    )
    p.add_argument(
        "--tool",
        choices=["auto", "on", "off"],
        default="auto",
        help="multi-turn rollouts with the code interpreter (the rollout engine + the sandbox; tool "
        "metrics in the output): on, off, or auto = as the tool section says (default: %(default)s)",
    )
    p.add_argument(
        "--config",
        default=None,
        help="a run config whose tool section (tool.*) the evaluation uses (default: the training run's "
        "own config.yaml when --checkpoint is a run folder, else the tool defaults)",
    )
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="tool.KEY=VALUE",
        help="tool overrides, e.g. tool.max_turns=8 tool.format=retool tool.timeout_s=10",
    )
    add_distributed_args(p)


def _engine_flag(enabled) -> str:
    return {True: "on", False: "off"}.get(enabled, "auto")


def run(args) -> int:
    """avg@N / pass@k / mean length per benchmark for an HF folder or a training run's checkpoint."""
    t0 = time.time()
    cfg = eval_config(args)
    names, data_dir = _benchmark_files(args)
    ckpt = pathlib.Path(args.checkpoint)
    if "://" not in args.checkpoint and not ckpt.is_dir():
        raise UsageError(
            f"--checkpoint {ckpt} is not a folder: give a Hugging Face folder (config.json) or a "
            f"training run folder (config.yaml + checkpoints/)"
        )
    cfg = dataclasses.replace(cfg, tool=tool_config(args, ckpt))
    if cfg.tool.enabled and cfg.sampling.engine.enabled is False:
        raise UsageError(
            "multi-turn tool rollouts (--tool on, or tool.enabled in the tool section) need the rollout "
            "engine: --engine auto or on"
        )
    init_distributed(args.coordinator_address, args.num_processes, args.process_id)
    n_dev = jax.device_count()
    if args.tensor < 1 or n_dev % args.tensor:
        raise UsageError(f"--tensor {args.tensor} does not divide the {n_dev} devices")
    # several devices (of one or more processes): the prompt batch over data x the weights over tensor
    mesh = make_mesh({"data": n_dev // args.tensor, "tensor": args.tensor}) if n_dev > 1 else None
    main = jax.process_index() == 0
    policy = load_policy(args.checkpoint, mesh=mesh, inputs_for=run_inputs, log=print if main else (lambda *_: None))
    tok = load_tokenizer(policy.tokenizer_path)
    sets, longest = _eval_sets(args, cfg, names, data_dir, tok)
    _check_context(
        cfg.sampling.max_new_tokens, longest, getattr(policy.model.config, "max_position_embeddings", None), warn=main
    )
    sampler = _sampler(cfg, policy.model, mesh, tok, verbose=main)
    results, table = _evaluate(args, cfg, sampler, sets, tok, prompt_len=next_bucket(longest, 16), verbose=main)
    if not main:  # every process computed the same gathered results; process 0 reports them
        return 0
    out = pathlib.Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / "eval.md").write_text(table)
        (out / "eval.json").write_text(format_results_json(results))
    print(table, end="")
    print(
        f"eval of {args.checkpoint} done in {time.time() - t0:.0f}s"
        + (f"; wrote {out}/eval.md, eval.json" if out else "")
    )
    return 0


def eval_config(args) -> Config:
    """The run config the evaluation reads its sampling, prompt and seed settings from: the defaults with each
    given FLAG_KEYS flag as a KEY=VALUE override of its key. The flags' ranges are checked first (UsageError
    naming the flag), as are those of the flags that are not config keys."""
    for flag, value, low in (
        ("--limit", args.limit, 0),
        ("--n", args.n, 0),
        ("--max-new-tokens", args.max_new_tokens, 1),
        ("--max-prompt-len", args.max_prompt_len, 1),
        ("--batch-prompts", args.batch_prompts, 1),
        ("--workers", args.workers, 1),
    ):
        if value is not None and value < low:
            raise UsageError(f"{flag} {value} must be >= {low}")
    overrides = [
        f"{key}={_ENGINE_VALUES[value] if dest == 'engine' else value}"
        for dest, key in FLAG_KEYS.items()
        for value in [getattr(args, dest)]
        if value is not None
    ]
    return load_config(None, overrides)


def _benchmark_files(args) -> tuple[list[str], pathlib.Path]:
    """The --benchmarks names and the --data-dir holding their files (UsageError naming an unknown name or a
    missing file)."""
    names = [b for b in args.benchmarks.split(",") if b]
    unknown = [b for b in names if b not in DEFAULT_PROTOCOL]
    if unknown or not names:
        raise UsageError(
            f"unknown benchmark(s) {unknown or [args.benchmarks]}; --benchmarks takes a comma-separated "
            f"list of {', '.join(DEFAULT_PROTOCOL)}"
        )
    data_dir = pathlib.Path(args.data_dir)
    missing = [DEFAULT_PROTOCOL[b]["file"] for b in names if not (data_dir / DEFAULT_PROTOCOL[b]["file"]).is_file()]
    if missing:
        absent = [b for b in names if DEFAULT_PROTOCOL[b]["file"] in missing]
        raise UsageError(
            f"no {', '.join(missing)} in --data-dir {data_dir} (resolved: {data_dir.resolve()}): download "
            f"{'it' if len(missing) == 1 else 'them'} with `stare-jax data prepare {' '.join(absent)} --out "
            f"{data_dir}`, or point --data-dir at the folder holding the benchmark jsonl files"
        )
    return names, data_dir


def tool_config(args, checkpoint: pathlib.Path) -> ToolConfig:
    """The evaluation's tool section: that of --config, else of the checkpoint's run folder (config.yaml), else
    the defaults; tool.KEY=VALUE overrides on top; --tool on / off sets tool.enabled (auto keeps it)."""
    bad = [o for o in args.overrides if not o.lstrip("-").startswith("tool.")]
    if bad:
        raise UsageError(f"eval takes tool.KEY=VALUE overrides only, got {' '.join(bad)}")
    if args.tool == "off":  # no config is read (an older run folder's config.yaml need not load)
        return ToolConfig()
    source = args.config
    if source is None and (checkpoint / "config.yaml").is_file() and not (checkpoint / "config.json").is_file():
        source = checkpoint / "config.yaml"  # a training run folder: its own tool section
    tool = load_config(source, args.overrides).tool
    return dataclasses.replace(tool, enabled=True) if args.tool == "on" else tool


def _eval_sets(args, cfg: Config, names: list[str], data_dir: pathlib.Path, tok) -> tuple[list[EvalSet], int]:
    """One EvalSet per benchmark (its first --limit problems, prompts encoded as training encodes them:
    training.setup.encode_rows) and the longest prompt's tokens. A prompt over data.max_prompt_len is a UsageError
    naming the length that would take it."""
    unbounded = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, max_prompt_len=sys.maxsize))
    max_len = cfg.data.max_prompt_len
    sets, longest = [], 1
    for name in names:
        proto = DEFAULT_PROTOCOL[name]
        try:
            rows = load_benchmark(data_dir / proto["file"])[: args.limit or None]
        except ValueError as e:  # a bad row: the message names the file and line
            raise UsageError(str(e)) from None
        where = str(data_dir / proto["file"])
        prompts, _ = encode_rows([PromptRow(r["id"], r["problem"], r["answer"], where) for r in rows], tok, unbounded)
        for row, ids in zip(rows, prompts):
            if len(ids) > max_len:
                raise UsageError(
                    f"{name} problem {row['id']} has {len(ids)} prompt tokens > --max-prompt-len "
                    f"{max_len}: raise --max-prompt-len to at least {len(ids)}"
                )
            longest = max(longest, len(ids))
        sets.append(
            EvalSet(
                name,
                prompts,
                [r["answer"] for r in rows],
                cfg.sampling.eval_num_samples or proto["n"],
                temperature=proto["temperature"] if args.temperature is None else args.temperature,
                top_p=proto["top_p"],
            )
        )
    return sets, longest


def _check_context(max_new_tokens: int, longest: int, context: int | None, *, warn: bool) -> None:
    """A UsageError when the sampler cannot run --max-new-tokens after the longest prompt within the model's
    context; a warning on stderr (when `warn`) when it runs past the context the model was trained on."""
    if context is None or longest + max_new_tokens <= context:
        return
    fits = context - longest
    if max_new_tokens >= context:  # the sampler cannot run this at all
        raise UsageError(
            f"--max-new-tokens {max_new_tokens} + the longest prompt ({longest} tokens) exceeds the model's "
            f"context of {context} tokens: pass --max-new-tokens {fits}" + (" or less" if fits > 1 else "")
            if fits >= 1
            else f"--max-new-tokens {max_new_tokens} does not fit the model's context of {context} tokens, which "
            f"the longest prompt ({longest} tokens) already fills: use a model with a longer context, or "
            f"shorter prompts (--limit, --prompt-template raw)"
        )
    if warn:  # it runs, with positions past the context the model was trained on
        print(
            f"stare-jax eval: warning: the longest prompt ({longest} tokens) + --max-new-tokens "
            f"{max_new_tokens} exceed the model's context of {context} tokens; "
            + (
                f"--max-new-tokens {fits} or less keeps within it" if fits >= 1 else "the longest prompt alone fills it"
            ),
            file=sys.stderr,
        )


def _sampler(cfg: Config, model, mesh, tok, *, verbose: bool):
    """The rollout engine or the static sampler, as sampling.engine.enabled picks (the engine with tool rollouts)."""
    tool = cfg.tool
    engine = dataclasses.replace(cfg.sampling.engine, enabled=True) if tool.enabled else cfg.sampling.engine
    try:
        sampler = make_generator(
            model, config=engine, max_new_tokens=cfg.sampling.max_new_tokens, mesh=mesh, pad_id=tok.pad_id
        )
    except ValueError as e:
        raise UsageError(f"{'--tool on' if tool.enabled else '--engine on'}: {e}") from None
    if verbose:
        which = "rollout engine" if isinstance(sampler, Engine) else "static sampler"
        with_tool = (
            f", multi-turn with the code interpreter ({tool.format}, up to {tool.max_turns} calls, "
            f"{tool.backend} sandbox)"
            if tool.enabled
            else ""
        )
        print(f"stare-jax eval: generating with the {which}{with_tool}", file=sys.stderr)
    return sampler


def _evaluate(
    args, cfg: Config, sampler, sets: list[EvalSet], tok, *, prompt_len: int, verbose: bool
) -> tuple[dict, str]:
    """(results, markdown table) of every set: the reward workers and the tool sandbox pool are closed after. With
    `verbose`, a progress line per benchmark on stderr as its samples finish (at most every 10 s: EvalProgress)."""
    tool = cfg.tool
    reward = RewardFn(num_workers=args.workers, timeout_s=args.timeout)
    pool = make_pool(tool) if tool.enabled else None
    try:
        results = evaluate_sets(
            sampler,
            sets,
            tokenizer=tok,
            reward_fn=reward,
            prompt_len=prompt_len,
            max_new_tokens=cfg.sampling.max_new_tokens,
            seed=cfg.seed,
            ks=KS,
            batch_prompts=args.batch_prompts,
            tool=tool,
            tool_pool=pool,
            progress=EvalProgress(_stderr_line, prefix="stare-jax eval:") if verbose else None,
        )
    finally:
        reward.close()
        if pool is not None:
            pool.close()
    tool_counts = results.pop("tool", None)
    table = format_results_markdown(results)
    if tool_counts is not None:  # one row over every benchmark: calls per response, errors, timeouts, ...
        results["tool"] = tool_metrics(tool_counts)
        table += "\n" + format_results_markdown(
            {"all (tool use)": {k.removeprefix("tool/"): v for k, v in results["tool"].items()}}
        )
    return results, table


def _stderr_line(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
