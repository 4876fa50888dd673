"""The embedded CPU default: digit-sum prompts, a SentencePiece tokenizer trained for them, and a tiny Qwen2-shaped
transformer warm-started by a short SFT phase on uniformly random valid answers (so it starts with high entropy
and accuracy well below 1). Everything is built once per asset config and cached under `cache_dir/<hash>/`, so
both arms of the demo (GRPO-ds and STARE) start from the very same checkpoint and data.

Layout of a prepared asset folder:
    train.jsonl, eval.jsonl     {id, problem, answer} rows (answer = 'K:S' spec read by tasks.digit_sum.score)
    model/                      HF folder (config.json, model.safetensors) + tokenizer.model
    sft_log.jsonl               the warm-start loss curve (the RL run's metrics.jsonl stays RL-only)
    DONE                        written last: a folder without it is incomplete and rebuilt
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import random
import shutil
import time

import numpy as np

from stare_jax.tasks import digit_sum


@dataclasses.dataclass(frozen=True)
class ToyAssetConfig:
    seed: int = 0
    num_train: int = 4000
    num_eval: int = 200
    k_min: int = 3
    k_max: int = 5
    eval_holdout_frac: float = 0.2
    vocab_size: int = 40
    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 384
    sft_steps: int = 150
    sft_batch_size: int = 64
    sft_lr: float = 3e-3

    def key(self) -> str:
        blob = json.dumps(dataclasses.asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


@dataclasses.dataclass(frozen=True)
class ToyAssets:
    root: pathlib.Path
    train_path: pathlib.Path
    eval_path: pathlib.Path
    model_dir: pathlib.Path


def _is_heldout(k: int, s: int, frac: float) -> bool:
    """A fixed ~frac share of (k, S) prompts is reserved for evaluation (never seen in SFT or RL)."""
    h = int(hashlib.sha256(f"{k}:{s}".encode()).hexdigest(), 16)
    return (h % 1000) < frac * 1000


def make_splits(cfg: ToyAssetConfig) -> tuple[list[dict], list[dict]]:
    rows = digit_sum.make_rows(cfg.num_train * 2 + cfg.num_eval * 10, seed=cfg.seed, k_range=(cfg.k_min, cfg.k_max))
    train, held = [], []
    for r in rows:
        k, s = digit_sum.parse_spec(r["answer"])
        (held if _is_heldout(k, s, cfg.eval_holdout_frac) else train).append(r)
    if len(train) < cfg.num_train or len(held) < cfg.num_eval:
        raise RuntimeError("toy task: not enough prompts for the requested split sizes")
    return train[: cfg.num_train], held[: cfg.num_eval]


def _tokenizer_corpus(cfg: ToyAssetConfig) -> list[str]:
    rng = random.Random(cfg.seed + 1)
    texts = []
    for k in range(cfg.k_min, cfg.k_max + 1):
        for s in range(0, 9 * k + 1):
            texts.append(digit_sum.prompt_text(k, s) + " " + digit_sum.sample_answer(k, s, rng))
    return texts


def encode_example(tok, problem: str) -> list[int]:
    """Prompt ids for the toy: BOS + the prompt text."""
    return tok.encode(problem, add_bos=True)


def encode_answer(tok, answer_text: str) -> list[int]:
    """Response ids for a (valid) answer string, ending with EOS: what the sampler should produce."""
    return tok.encode(answer_text, add_bos=False) + [tok.eos_id]


def prepare(cfg: ToyAssetConfig, cache_dir: str | pathlib.Path = ".cache/toy", log=print) -> ToyAssets:
    """Build (or reuse) the toy assets for `cfg`; returns their paths."""

    from stare_jax import models
    from stare_jax.sft import SFTConfig, pack_examples, sft_train
    from stare_jax.tokenizer import load_tokenizer, train_sentencepiece

    root = pathlib.Path(cache_dir) / cfg.key()
    assets = ToyAssets(root, root / "train.jsonl", root / "eval.jsonl", root / "model")
    if (root / "DONE").is_file():
        return assets
    if root.exists():
        shutil.rmtree(root)
    tmp = root.with_name(root.name + f".tmp{time.time_ns()}")
    tmp.mkdir(parents=True)
    t0 = time.time()
    train, held = make_splits(cfg)
    for name, rows in (("train.jsonl", train), ("eval.jsonl", held)):
        (tmp / name).write_text("".join(json.dumps(r) + "\n" for r in rows))

    model_dir = tmp / "model"
    model_dir.mkdir()
    sp_path = train_sentencepiece(_tokenizer_corpus(cfg), cfg.vocab_size, model_dir / "tokenizer",
                                  byte_fallback=False, model_type="bpe", seed=cfg.seed)
    sp_path.rename(model_dir / "tokenizer.model")
    for extra in model_dir.glob("tokenizer.vocab"):
        extra.unlink()
    tok = load_tokenizer(model_dir / "tokenizer.model")
    log(f"toy: tokenizer with {tok.vocab_size} pieces trained in {time.time() - t0:.1f}s")

    mcfg = models.ModelConfig(
        vocab_size=tok.vocab_size, hidden_size=cfg.hidden_size, num_layers=cfg.num_layers, num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads, intermediate_size=cfg.intermediate_size, max_position_embeddings=64,
        rope_theta=10000.0, qkv_bias=True, architecture="Qwen2ForCausalLM", tie_word_embeddings=True,
        bos_token_id=tok.bos_id, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id, initializer_range=0.05)
    model = models.init_model(mcfg, seed=cfg.seed)
    prompts = [(encode_example(tok, r["problem"]), digit_sum.parse_spec(r["answer"])) for r in train]
    longest = max(len(p) for p, _ in prompts) + len(encode_answer(tok, "9" * cfg.k_max))
    rng_answers = random.Random(cfg.seed + 2)

    def sample_batch(rng: np.random.Generator, batch_size: int):
        picks = rng.integers(0, len(prompts), size=batch_size)
        examples = []
        for i in picks:
            p, (k, s) = prompts[int(i)]
            examples.append((p, encode_answer(tok, digit_sum.sample_answer(k, s, rng_answers))))
        return pack_examples(examples, tok.pad_id, length=longest)

    sft_log = (tmp / "sft_log.jsonl").open("w")
    losses = sft_train(model, sample_batch,
                       SFTConfig(steps=cfg.sft_steps, batch_size=cfg.sft_batch_size, lr=cfg.sft_lr, seed=cfg.seed),
                       log=lambda i, l: sft_log.write(json.dumps({"sft_step": i, "loss": l}) + "\n"))
    sft_log.close()
    log(f"toy: warm start ({cfg.sft_steps} SFT steps) loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
        f"{time.time() - t0:.1f}s so far")
    models.save_pretrained(model, model_dir)
    (tmp / "DONE").write_text(json.dumps({"config": dataclasses.asdict(cfg), "build_s": time.time() - t0}))
    tmp.rename(root)
    return assets
