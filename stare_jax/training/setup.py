"""What a run needs before its first step, shared by training (training/loop.py), loading a run for evaluation or export
(policy.py) and the ahead-of-time compiles (aot.py): the input paths, the static config of the jitted step
derived from the run config, and the initial train + controller state committed to its devices.
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from stare_jax import models
from stare_jax.config.loader import Config
from stare_jax.data.prompts import PromptRow, format_prompt
from stare_jax.models import lora
from stare_jax.models.sharding import batch_shards
from stare_jax.planning.estimate import auto_max_slots, live_accelerator
from stare_jax.rl.stare import StareState, init_stare_state
from stare_jax.rl.step import TrainState, TrainStepConfig, init_train_state, place_train_state, split_model
from stare_jax.sampling import Engine, EngineConfig, Sampler
from stare_jax.sampling.engine import make_generator
from stare_jax.tools.config import make_pool
from stare_jax.tools.pool import SandboxPool
from stare_jax.training.run_dir import is_remote, local_copy


class TrainingError(RuntimeError):
    """The run cannot continue (the message says why and what was saved)."""


# ----------------------------------------------------------------------------------------------------------------
# Processes and inputs


def init_distributed(coordinator_address: str | None, num_processes: int | None, process_id: int | None) -> None:
    """jax.distributed.initialize for multi-process runs: explicit arguments (GPU over ssh, local CPU processes),
    or automatic on Cloud TPU / Slurm / when JAX_COORDINATOR_ADDRESS is set. Single-process runs skip it."""
    given = [coordinator_address, num_processes, process_id]
    if any(v is not None for v in given):
        if coordinator_address is None or num_processes is None or process_id is None:
            raise TrainingError(
                "multi-process runs need all of --coordinator-address, --num-processes and "
                "--process-id (or none of them, for automatic detection)"
            )
        if not 0 <= process_id < num_processes:
            raise TrainingError(f"--process-id {process_id} is outside [0, --num-processes={num_processes})")
        # CPU cross-process collectives (local multi-process runs) go through gloo; GPU/TPU are unaffected
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id
        )
    elif os.environ.get("JAX_COORDINATOR_ADDRESS") or os.environ.get("TPU_WORKER_HOSTNAMES", "").count(",") > 0:
        jax.distributed.initialize()


@dataclasses.dataclass
class RunInputs:
    model_path: pathlib.Path
    tokenizer_path: pathlib.Path
    train_path: str | pathlib.Path  # a local path or an object-store URL (gs://...)
    eval_paths: dict


InputsFn = Callable[[Config, Callable[[str], None]], "tuple[Config, RunInputs]"]


def resolve_inputs(cfg: Config, log: Callable[[str], None]) -> tuple[Config, RunInputs]:
    """Paths of the model, tokenizer and data a run config names. The embedded toy (toy.enabled) is not resolved
    here: its assets are built by stare_jax.toy.assets.run_inputs, which the entry points call and whose result
    they hand to the loop (the loop does not import the toy)."""
    if cfg.toy.enabled:
        raise TrainingError(
            "toy.enabled: the embedded toy's inputs are built by stare_jax.toy.assets.run_inputs; "
            "run the config with `stare-jax train` (or pass inputs= to run_training)"
        )
    if not cfg.model.path:
        raise TrainingError("model.path is not set: point it at a Hugging Face checkpoint folder")
    if not cfg.data.train_path:
        raise TrainingError("data.train_path is not set: point it at a jsonl/parquet file of {problem, answer} rows")

    def local(p: str) -> pathlib.Path:  # a checkpoint on gs:// is copied to local disk once per host
        return local_copy(p, log=log) if is_remote(p) else pathlib.Path(p)

    model_path = local(cfg.model.path)
    if not (model_path / "config.json").is_file():
        raise TrainingError(
            f"model.path {cfg.model.path} has no config.json (not a Hugging Face checkpoint folder): "
            + (
                f"make it with `stare-jax smollm2 {cfg.model.path}`"
                if "smollm2" in str(cfg.model.path).lower()
                else "download one with `hf download REPO_ID --local-dir DIR` and set model.path=DIR"
            )
        )
    tok_path = local(cfg.model.tokenizer_path) if cfg.model.tokenizer_path else model_path
    return cfg, RunInputs(model_path, tok_path, cfg.data.train_path, dict(cfg.data.eval_paths))


def init_adapters(model, cfg: Config, model_path=None, *, resume: bool = False, log: Callable[[str], None] = print):
    """model.lora.init_from: the PEFT adapter folder's adapters put into the freshly loaded `model` (in place; it
    is returned), so the run starts from them (and rl.kl.reference 'initial' is base + these adapters). Called
    where the training model is created, before init_run_state. On resume the checkpoint's adapters are restored
    over them: they are read then only when rl.kl.reference is 'initial' (the reference is re-derived from the
    starting weights). TrainingError (one line) naming model.lora.init_from for a folder that does not fit; a
    base_model_name_or_path naming another existing local folder than the run's model (`model_path`, default
    model.path) is only reported (folders move)."""
    src = cfg.model.lora.init_from
    if not src or not getattr(model.config, "lora_rank", 0) or (resume and cfg.rl.kl.reference != "initial"):
        return model
    folder = local_copy(src, log=log) if is_remote(src) else pathlib.Path(src)
    names = ("model.lora.rank", "model.lora.alpha", "model.lora.target_modules")
    try:
        base = lora.read_adapter_config(folder).get("base_model_name_or_path")
        lora.read_peft_adapter(model, folder, names=names)
    except lora.PeftAdapterError as e:
        msg = str(e).replace(f"{folder}{os.sep}", "")  # the files' names, the folder is named once
        raise TrainingError(f"model.lora.init_from = {src!r}: {msg}") from None
    ours = [pathlib.Path(p).resolve() for p in (model_path, cfg.model.path) if p and not is_remote(str(p))]
    if (
        isinstance(base, str)
        and base
        and pathlib.Path(base).is_dir()
        and ours
        and pathlib.Path(base).resolve() not in ours
    ):
        log(f"model.lora.init_from: {src}'s adapters were trained on {base}, not on this run's model {ours[0]}")
    log(
        f"model.lora.init_from: the KL reference's adapters are {src}'s (the checkpoint's are restored)"
        if resume
        else f"model.lora.init_from: the adapters start from {src}"
    )
    return model


def encode_rows(rows: Sequence[PromptRow], tokenizer, cfg: Config) -> tuple[list[list[int]], list[int]]:
    """Token ids of each row's prompt; rows longer than data.max_prompt_len are reported and left out. With
    tool.enabled (hermes format) a chat template is given the code interpreter's schema."""
    ids, keep = [], []
    for i, row in enumerate(rows):
        text = format_prompt(row.problem, cfg.data.prompt_template, tokenizer, tools=cfg.tool.prompt_tools())
        # a rendered chat template carries its own special tokens; otherwise the tokenizer's default BOS rule
        toks = tokenizer.encode(text, add_bos=False if cfg.data.prompt_template == "chat" else None)
        if len(toks) <= cfg.data.max_prompt_len:
            ids.append(toks)
            keep.append(i)
    return ids, keep


