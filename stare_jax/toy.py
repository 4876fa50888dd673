"""The embedded CPU default: toy prompts with many valid answers (tasks.digit_set by default, or tasks.digit_sum),
a SentencePiece tokenizer trained for them, and a tiny Qwen2-shaped transformer warm-started by a short SFT phase on
uniformly random answers, a fraction `sft_noise` of whose digits are replaced by random ones (so it starts with high
entropy and accuracy well below 1).

task tool_mul (`stare-jax demo --scenario tool`): the warm start is multi-turn - prompt, the model's
`<code>print(m*D)</code>` call, the interpreter's observation (loss mask 0: assistant-only loss, as in
stare_jax.sft's conversation SFT) and the copied answer. It is deliberately imperfect so RL has something to gain:
a fraction `sft_direct_frac` of the examples answer with a guessed number without calling the tool, and a fraction
`sft_noise` of D's digits are replaced by random digits (1-9). The retool tags, the call's opener `<code>print(`
and the newline are user-defined pieces of the tokenizer (each closing tag is one stop token), and its tokenizer
adds no dummy-prefix piece, so a call `<code>print(37*54282)</code>` is k + 6 model tokens and most of what the
model writes is D's free digits and the copied product.

Everything is built once per asset config and cached under `cache_dir/<hash>/`, so both arms of the demo (GRPO-ds
and STARE) start from the very same checkpoint and data.

Layout of a prepared asset folder:
    train.jsonl, eval.jsonl     {id, problem, answer} rows (answer = the task's spec, e.g. 'K:DIGITS', read by its
                                score function); eval prompts use (k, set) specs never seen in training
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

from stare_jax.tasks import TASKS, digit_set, digit_sum, tool_mul
from stare_jax import models
from stare_jax.sft import SFTConfig, pack_examples, pack_masked, sft_train
from stare_jax.tokenizer import load_tokenizer, train_sentencepiece
from stare_jax.tools.calls import RETOOL, call_tags


MAX_POSITIONS = 64  # the toy model's context: prompt + response (tool_mul: call, observation and answer)
TOOL_MUL_M_RANGE = (11, 99)  # tool_mul's multipliers (multiples of 10 left out by the task)


@dataclasses.dataclass(frozen=True)
class ToyAssetConfig:
    task: str = "digit_set"
    seed: int = 0
    num_train: int = 4000
    num_eval: int = 200
    k_min: int = 3
    k_max: int = 5
    eval_holdout_frac: float = 0.2
    set_size: int = 3
    sft_noise: float = 0.3
    sft_direct_frac: float = 0.0  # tool_mul: warm-start answers guessed without calling the tool
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


def _is_heldout(spec: str, frac: float) -> bool:
    """A fixed ~frac share of prompt specs is reserved for evaluation (never seen in SFT or RL)."""
    h = int(hashlib.sha256(spec.encode()).hexdigest(), 16)
    return (h % 1000) < frac * 1000


def _specs(cfg: ToyAssetConfig) -> list[tuple]:
    if cfg.task == "digit_set":
        return digit_set.all_specs((cfg.k_min, cfg.k_max), cfg.set_size)
    if cfg.task == "tool_mul":
        return tool_mul.all_specs(TOOL_MUL_M_RANGE, (cfg.k_min, cfg.k_max), cfg.set_size)
    return [(k, s) for k in range(cfg.k_min, cfg.k_max + 1) for s in range(9 * k + 1)
            if digit_sum.count_strings(k, s) >= 10]


def make_splits(cfg: ToyAssetConfig) -> tuple[list[dict], list[dict]]:
    """Train rows from the non-held-out prompt specs, eval rows from the held-out ones."""
    task = TASKS[cfg.task]
    specs = _specs(cfg)
    held = [sp for sp in specs if _is_heldout(task.spec(*sp), cfg.eval_holdout_frac)]
    train = [sp for sp in specs if sp not in held]
    if not held or not train:
        raise RuntimeError(f"toy task {cfg.task}: the prompt space is too small for a held-out split")
    rng = random.Random(cfg.seed)

    def rows(pool, n, tag):
        out = []
        for i in range(n):
            sp = rng.choice(pool)
            out.append({"id": f"{cfg.task}-{tag}-{i}", "problem": task.prompt_text(*sp), "answer": task.spec(*sp)})
        return out

    return rows(train, cfg.num_train, "train"), rows(held, cfg.num_eval, "eval")


def _tokenizer_corpus(cfg: ToyAssetConfig) -> list[str]:
    task = TASKS[cfg.task]
    rng = random.Random(cfg.seed + 1)
    if cfg.task == "tool_mul":
        return [task.prompt_text(*sp) + " " + "".join(text for text, _ in tool_transcript(cfg, sp, rng))
                for sp in _specs(cfg)]
    return [task.prompt_text(*sp) + " " + task.sample_answer(*sp, rng) for sp in _specs(cfg)]


TOOL_MUL_OPENER = "<code>print("  # tool_mul's call opener as one piece: the call's fixed format is 4 tokens


def _user_symbols(cfg: ToyAssetConfig) -> tuple[str, ...]:
    """Pieces the tokenizer keeps whole: tool_mul's retool tags (one stop token per closing tag), its call opener
    `<code>print(` (longest match wins, so `<code>` alone is still one piece) and the newline of its observations."""
    if cfg.task != "tool_mul":
        return ()
    return (TOOL_MUL_OPENER, *call_tags("retool"), "<interpreter>", "</interpreter>", "\n")


def train_tokenizer(cfg: ToyAssetConfig, prefix: pathlib.Path) -> pathlib.Path:
    """The toy's SentencePiece model (BPE, digits split) trained on its task's text; returns the .model path.
    tool_mul: its user symbols, and no dummy-prefix "▁" piece at the start of each segment (call, observation,
    answer)."""
    return train_sentencepiece(_tokenizer_corpus(cfg), cfg.vocab_size, prefix, byte_fallback=False,
                               model_type="bpe", seed=cfg.seed, user_defined_symbols=_user_symbols(cfg),
                               add_dummy_prefix=cfg.task != "tool_mul")


def tool_transcript(cfg: ToyAssetConfig, sp: tuple, rng: random.Random) -> list[tuple[str, int]]:
    """One tool_mul warm-start response as (text, trained) segments after the prompt: the call (each digit of D
    replaced by a random digit with probability sft_noise), the interpreter's observation (not trained on) and the
    copied answer; or, with probability sft_direct_frac, a guessed number of the right length and no call."""
    m, k, digits = sp
    if rng.random() < cfg.sft_direct_frac:
        n = len(tool_mul.sample_answer(m, k, digits, rng))
        return [(str(rng.randrange(10 ** (n - 1), 10 ** n)), 1)]
    factor = "".join(str(rng.randrange(1, 10)) if rng.random() < cfg.sft_noise else c
                     for c in tool_mul.sample_factor(k, digits, rng))
    product = str(m * int(factor))
    return [(tool_mul.call_text(m, factor), 1), (RETOOL.wrap(product), 0), (product, 1)]


def encode_transcript(tok, problem: str, segments: list[tuple[str, int]]) -> tuple[np.ndarray, np.ndarray]:
    """(ids, loss mask) of a prompt and its response segments, each segment encoded on its own as the tool
    rollout does (the model's turns, then the observation text by itself), EOS (trained) at the end."""
    ids = encode_example(tok, problem)
    mask = [0] * len(ids)
    for text, trained in segments:
        seg = tok.encode(text, add_bos=False)
        ids += seg
        mask += [trained] * len(seg)
    return np.asarray(ids + [tok.eos_id], np.int32), np.asarray(mask + [1], np.int32)


def noisy_answer(cfg: ToyAssetConfig, sp: tuple, rng: random.Random) -> str:
    """A uniformly random valid answer with each digit replaced by a random digit with probability sft_noise."""
    answer = TASKS[cfg.task].sample_answer(*sp, rng)
    return "".join(str(rng.randrange(10)) if rng.random() < cfg.sft_noise else c for c in answer)


def encode_example(tok, problem: str) -> list[int]:
    """Prompt ids for the toy: BOS + the prompt text."""
    return tok.encode(problem, add_bos=True)


def encode_answer(tok, answer_text: str) -> list[int]:
    """Response ids for a (valid) answer string, ending with EOS: what the sampler should produce."""
    return tok.encode(answer_text, add_bos=False) + [tok.eos_id]


def asset_config(run_toy) -> ToyAssetConfig:
    """The asset config named by a run config's `toy` section (it sets a subset of the fields; the rest keep
    their defaults)."""
    shared = {f.name for f in dataclasses.fields(ToyAssetConfig)} & {f.name for f in dataclasses.fields(run_toy)}
    return ToyAssetConfig(**{k: getattr(run_toy, k) for k in shared})


def model_config(cfg: ToyAssetConfig, **token_ids):
    """The toy's Qwen2-shaped ModelConfig (vocab_size and special token ids from its tokenizer when given)."""

    fields = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, num_layers=cfg.num_layers,
                  num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, intermediate_size=cfg.intermediate_size,
                  max_position_embeddings=MAX_POSITIONS, rope_theta=10000.0, qkv_bias=True,
                  architecture="Qwen2ForCausalLM", tie_word_embeddings=True, initializer_range=0.05)
    return models.ModelConfig(**{**fields, **token_ids})


