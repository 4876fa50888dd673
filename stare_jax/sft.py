"""Supervised fine-tuning (teacher-forced NLL on response tokens): the warm start before RL.

Uses the same pieces as the RL step: `policy_forward` (chunked log-probs, no [B,T,V] logits) and `make_optimizer`.
Examples are (prompt_ids, response_ids) pairs, or token ids with a loss mask; the loss is the mean negative
log-likelihood over the masked (response / assistant) tokens.

`stare-jax sft --config FILE` (`run_conversation_sft`): the cold-start SFT for tool use. It reads a conversation
jsonl (OpenAI messages, stare_jax/data/conversations.py), renders each conversation with the model's own chat
template, trains on assistant tokens only and writes an HF folder (weights + the tokenizer files) that an RL
config's model.path points at. Its options are `ConversationSFTConfig`'s fields (a flat YAML mapping).
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import pathlib
import shutil
import time
from typing import Callable, Literal, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from flax import nnx

from stare_jax import models
from stare_jax.config import parse_override
from stare_jax.data.conversations import (RenderedConversation, end_of_turn_texts, read_conversations,
                                          render_conversation, truncate)
from stare_jax.data.prompts import DataError
from stare_jax.options import ConfigError, check_range, coerce, option, typed_fields, validate_fields
from stare_jax.rl.train_step import OptimizerConfig, make_optimizer, policy_forward, split_model
from stare_jax.tokenizer import load_tokenizer
from stare_jax.tools.calls import CODE_TOOL_SCHEMA


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    steps: int = 300
    batch_size: int = 64
    lr: float = 3e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    seed: int = 0
    chunk_size: int = 64


def pack_examples(examples: Sequence[tuple[Sequence[int], Sequence[int]]], pad_id: int, length: int | None = None):
    """Right-padded ids [N, L], attention mask [N, L] and response mask [N, L] (1 where the token is a response
    token, so the loss is on predicting it)."""
    if not examples:
        raise ValueError("pack_examples: no examples")
    lens = [len(p) + len(r) for p, r in examples]
    L = length or max(lens)
    if max(lens) > L:
        raise ValueError(f"pack_examples: an example has {max(lens)} tokens > length {L}")
    ids = np.full((len(examples), L), pad_id, np.int32)
    attn = np.zeros((len(examples), L), np.int32)
    resp = np.zeros((len(examples), L), np.int32)
    for i, (p, r) in enumerate(examples):
        n = len(p) + len(r)
        ids[i, :n] = list(p) + list(r)
        attn[i, :n] = 1
        resp[i, len(p):n] = 1
    return ids, attn, resp


def make_sft_step(graphdef, tx, chunk_size: int) -> Callable:
    """jitted (params, rest, opt_state, ids, attn, resp) -> (params, opt_state, loss)."""

    def loss_fn(params, rest, ids, attn, resp):
        lm = ((resp[:, 1:] > 0) & (attn[:, 1:] > 0)).astype(jnp.float32)
        lp, _ = policy_forward(graphdef, params, rest, ids, attn, ids[:, 1:], lm, chunk_size=chunk_size)
        return -jnp.sum(lp * lm) / jnp.maximum(jnp.sum(lm), 1.0)

    @jax.jit
    def step(params, rest, opt_state, ids, attn, resp):
        loss, grads = jax.value_and_grad(loss_fn)(params, rest, ids, attn, resp)
        updates, opt_state = tx.update(grads, opt_state, params)
        return jax.tree.map(jnp.add, params, updates), opt_state, loss

    return step


def sft_train(model: nnx.Module, sample_batch: Callable[[np.random.Generator, int], tuple], cfg: SFTConfig,
              log: Callable[[int, float], None] | None = None) -> list[float]:
    """Train `model` in place for cfg.steps steps. `sample_batch(rng, batch_size)` returns (ids, attn, resp)
    arrays of one fixed shape (so the step compiles once). Returns the loss curve."""
    graphdef, params, rest = split_model(model)
    tx = make_optimizer(OptimizerConfig(lr=cfg.lr, weight_decay=cfg.weight_decay, warmup_steps=cfg.warmup_steps,
                                        schedule="linear" if cfg.warmup_steps else "constant"))
    opt_state = tx.init(params)
    step = make_sft_step(graphdef, tx, cfg.chunk_size)
    rng = np.random.default_rng(cfg.seed)
    losses = []
    for i in range(cfg.steps):
        ids, attn, resp = sample_batch(rng, cfg.batch_size)
        params, opt_state, loss = step(params, rest, opt_state, ids, attn, resp)
        losses.append(float(loss))
        if not np.isfinite(losses[-1]):
            raise FloatingPointError(f"SFT loss is {losses[-1]} at step {i}")
        if log is not None:
            log(i, losses[-1])
    nnx.update(model, params)
    return losses


# The tokenizer files copied next to the weights: policy.TOKENIZER_FILES (not imported: policy -> run_setup -> toy
# imports this module; tests/test_sft_conversations.py checks the two lists agree).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "chat_template.jinja", "generation_config.json")


def pack_masked(rows: Sequence[tuple[np.ndarray, np.ndarray]], pad_id: int, length: int):
    """(ids, loss mask) rows -> right-padded ids, attention mask and loss mask [N, length] (pack_examples' layout)."""
    ids = np.full((len(rows), length), pad_id, np.int32)
    attn = np.zeros((len(rows), length), np.int32)
    resp = np.zeros((len(rows), length), np.int32)
    for i, (t, m) in enumerate(rows):
        n = len(t)
        if n > length:
            raise ValueError(f"pack_masked: a row has {n} tokens > length {length}")
        ids[i, :n], attn[i, :n], resp[i, :n] = t, 1, m
    return ids, attn, resp


@dataclasses.dataclass(frozen=True)
class ConversationSFTConfig:
    """`stare-jax sft --config FILE`: cold-start SFT on multi-turn conversations (a flat YAML mapping)."""

    model_path: str = option("", "Hugging Face folder (config.json + safetensors + tokenizer) to fine-tune")
    train_path: str = option("", "conversation jsonl: {\"messages\": [...], \"tools\": [...]} or a list of "
                                 "messages per line (roles system/user/assistant/tool, OpenAI tool_calls)")
    out_dir: str = option("", "output HF folder (must be new or empty); the RL config's model.path")
    tools: Literal["code_interpreter", "row", "none"] = option(
        "code_interpreter", "tool schemas the chat template lists: code_interpreter = [the code tool] as the RL "
                            "run's hermes prompts do (a row's own 'tools' win), row = a row's own only, none = none")
    max_len: int = option(8192, "tokens per conversation (the rendered system + user + assistant + tool turns)",
                          lo=2)
    truncation: Literal["right", "drop", "error"] = option(
        "right", "a longer conversation: right = keep its first max_len tokens (dropped if no assistant token is "
                 "left), drop = skip it, error = stop")
    steps: int = option(300, "optimizer steps", lo=1)
    batch_size: int = option(32, "conversations per step (drawn at random, with replacement)", lo=1)
    lr: float = option(1e-5, "peak learning rate (AdamW)", lo=0.0, lo_open=True)
    weight_decay: float = option(0.0, lo=0.0)
    warmup_steps: int = option(0, "linear warm-up steps (0 = constant)", lo=0)
    seed: int = option(0)
    chunk_size: int = option(256, "sequence chunk of the chunked log-prob computation", lo=1)
    dtype: Literal["float32", "bfloat16"] = option("float32", "compute dtype (master weights stay float32)")
    save_dtype: Literal["float32", "bfloat16"] = option("bfloat16", "dtype of the saved safetensors")

    def __post_init__(self):
        validate_fields(self, "sft")
        if self.warmup_steps > self.steps:
            raise ConfigError(f"sft: 'warmup_steps' = {self.warmup_steps} > 'steps' = {self.steps}")


def load_sft_config(path: str | pathlib.Path | None, overrides: Sequence[str] = ()) -> ConversationSFTConfig:
    """The YAML mapping at `path` plus KEY=VALUE overrides, each value checked (ConfigError naming file and key)."""
    data: dict = {}
    where: dict[str, str] = {}
    if path is not None:
        loaded = yaml.safe_load(pathlib.Path(path).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: an SFT config is a YAML mapping of sft options, got {type(loaded).__name__}")
        data.update(loaded)
        where.update({str(k): str(path) for k in loaded})
    for text in overrides:
        keys, value = parse_override(text)
        key = ".".join(keys[1:] if keys[0] == "sft" and len(keys) > 1 else keys)
        data[key] = value
        where[key] = f"command-line override '{text}'"
    fields = {f.name: (f, tp) for f, tp in typed_fields(ConversationSFTConfig)}
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f"; did you mean 'sft.{close[0]}'?" if close else ""
            raise ConfigError(f"{where.get(str(key), '<sft>')}: unknown key 'sft.{key}'{hint} "
                              f"(valid keys: {', '.join(fields)})")
        f, tp = fields[key]
        value = coerce(value, tp, f"sft.{key}", where[key])
        check_range(value, f.metadata, f"sft.{key}", where[key])
        kwargs[key] = value
    for required in ("model_path", "train_path", "out_dir"):
        if not kwargs.get(required):
            raise ConfigError(f"{path or '<sft>'}: 'sft.{required}' is required")
    return ConversationSFTConfig(**kwargs)


def encode_conversations(tokenizer, path, cfg: ConversationSFTConfig, log=print) -> list[RenderedConversation]:
    """The training rows of cfg: read, rendered with the chat template, masked and truncated (cfg.truncation)."""
    tools = [CODE_TOOL_SCHEMA] if cfg.tools == "code_interpreter" else None
    rows, dropped = [], 0
    for conv in read_conversations(path):
        if cfg.tools == "none":
            conv.tools = None
        kept = truncate(render_conversation(tokenizer, conv, tools), cfg.max_len, cfg.truncation)
        if kept is None:
            dropped += 1
        else:
            rows.append(kept)
    if dropped:
        why = "dropped" if cfg.truncation == "drop" else "left with no assistant token after truncation"
        log(f"sft: {dropped} conversation(s) longer than max_len {cfg.max_len} skipped ({why})")
    if not rows:
        raise DataError(f"{path}: no conversation left to train on (max_len {cfg.max_len})")
    return rows


def with_end_of_turn_eos(gen_config: dict, end_ids: Sequence[int]) -> dict:
    """generation_config with `end_ids` added to its eos_token_id list: a base model's eos is <|endoftext|>, but
    after chat-template SFT it ends each turn with <|im_end|>, where the RL rollout must stop (as the Qwen2.5
    instruct checkpoints' generation_config lists both)."""
    eos = gen_config.get("eos_token_id")
    ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    return {**gen_config, "eos_token_id": ids + [int(i) for i in end_ids if int(i) not in ids]}


def _padded_length(n: int, chunk: int) -> int:
    """n rounded up to a whole number of chunks (+1: the loss sees L-1 positions), so one shape compiles once."""
    return -(-(n - 1) // chunk) * chunk + 1


def run_conversation_sft(cfg: ConversationSFTConfig, log=print) -> dict:
    """Fine-tune cfg.model_path on cfg.train_path (loss on assistant tokens only) and write cfg.out_dir: the HF
    folder (weights, config, tokenizer files; generation_config's eos list gains the end-of-turn token the model
    was trained to emit) plus sft_log.jsonl (loss per step) and sft_summary.json."""
    out = pathlib.Path(cfg.out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"sft: out_dir {out} exists and is not empty")
    t0 = time.time()
    tok = load_tokenizer(cfg.model_path)
    rows = encode_conversations(tok, cfg.train_path, cfg, log)
    model = models.from_pretrained(cfg.model_path, dtype=getattr(jnp, cfg.dtype))
    pad = tok.padding_id
    length = min(_padded_length(max(len(r.ids) for r in rows), cfg.chunk_size),
                 _padded_length(cfg.max_len, cfg.chunk_size))
    n_tok = sum(int(r.mask.sum()) for r in rows)
    log(f"sft: {len(rows)} conversations, {n_tok} assistant tokens, padded length {length}")

    def sample_batch(rng: np.random.Generator, batch_size: int):
        picks = rng.integers(0, len(rows), size=batch_size)
        return pack_masked([(rows[i].ids, rows[i].mask) for i in picks], pad, length)

    out.mkdir(parents=True, exist_ok=True)
    with (out / "sft_log.jsonl").open("w") as f:
        def log_step(i: int, loss: float) -> None:
            f.write(json.dumps({"sft_step": i, "loss": loss}) + "\n")

        losses = sft_train(model, sample_batch, SFTConfig(steps=cfg.steps, batch_size=cfg.batch_size, lr=cfg.lr,
                                                          weight_decay=cfg.weight_decay,
                                                          warmup_steps=cfg.warmup_steps, seed=cfg.seed,
                                                          chunk_size=cfg.chunk_size), log=log_step)
    models.save_pretrained(model, out, dtype=getattr(jnp, cfg.save_dtype))
    gen_path = out / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    end_ids = [i for i in (tok.token_to_id(t) for t in end_of_turn_texts(tok)) if i is not None]
    gen_path.write_text(json.dumps(with_end_of_turn_eos(gen, end_ids), indent=2))
    src = pathlib.Path(cfg.model_path)
    for name in TOKENIZER_FILES:
        if (src / name).is_file() and not (out / name).exists():
            shutil.copy(src / name, out / name)
    summary = {"conversations": len(rows), "assistant_tokens": n_tok, "steps": cfg.steps,
               "loss_first": losses[0], "loss_last": losses[-1], "wall_s": time.time() - t0, "out_dir": str(out),
               "config": dataclasses.asdict(cfg)}
    (out / "sft_summary.json").write_text(json.dumps(summary, indent=2))
    log(f"sft: loss {losses[0]:.3f} -> {losses[-1]:.3f} in {cfg.steps} steps, {summary['wall_s']:.0f}s; wrote {out}")
    return summary
