"""`stare-jax smoke [--run-dir DIR] [--model P]`: load a model (a tiny random one by default), generate a few
tokens, print them as ids and text."""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import jax
import jax.numpy as jnp
from tokenizers import Tokenizer, decoders, models as tok_models, pre_tokenizers

from stare_jax import models
from stare_jax.cli.common import UsageError, add_config_args
from stare_jax.config.loader import load_config, save_config
from stare_jax.data.tokenizer import load_tokenizer
from stare_jax.sampling import SamplingParams, generate

SMOKE_PROMPTS = ("The answer is", "1 + 2 =")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", default="runs/smoke")
    p.add_argument("--model", default=None, help="HF folder (default: a tiny random model written to the run dir)")
    p.add_argument("--new-tokens", type=int, default=8, help="tokens to generate per prompt (default: %(default)s)")
    add_config_args(p)


def byte_tokenizer(folder: pathlib.Path) -> None:
    """A byte-level tokenizer.json for the tiny random model (256 byte tokens, no merges), so smoke can print text."""
    vocab = {ch: i for i, ch in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    tok = Tokenizer(tok_models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(folder / "tokenizer.json"))


def run(args) -> int:
    """Save a tiny random model as an HF folder, load it back, greedy-generate a few tokens; write the run files.
    Prints the prompts and continuations as token ids and as text (the tiny model's is random bytes)."""
    run_dir = _check_inputs(args)
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = load_config(args.config, args.overrides)
    save_config(cfg, run_dir)
    t0 = time.time()
    model_dir = pathlib.Path(args.model) if args.model else _tiny_model(run_dir / "tiny-model", seed=cfg.seed)
    model = models.from_pretrained(model_dir, dtype=jnp.float32)
    tok = None
    if (model_dir / "tokenizer.json").is_file() or (model_dir / "tokenizer.model").is_file():
        tok = load_tokenizer(model_dir)
        prompt = [tok.encode(t) for t in SMOKE_PROMPTS]
    else:
        vocab = model.config.vocab_size
        prompt = [[t % vocab for t in p] for p in ([1, 5, 9, 13], [2, 4, 6])]
    generated = generate(model, prompt, max_new_tokens=args.new_tokens, sampling=SamplingParams(temperature=0.0)).tokens
    elapsed = time.time() - t0
    generated = [list(map(int, g)) for g in generated]
    text = (
        [{"prompt": tok.decode(p), "generated": tok.decode(g)} for p, g in zip(prompt, generated)]
        if tok is not None
        else None
    )
    result = {
        "model": str(model_dir),
        "devices": [str(d) for d in jax.devices()],
        "prompts": prompt,
        "generated": generated,
        "text": text,
        "wall_s": round(elapsed, 2),
    }
    (run_dir / "smoke.json").write_text(json.dumps(result, indent=1))
    _print_result(args, result, model_dir)
    print(f"smoke job done in {elapsed:.1f}s; outputs in {run_dir}")
    return 0


def _check_inputs(args) -> pathlib.Path:
    """The run folder, after the checks of --new-tokens, --model and --run-dir (UsageError naming the fix)."""
    if args.new_tokens < 1:
        raise UsageError(f"--new-tokens {args.new_tokens} must be >= 1")
    if args.model and not (pathlib.Path(args.model) / "config.json").is_file():
        raise UsageError(
            f"--model {args.model} is not a Hugging Face folder (no config.json); convert one with "
            f"`stare-jax smollm2` or `stare-jax convert`, or omit --model for a tiny random model"
        )
    run_dir = pathlib.Path(args.run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise UsageError(f"--run-dir {run_dir} is a file; give a folder")
    return run_dir


def _tiny_model(model_dir: pathlib.Path, seed: int) -> pathlib.Path:
    """`model_dir` holding a tiny random Qwen2 model and a byte tokenizer (each written unless already there)."""
    if not (model_dir / "config.json").is_file():
        tiny = models.ModelConfig(
            vocab_size=256,
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=128,
            max_position_embeddings=512,
            architecture="Qwen2ForCausalLM",
            qkv_bias=True,
        )
        models.save_pretrained(models.init_model(tiny, seed=seed), model_dir)
    if not (model_dir / "tokenizer.json").is_file():
        byte_tokenizer(model_dir)
    return model_dir


def _print_result(args, result: dict, model_dir: pathlib.Path) -> None:
    text = result["text"]
    for i, (p, g) in enumerate(zip(result["prompts"], result["generated"])):
        print(f"prompt {p} -> generated {g}")
        if text is not None:
            print(f"  text: {text[i]['prompt']!r} -> {text[i]['generated']!r}")
    if text is None:
        print(f"(no tokenizer.json or tokenizer.model in {model_dir}: token ids only)")
    elif not args.model:
        print("(a tiny random model with a byte tokenizer: its text is random bytes; --model HF_DIR for a real one)")