# ----------------------------------------------------------------------------------------------------------------
# The compiled step's static config and initial state

# TrainStepConfig fields that are not rl.* options of the same name; train_step_config computes each
DERIVED_STEP_FIELDS = (
    "optimizer",
    "stare",
    "policy_loss",
    "loss_agg_constant",
    "num_micro_batches",
    "num_mini_batches",
    "debug_outputs",
    "seed",
)


def train_step_config(cfg: Config, mesh=None) -> TrainStepConfig:
    """The static TrainStepConfig of the jitted step, derived from the run config: every field named like an rl.*
    option is that option (by name, never copied by hand); the rest (DERIVED_STEP_FIELDS) are computed here."""
    rl = cfg.rl
    B = rl.train_batch_size * rl.group_size
    if B % rl.mini_batches:
        raise TrainingError(
            f"rl.train_batch_size x rl.group_size = {B} is not divisible by rl.mini_batches={rl.mini_batches}"
        )
    mini = B // rl.mini_batches
    per_micro = rl.micro_batch_size * batch_shards(mesh)
    if mini % per_micro:
        raise TrainingError(
            f"a mini-batch of {mini} sequences does not split into micro-batches of rl.micro_batch_size="
            f"{rl.micro_batch_size} x {batch_shards(mesh)} data shards"
        )
    # scope micro_batch ranks groups of rl.micro_batch_size unless rl.stare / rl.policy_loss say otherwise
    stare = (
        rl.stare
        if rl.stare.scope != "micro_batch" or rl.stare.micro_batch_size
        else dataclasses.replace(rl.stare, micro_batch_size=rl.micro_batch_size)
    )
    pl = rl.policy_loss
    if "micro_batch_size" in pl.options() and not pl.micro_batch_size:
        pl = dataclasses.replace(pl, micro_batch_size=rl.micro_batch_size)
    # the optimizer's schedule counts updates: rl.mini_batches x rl.ppo_epochs of them per RL step
    opt = (
        cfg.optimizer
        if cfg.optimizer.total_steps
        else dataclasses.replace(cfg.optimizer, total_steps=cfg.total_steps * rl.mini_batches * rl.ppo_epochs)
    )
    longest = cfg.data.max_prompt_len + cfg.sampling.max_new_tokens
    if rl.packing.enabled and 0 < rl.packing.row_tokens < longest:
        raise TrainingError(
            f"rl.packing.row_tokens={rl.packing.row_tokens} is shorter than the longest sequence a "
            f"step can hold (data.max_prompt_len {cfg.data.max_prompt_len} + sampling.max_new_tokens "
            f"{cfg.sampling.max_new_tokens} = {longest}); sequences are never split across rows: set "
            f"it >= {longest}, or 0 for the padded length"
        )
    by_name = {
        f.name: getattr(rl, f.name) for f in dataclasses.fields(TrainStepConfig) if f.name not in DERIVED_STEP_FIELDS
    }
    try:
        return TrainStepConfig(
            optimizer=opt,
            stare=stare,
            policy_loss=pl,
            loss_agg_constant=float(cfg.sampling.max_new_tokens),
            num_micro_batches=mini // per_micro,
            num_mini_batches=rl.mini_batches,
            seed=cfg.seed,
            **by_name,
        )
    except ValueError as e:  # a combination the step refuses (e.g. packing with a per-micro-batch selection)
        raise TrainingError(str(e)) from None