def prepare(cfg: ToyAssetConfig, cache_dir: str | pathlib.Path = ".cache/toy", log=print) -> ToyAssets:
    """Build (or reuse) the toy assets for `cfg`; returns their paths."""


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
    train_tokenizer(cfg, model_dir / "tokenizer").rename(model_dir / "tokenizer.model")
    for extra in model_dir.glob("tokenizer.vocab"):
        extra.unlink()
    tok = load_tokenizer(model_dir / "tokenizer.model")
    log(f"toy: tokenizer with {tok.vocab_size} pieces trained in {time.time() - t0:.1f}s")

    mcfg = model_config(cfg, vocab_size=tok.vocab_size, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id,
                        pad_token_id=tok.pad_id)
    model = models.init_model(mcfg, seed=cfg.seed)
    task = TASKS[cfg.task]
    prompts = [(encode_example(tok, r["problem"]), task.parse_spec(r["answer"])) for r in train]
    longest = max(len(p) for p, _ in prompts) + len(encode_answer(tok, "9" * cfg.k_max))
    rng_answers = random.Random(cfg.seed + 2)
    pad_id = tok.pad_id
    assert pad_id is not None  # train_sentencepiece gives the tokenizer a pad piece
    if cfg.task == "tool_mul":
        tool_rows = [(r["problem"], task.parse_spec(r["answer"])) for r in train]
        longest = MAX_POSITIONS

    def sample_batch(rng: np.random.Generator, batch_size: int):
        picks = rng.integers(0, len(prompts), size=batch_size)
        if cfg.task == "tool_mul":
            return pack_masked([encode_transcript(tok, tool_rows[int(i)][0],
                                                  tool_transcript(cfg, tool_rows[int(i)][1], rng_answers))
                                for i in picks], pad_id, length=longest)
        examples = []
        for i in picks:
            p, sp = prompts[int(i)]
            examples.append((p, encode_answer(tok, noisy_answer(cfg, sp, rng_answers))))
        return pack_examples(examples, pad_id, length=longest)

    sft_log = (tmp / "sft_log.jsonl").open("w")

    def log_sft_step(i: int, loss: float) -> None:
        sft_log.write(json.dumps({"sft_step": i, "loss": loss}) + "\n")

    losses = sft_train(model, sample_batch,
                       SFTConfig(steps=cfg.sft_steps, batch_size=cfg.sft_batch_size, lr=cfg.sft_lr, seed=cfg.seed),
                       log=log_sft_step)
    sft_log.close()
    log(f"toy: warm start ({cfg.sft_steps} SFT steps) loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
        f"{time.time() - t0:.1f}s so far")
    models.save_pretrained(model, model_dir)
    (tmp / "DONE").write_text(json.dumps({"config": dataclasses.asdict(cfg), "build_s": time.time() - t0}))
    tmp.rename(root)
    return assets
