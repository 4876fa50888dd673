"""Supervised fine-tuning (teacher-forced NLL on response tokens): the warm start before RL.

Uses the RL trainer's pieces: `policy_forward` (chunked log-probs, no [B,T,V] logits), its train state
(`init_train_state`: AdamW moments sharded like the parameters), micro-batches with gradient accumulation
(`accumulate_gradients`), the guarded AdamW update and the jitted, mesh-sharded step (`jit_step`); the model's
own remat policy and dtypes (bf16 compute over fp32 master weights when model.dtype / model.param_dtype say so).
Examples are (prompt_ids, response_ids) pairs, or token ids with a loss mask; the loss is the mean negative
log-likelihood over the masked (response / assistant) tokens of the whole batch, whatever the micro-batching.

`stare-jax sft --config FILE` (`run_conversation_sft`): the cold-start SFT for tool use. It reads a conversation
jsonl (OpenAI messages, stare_jax/data/conversations.py), renders each conversation with the model's own chat
template, trains on assistant tokens only and writes an HF folder (weights + the tokenizer files) that an RL
config's model.path points at, on the config's mesh (the RL config's `mesh:` section). Its options are
`ConversationSFTConfig`'s fields. `stare-jax plan --sft CONFIG --compile` compiles its step for a TPU slice
(stare_jax.training.aot.compile_sft).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import pathlib
import shutil
import time
from typing import Callable, Literal, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from stare_jax import distributed, models
from stare_jax.config.loader import LaunchConfig, MeshConfig, ModelRunConfig, load_section
from stare_jax.config.options import ConfigError, option, validate_fields
from stare_jax.data.conversations import (
    RenderedConversation,
    end_of_turn_texts,
    read_conversations,
    render_conversation,
    truncate,
)
from stare_jax.data.prompts import DataError
from stare_jax.data.tokenizer import load_tokenizer
from stare_jax.models.sharding import BATCH_AXES, batch_shards, mesh_for_config
from stare_jax.rl.packing import split_micro
from stare_jax.rl.step import (
    OptimizerConfig,
    TrainState,
    TrainStepConfig,
    accumulate_gradients,
    guarded_update,
    init_train_state,
    jit_step,
    make_optimizer,
    place_train_state,
    policy_forward,
)
from stare_jax.tools.calls import CODE_TOOL_SCHEMA
from stare_jax.training.metrics import ProgressBar


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    steps: int = 300
    batch_size: int = 64
    lr: float = 3e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    seed: int = 0
    chunk_size: int = 64
    micro_batches: int = 1  # gradient accumulation: the batch runs as this many micro-batches (same update)

    def optimizer(self) -> OptimizerConfig:
        """The AdamW settings of this SFT (the RL trainer's optimizer; a linear warm-up when warmup_steps)."""
        return OptimizerConfig(
            lr=self.lr,
            weight_decay=self.weight_decay,
            warmup_steps=self.warmup_steps,
            schedule="linear" if self.warmup_steps else "constant",
        )


SFT_KEYS = ("input_ids_BxT", "attention_mask_BxT", "response_mask_BxT")  # the SFT step's batch (train_step layout)


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
        resp[i, len(p) : n] = 1
    return ids, attn, resp


def build_sft_step_fn(
    graphdef, tx, *, chunk_size: int, micro_batches: int = 1, mesh=None, batch_axes=BATCH_AXES
) -> Callable:
    """The pure SFT step (train_state, batch) -> (train_state, metrics): the mean negative log-likelihood of the
    response tokens (batch[SFT_KEYS], the RL step's padded layout without advantages), normalised by the whole
    batch's token count and accumulated over `micro_batches` contiguous micro-batches (the RL step's
    accumulate_gradients: the same loss and gradient as one big batch), then one AdamW update (guarded_update:
    skipped when not finite)."""

    def step_fn(state: TrainState, batch: dict):
        ids = jnp.asarray(batch["input_ids_BxT"], jnp.int32)
        attn = jnp.asarray(batch["attention_mask_BxT"], jnp.int32)
        resp = jnp.asarray(batch["response_mask_BxT"])
        if ids.shape[0] % micro_batches:
            raise ValueError(f"SFT batch of {ids.shape[0]} rows does not split into {micro_batches} micro-batches")
        lm = ((resp[:, 1:] > 0) & (attn[:, 1:] > 0)).astype(jnp.float32)
        tokens = jnp.sum(lm)
        normalizer = jnp.maximum(tokens, 1.0)
        xs = tuple(split_micro(a, micro_batches, mesh, batch_axes) for a in (ids, attn, ids[:, 1:], lm))

        def micro_loss(params, x):
            lp, _ = policy_forward(graphdef, params, state.rest, *x, chunk_size=chunk_size)
            return -jnp.sum(lp * x[3]) / normalizer, {}

        grad_fn = jax.value_and_grad(micro_loss, has_aux=True)
        grads, loss, _ = accumulate_gradients(lambda m: grad_fn(state.params, m["x"]), state.params, {"x": xs}, {})
        params, opt_state, gnorm, finite = guarded_update(tx, grads, loss, state.params, state.opt_state)
        metrics = {"loss": loss, "grad_norm": gnorm, "tokens": tokens, "skipped": (~finite).astype(jnp.float32)}
        return TrainState(params=params, rest=state.rest, opt_state=opt_state, step=state.step + 1), metrics

    return step_fn


def make_sft_step(
    graphdef, cfg: SFTConfig, *, mesh=None, train_state: TrainState | None = None, donate: bool = True
) -> Callable:
    """The jitted SFT step (jit_step, as the RL step): on a mesh the train state keeps its shardings (FSDP /
    tensor rules of the model), the batch splits over the data axes; (train_state, batch) -> (train_state,
    metrics) with the train state donated."""
    tx = make_optimizer(cfg.optimizer())
    step_fn = build_sft_step_fn(
        graphdef,
        tx,
        chunk_size=cfg.chunk_size,
        micro_batches=cfg.micro_batches,
        mesh=mesh,
        batch_axes=BATCH_AXES if mesh is not None else (),
    )
    return jit_step(step_fn, mesh=mesh, train_state=train_state, keys=SFT_KEYS, state_args=0, donate=donate)


def init_sft_state(model: nnx.Module, cfg: SFTConfig, mesh=None) -> tuple[nnx.GraphDef, TrainState]:
    """(graphdef, train state) of an SFT run: the model's (possibly sharded, possibly abstract) parameters and
    AdamW moments sharded like them (init_train_state), placed on the mesh."""
    graphdef, state = init_train_state(model, TrainStepConfig(optimizer=cfg.optimizer()))
    if mesh is not None and not isinstance(jax.tree.leaves(state.params)[0], jax.ShapeDtypeStruct):
        state = place_train_state(state, mesh)
    return graphdef, state


def sft_train(
    model: nnx.Module,
    sample_batch: Callable[[np.random.Generator, int], tuple],
    cfg: SFTConfig,
    log: Callable[[int, float], None] | None = None,
    *,
    mesh=None,
    progress: ProgressBar | None = None,
) -> list[float]:
    """Train `model` (sharded onto `mesh` when given) in place for cfg.steps steps. `sample_batch(rng,
    batch_size)` returns (ids, attn, resp) arrays of one fixed shape (so the step compiles once). Returns the loss
    curve. The model's parameter buffers are donated to the step and written back at the end. Several processes
    (jax.distributed) draw the same host batch (same seed) and each feeds the rows its devices hold, as the RL
    step does. `progress` (the training loop's ProgressBar with SFT_POSTFIX_KEYS) shows each step's loss and
    tokens/s (the batch's non-padding tokens over the step's wall time)."""
    graphdef, state = init_sft_state(model, cfg, mesh)
    step = make_sft_step(graphdef, cfg, mesh=mesh, train_state=state)
    rng = np.random.default_rng(cfg.seed)
    losses = []
    for i in range(cfg.steps):
        t0 = time.perf_counter()
        host_batch = dict(zip(SFT_KEYS, sample_batch(rng, cfg.batch_size)))
        batch = host_batch
        if mesh is not None and distributed.is_multiprocess():  # the same host batch on every process
            batch = distributed.global_batch(batch, mesh)
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
        if not np.isfinite(losses[-1]):
            nnx.update(model, state.params, state.rest)
            raise FloatingPointError(f"SFT loss is {losses[-1]} at step {i}")
        if log is not None:
            log(i, losses[-1])
        if progress is not None:
            tokens = int(np.sum(host_batch["attention_mask_BxT"]))
            rate = round(tokens / max(time.perf_counter() - t0, 1e-9))
            progress.update({"step": i + 1, "loss": losses[-1], "tokens_per_s": rate})
    nnx.update(model, state.params, state.rest)
    return losses


# The tokenizer files copied next to the weights: policy.TOKENIZER_FILES (not imported: policy -> setup -> ...
# imports this module; tests/unit/training/test_sft_conversations.py checks the two lists agree).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",
    "generation_config.json",
)


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
    """`stare-jax sft --config FILE`: cold-start SFT on multi-turn conversations. The options below, plus the RL
    run config's own sections: `model` (path, dtypes, attention kernel, remat, scan;
    stare_jax.config.loader.ModelRunConfig),
    `mesh` (data / fsdp / tensor) and `launch` (the accelerator `stare-jax plan --sft --compile` compiles for)."""

    model: ModelRunConfig = dataclasses.field(default_factory=ModelRunConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    launch: LaunchConfig = dataclasses.field(default_factory=LaunchConfig)
    train_path: str = option(
        "",
        'conversation jsonl: {"messages": [...], "tools": [...]} or a list of '
        "messages per line (roles system/user/assistant/tool, OpenAI tool_calls)",
    )
    out_dir: str = option("", "output HF folder (must be new or empty); the RL config's model.path")
    tools: Literal["code_interpreter", "row", "none"] = option(
        "code_interpreter",
        "tool schemas the chat template lists: code_interpreter = [the code tool] as the RL "
        "run's hermes prompts do (a row's own 'tools' win), row = a row's own only, none = none",
    )
    max_len: int = option(8192, "tokens per conversation (the rendered system + user + assistant + tool turns)", lo=2)
    truncation: Literal["right", "drop", "error"] = option(
        "right",
        "a longer conversation: right = keep its first max_len tokens (dropped if no assistant token is "
        "left), drop = skip it, error = stop",
    )
    steps: int = option(300, "optimizer steps", lo=1)
    batch_size: int = option(32, "conversations per step (drawn at random, with replacement)", lo=1)
    micro_batch_size: int = option(
        0,
        "conversations per micro-batch and data shard (gradient accumulation over "
        "batch_size / (micro_batch_size x data shards) micro-batches, the same "
        "update as one batch); 0 = the whole batch at once",
        lo=0,
    )
    lr: float = option(1e-5, "peak learning rate (AdamW)", lo=0.0, lo_open=True)
    weight_decay: float = option(0.0, lo=0.0)
    warmup_steps: int = option(0, "linear warm-up steps (0 = constant)", lo=0)
    seed: int = option(0)
    chunk_size: int = option(256, "sequence chunk of the chunked log-prob computation", lo=1)
    save_dtype: Literal["float32", "bfloat16"] = option("bfloat16", "dtype of the saved safetensors")

    def __post_init__(self):
        validate_fields(self, "sft")
        if self.warmup_steps > self.steps:
            raise ConfigError(f"sft: 'warmup_steps' = {self.warmup_steps} > 'steps' = {self.steps}")

    def micro_batches(self, data_shards: int) -> int:
        """Micro-batches per step on a mesh with `data_shards` batch shards; ConfigError naming the keys when
        batch_size does not split into them."""
        per_micro = (self.micro_batch_size or self.batch_size // max(data_shards, 1)) * data_shards
        if per_micro == 0 or self.batch_size % per_micro:
            raise ConfigError(
                f"sft: 'batch_size' = {self.batch_size} does not split into micro-batches of "
                f"'micro_batch_size' = {self.micro_batch_size or 'all'} x {data_shards} data shard(s) "
                f"(mesh data x fsdp)"
            )
        return self.batch_size // per_micro

    def train_config(self, data_shards: int) -> SFTConfig:
        """The step's settings on a mesh with `data_shards` batch shards."""
        return SFTConfig(
            steps=self.steps,
            batch_size=self.batch_size,
            lr=self.lr,
            weight_decay=self.weight_decay,
            warmup_steps=self.warmup_steps,
            seed=self.seed,
            chunk_size=self.chunk_size,
            micro_batches=self.micro_batches(data_shards),
        )

    def padded_length(self, longest: int | None = None) -> int:
        """The batch's length: the longest conversation (default: max_len) in whole chunks (+1: the loss sees
        L-1 positions), so one shape compiles once; never more than max_len's."""
        cap = _padded_length(self.max_len, self.chunk_size)
        return cap if longest is None else min(_padded_length(longest, self.chunk_size), cap)


def load_sft_config(path: str | pathlib.Path | None, overrides: Sequence[str] = ()) -> ConversationSFTConfig:
    """The YAML mapping at `path` (a `base:` chain allowed) plus KEY=VALUE overrides (sft. optional), each value
    checked (ConfigError naming file and key)."""
    cfg = load_section(ConversationSFTConfig, path, overrides, prefix="sft.")
    for required, value in (("model.path", cfg.model.path), ("train_path", cfg.train_path), ("out_dir", cfg.out_dir)):
        if not value:
            raise ConfigError(f"{path or '<sft>'}: 'sft.{required}' is required")
    return cfg


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
    """n rounded up to a whole number of chunks (+1: the loss sees L-1 positions)."""
    return -(-(n - 1) // chunk) * chunk + 1


def run_conversation_sft(cfg: ConversationSFTConfig, log=print) -> dict:
    """Fine-tune cfg.model.path on cfg.train_path (loss on assistant tokens only) on the cfg.mesh mesh and write
    cfg.out_dir: the HF folder (weights, config, tokenizer files; generation_config's eos list gains the
    end-of-turn token the model was trained to emit) plus sft_log.jsonl (loss per step) and sft_summary.json.
    Several processes (jax.distributed, one per host) run the same steps on their shares of every batch; process 0
    writes the folder (the weights are gathered to it) and logs."""
    out = pathlib.Path(cfg.out_dir)
    writer = jax.process_index() == 0
    # one decision for all processes (a shared folder may already hold process 0's files when another looks)
    if distributed.any_process(out.exists() and (not out.is_dir() or any(out.iterdir()))):
        raise FileExistsError(f"sft: out_dir {out} exists and is not empty")
    if not writer:
        log = _quiet
    t0 = time.time()
    try:
        mesh = mesh_for_config(cfg.mesh)
    except ValueError as e:
        raise ConfigError(f"sft.mesh: {e}") from None
    train_cfg = cfg.train_config(batch_shards(mesh))  # a batch that does not split fails before any loading
    assert cfg.model.path  # load_sft_config requires it
    tokenizer_dir = pathlib.Path(cfg.model.tokenizer_path or cfg.model.path)
    tok = load_tokenizer(tokenizer_dir)
    rows = encode_conversations(tok, cfg.train_path, cfg, log)
    model = models.from_pretrained(cfg.model.path, mesh=mesh, **cfg.model.architecture_overrides())
    pad = tok.padding_id
    length = cfg.padded_length(max(len(r.ids) for r in rows))
    n_tok = sum(int(r.mask.sum()) for r in rows)
    log(
        f"sft: {len(rows)} conversations, {n_tok} assistant tokens, padded length {length}, "
        f"{'one device' if mesh is None else f'mesh {dict(mesh.shape)}'}, {train_cfg.micro_batches} micro-batch(es)"
    )

    def sample_batch(rng: np.random.Generator, batch_size: int):
        picks = rng.integers(0, len(rows), size=batch_size)
        return pack_masked([(rows[i].ids, rows[i].mask) for i in picks], pad, length)

    if writer:
        out.mkdir(parents=True, exist_ok=True)
    with (out / "sft_log.jsonl").open("w") if writer else contextlib.nullcontext() as f:

        def log_step(i: int, loss: float) -> None:
            if f is not None:
                f.write(json.dumps({"sft_step": i, "loss": loss}) + "\n")

        with ProgressBar(cfg.steps, enabled=writer, keys=ProgressBar.SFT_POSTFIX_KEYS) as bar:
            losses = sft_train(model, sample_batch, train_cfg, log=log_step, mesh=mesh, progress=bar)
    models.save_pretrained(model, out, dtype=getattr(jnp, cfg.save_dtype))  # collective; process 0 writes
    summary = {
        "conversations": len(rows),
        "assistant_tokens": n_tok,
        "steps": cfg.steps,
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "wall_s": time.time() - t0,
        "out_dir": str(out),
        "mesh": None if mesh is None else dict(mesh.shape),
        "micro_batches": train_cfg.micro_batches,
        "processes": jax.process_count(),
        "config": dataclasses.asdict(cfg),
    }
    if writer:
        _write_folder_extras(out, tok, tokenizer_dir, summary)
    log(f"sft: loss {losses[0]:.3f} -> {losses[-1]:.3f} in {cfg.steps} steps, {summary['wall_s']:.0f}s; wrote {out}")
    return summary


def _quiet(*_args) -> None:
    """The log of processes other than 0."""


def _write_folder_extras(out: pathlib.Path, tok, tokenizer_dir: pathlib.Path, summary: dict) -> None:
    """Next to the saved weights: generation_config's eos list with the end-of-turn token(s), the tokenizer files
    and sft_summary.json."""
    gen_path = out / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    end_ids = [i for i in (tok.token_to_id(t) for t in end_of_turn_texts(tok)) if i is not None]
    gen_path.write_text(json.dumps(with_end_of_turn_eos(gen, end_ids), indent=2))
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file() and not (out / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)
    (out / "sft_summary.json").write_text(json.dumps(summary, indent=2))