def checkpoint_tree(cfg: Config, train_state: TrainState, stare_state: StareState) -> dict:
    """What a checkpoint holds of the run state: the train state and the controller state. A LoRA run leaves out
    the frozen base (TrainState.rest: the weights of model.path, which never change), so each save writes the
    adapters, their optimizer state and the step, not the whole model again; `restored_train_state` puts the base
    back on restore."""
    if cfg.model.lora.enabled:
        train_state = dataclasses.replace(train_state, rest=None)
    return {"train_state": train_state, "stare_state": stare_state}


def restored_train_state(cfg: Config, restored: TrainState, current: TrainState) -> TrainState:
    """The restored train state, with a LoRA run's frozen base taken from `current` (loaded from model.path)."""
    return dataclasses.replace(restored, rest=current.rest) if cfg.model.lora.enabled else restored


def init_run_state(model, tcfg: TrainStepConfig, mesh=None) -> tuple[nnx.GraphDef, TrainState, StareState]:
    """(graphdef, train state, controller state) of a new run, committed to their devices as the step's outputs
    are (so the second step does not recompile): the train state on its shardings, the controller replicated."""
    graphdef, train_state = init_train_state(model, tcfg)
    if mesh is None:
        stare_state = init_stare_state(tcfg.stare)
        train_state, stare_state = jax.device_put((train_state, stare_state), jax.local_devices()[0])
        return graphdef, train_state, stare_state
    train_state = place_train_state(train_state, mesh)
    # created replicated by a jitted init: device_put would compare the NaN last_entropy across processes
    stare_state = jax.jit(lambda: init_stare_state(tcfg.stare), out_shardings=NamedSharding(mesh, PartitionSpec()))()
    return graphdef, train_state, stare_state


