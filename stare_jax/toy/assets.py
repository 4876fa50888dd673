"""Builds the embedded toy's assets (tokenizer, {id, problem, answer} data, SFT warm start; cached by config hash)
and turns a run config with `toy.enabled` into the run's inputs for the training loop (see stare_jax.toy)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import random
import shutil
import time
from typing import Callable

import jax
import numpy as np

from stare_jax import distributed as dist, models
from stare_jax.config.loader import Config
from stare_jax.data.tokenizer import load_tokenizer, train_sentencepiece
from stare_jax.tasks import TASKS, digit_set, digit_sum, tool_mul
from stare_jax.tools.calls import RETOOL, call_tags
from stare_jax.toy.spec import MAX_POSITIONS, TOOL_MUL_M_RANGE, ToyAssetConfig, asset_config, model_config
from stare_jax.training.setup import RunInputs, resolve_inputs
from stare_jax.training.sft import SFTConfig, pack_examples, pack_masked, sft_train


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
    return [
        (k, s) for k in range(cfg.k_min, cfg.k_max + 1) for s in range(9 * k + 1) if digit_sum.count_strings(k, s) >= 10
    ]


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
        return [
            task.prompt_text(*sp) + " " + "".join(text for text, _ in tool_transcript(cfg, sp, rng))
            for sp in _specs(cfg)
        ]
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
    return train_sentencepiece(
        _tokenizer_corpus(cfg),
        cfg.vocab_size,
        prefix,
        byte_fallback=False,
        model_type="bpe",
        seed=cfg.seed,
        user_defined_symbols=_user_symbols(cfg),
        add_dummy_prefix=cfg.task != "tool_mul",
    )


def tool_transcript(cfg: ToyAssetConfig, sp: tuple, rng: random.Random) -> list[tuple[str, int]]:
    """One tool_mul warm-start response as (text, trained) segments after the prompt: the call (each digit of D
    replaced by a random digit with probability sft_noise), the interpreter's observation (not trained on) and the
    copied answer; or, with probability sft_direct_frac, a guessed number of the right length and no call."""
    m, k, digits = sp
    if rng.random() < cfg.sft_direct_frac:
        n = len(tool_mul.sample_answer(m, k, digits, rng))
        return [(str(rng.randrange(10 ** (n - 1), 10**n)), 1)]
    factor = "".join(
        str(rng.randrange(1, 10)) if rng.random() < cfg.sft_noise else c for c in tool_mul.sample_factor(k, digits, rng)
    )
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

    mcfg = model_config(
        cfg, vocab_size=tok.vocab_size, bos_token_id=tok.bos_id, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id
    )
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
            return pack_masked(
                [
                    encode_transcript(
                        tok, tool_rows[int(i)][0], tool_transcript(cfg, tool_rows[int(i)][1], rng_answers)
                    )
                    for i in picks
                ],
                pad_id,
                length=longest,
            )
        examples = []
        for i in picks:
            p, sp = prompts[int(i)]
            examples.append((p, encode_answer(tok, noisy_answer(cfg, sp, rng_answers))))
        return pack_examples(examples, pad_id, length=longest)

    sft_log = (tmp / "sft_log.jsonl").open("w")

    def log_sft_step(i: int, loss: float) -> None:
        sft_log.write(json.dumps({"sft_step": i, "loss": loss}) + "\n")

    losses = sft_train(
        model,
        sample_batch,
        SFTConfig(steps=cfg.sft_steps, batch_size=cfg.sft_batch_size, lr=cfg.sft_lr, seed=cfg.seed),
        log=log_sft_step,
    )
    sft_log.close()
    log(
        f"toy: warm start ({cfg.sft_steps} SFT steps) loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
        f"{time.time() - t0:.1f}s so far"
    )
    models.save_pretrained(model, model_dir)
    (tmp / "DONE").write_text(json.dumps({"config": dataclasses.asdict(cfg), "build_s": time.time() - t0}))
    tmp.rename(root)
    return assets


def run_inputs(cfg: Config, log: Callable[[str], None] = print) -> tuple[Config, RunInputs]:
    """A run config's inputs for the training loop (run_training's `inputs_for`): with toy.enabled, builds (or
    reuses from toy.cache_dir) the toy's assets and points the run at them (data.task = toy.task, raw prompts);
    otherwise the checkpoint and data paths the config names (stare_jax.training.setup.resolve_inputs).
    Multi-process: process 0 builds the assets first; the others then find them in a shared cache (or, on hosts
    with their own disks, build the same deterministic assets themselves)."""
    if not cfg.toy.enabled:
        return resolve_inputs(cfg, log)
    t = cfg.toy
    if jax.process_index() == 0:
        assets = prepare(asset_config(t), t.cache_dir, log=log)
    dist.barrier("stare_jax_toy_assets")
    if jax.process_index() != 0:
        assets = prepare(asset_config(t), t.cache_dir, log=log)
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, task=t.task, prompt_template="raw"))
    return cfg, RunInputs(
        assets.model_dir, assets.model_dir / "tokenizer.model", assets.train_path, {"heldout": str(assets.eval_path)}
    )