def reference_params(cfg: Config, params, mesh=None, *, log: Callable[[str], None] = print):
    """The frozen reference policy of rl.kl.reference, sharded like the policy's `params` (same shardings and dtypes;
    no optimizer state), or None without one. "initial": a copy of `params`, which must be the run's starting weights
    (open_run calls this before a checkpoint is restored, so on resume the reference is re-derived from model.path,
    never taken from the restored policy). A Hugging Face folder: its weights, which must have the policy's
    parameter shapes. The reference is not checkpointed: it is derived again whenever a run opens."""
    ref = cfg.rl.kl.reference
    if ref is None:
        return None
    shardings = jax.tree.map(lambda x: x.sharding, params)
    if ref == "initial":  # a copy: the train state (and so `params`) is donated to the step
        return jax.jit(lambda p: jax.tree.map(jnp.copy, p), out_shardings=shardings)(params)
    path = local_copy(ref, log=log) if is_remote(ref) else pathlib.Path(ref)
    if not (path / "config.json").is_file():
        raise TrainingError(
            f"rl.kl.reference = {ref!r} is neither 'initial' nor a Hugging Face folder (no config.json there)"
        )
    _, loaded, _ = split_model(models.from_pretrained(path, mesh=mesh, **cfg.model.architecture_overrides()))

    def layout(tree):
        return [(jax.tree_util.keystr(k), x.shape, x.dtype) for k, x in jax.tree_util.tree_leaves_with_path(tree)]

    if layout(loaded) != layout(params):
        raise TrainingError(
            f"rl.kl.reference = {ref!r}: its parameters differ from the policy's (another "
            f"architecture or size); the reference must be the policy's architecture"
        )
    log(f"rl.kl.reference: frozen reference policy loaded from {ref}")
    return jax.device_put(loaded, shardings)


def make_sampler(
    model, cfg: Config, mesh, pad_id: int | None, log: Callable[[str], None] | None = None
) -> Sampler | Engine:
    """The run's generator per sampling.engine.enabled (sampling.engine.make_generator): the rollout engine
    (continuous batching over paged KV) or the static sampler; both draw the same samples. With tool.enabled,
    auto means the engine (the multi-turn rollouts need its append-and-continue). sampling.engine.max_slots=auto
    is resolved into a number for this host's devices (stare_jax.planning.estimate.auto_max_slots) when the engine is
    built, and the number logged."""

    def resolve_slots(engine: EngineConfig) -> EngineConfig:
        if engine.max_slots != "auto":
            return engine
        acc = live_accelerator()
        slots = auto_max_slots(cfg, acc)
        (log or print)(
            f"sampling.engine.max_slots=auto -> {slots} ("
            + (
                f"fits {acc.name}'s {acc.hbm_bytes / 2**30:.1f} GiB per device by the plan's estimate)"
                if acc
                else "no HBM figure on this host: one slot per response of a generation batch)"
            )
        )
        return dataclasses.replace(engine, max_slots=slots)

    engine = cfg.sampling.engine
    if cfg.tool.enabled and engine.enabled == "auto":
        engine = dataclasses.replace(engine, enabled=True)
    try:
        return make_generator(
            model,
            config=engine,
            max_new_tokens=cfg.sampling.max_new_tokens,
            mesh=mesh,
            cache_dtype=cfg.sampling.kv_cache_dtype,
            pad_id=pad_id,
            resolve=resolve_slots,
            compute_dtype=cfg.sampling.dtype,
        )
    except ValueError as e:
        raise TrainingError(str(e)) from None


def make_tool_pool(cfg: Config, sampler: Sampler | Engine) -> SandboxPool | None:
    """The code interpreter's sandbox pool when tool.enabled (the multi-turn rollouts need the rollout engine's
    append-and-continue), else None."""
    if not cfg.tool.enabled:
        return None
    if not isinstance(sampler, Engine):
        raise TrainingError(
            "tool.enabled: multi-turn tool rollouts need the rollout engine (set sampling.engine.enabled=true)"
        )
    return make_pool(cfg.tool)


def abstract_like(tree):
    """ShapeDtypeStructs with the shardings of a tree of arrays: what a checkpoint is restored into."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
