"""`stare-jax train`: the RL loop that joins the parts.

One RL step (the paper's Algorithm 1; docs/architecture.md's data flow), each a named stage:
    collect   (collect.collect_batch)  PromptStream -> Sampler: G rollouts per prompt -> verifier: rewards
                                        -> dynamic sampling (top up from further generation batches) -> advantages
                                        -> train batch (tool.enabled: multi-turn tool rollouts, tools/rollout.py)
    update    (Run.update)              the jitted step: no-grad pass (old log-probs, entropy; the frozen
                                        reference's log-probs with rl.kl) -> gate/W/M -> omega -> micro-batch scan
                                        -> AdamW
    record    (step_record)             one flat metrics record per step
    evaluate  (Run.evaluate)            periodic avg@N on the eval sets
    checkpoint (Run.save)               orbax checkpoints with the data iterator state
`open_run` builds a Run (inputs, run folder, data, model, state, sampler, writers; restored when resuming) and
`run_training` is the loop over these stages.

Randomness is a pure function of (seed, step, generation batch), and the data iterator state is checkpointed, so a
resumed run continues exactly where the interrupted one was.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import time
from typing import Any, Callable

import jax
from flax import nnx

from stare_jax import distributed as dist, models
from stare_jax.config import resume as run_config
from stare_jax.config.loader import Config, save_config
from stare_jax.data.prompts import PromptStream, read_rows
from stare_jax.data.tokenizer import load_tokenizer
from stare_jax.eval.benchmarks import DEFAULT_PROTOCOL
from stare_jax.eval.runner import EvalSet, evaluate
from stare_jax.models.sharding import batch_shards, mesh_for_config
from stare_jax.rl.packing import host_layout
from stare_jax.rl.stare import StareState
from stare_jax.rl.step import TrainState, TrainStepConfig, make_train_step
from stare_jax.sampling import Engine, Sampler, next_bucket
from stare_jax.tools.pool import SandboxPool
from stare_jax.training.checkpoint import Checkpointer, PreemptionHandler, install_preemption_handler
from stare_jax.training.collect import CollectedBatch, RewardFn, batch_seed, collect_batch, reward_fn_for
from stare_jax.training.metrics import REQUIRED_STEP_KEYS, MetricsWriter, ProgressBar
from stare_jax.training.run_dir import RunDir
from stare_jax.training.setup import (
    InputsFn,
    RunInputs,
    TrainingError,
    abstract_like,
    checkpoint_tree,
    encode_rows,
    init_adapters,
    init_distributed,
    init_run_state,
    make_sampler,
    make_tool_pool,
    reference_params,
    resolve_inputs,
    restored_train_state,
    train_step_config,
)

__all__ = ["Run", "TrainingError", "compile_count", "open_run", "run_training", "step_record", "train_step_config"]

_COMPILES = [0]


def _count_compile(event: str, duration_secs: float, **kwargs) -> None:
    if event == "/jax/core/compile/jaxpr_to_mlir_module_duration":  # one per jit cache miss (lowering)
        _COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)


def compile_count() -> int:
    """Programs lowered (jit cache misses) so far in this process: a step after warm-up should add none."""
    return _COMPILES[0]


# ----------------------------------------------------------------------------------------------------------------
# The record stage


def reweighting_active(cfg: Config, step_metrics) -> bool:
    """Whether STARE reweighted this step: never for GRPO-ds; always for gate 'none'; the controller's flag for the
    batch gate; any gated token for the sample/token gates."""
    s = cfg.rl.stare
    if not s.enabled:
        return False
    if s.gate == "none":
        return True
    if s.gate == "batch":
        return bool(step_metrics["gate_on"])
    return float(step_metrics.get("stare/gate_frac", 0.0)) > 0


# the train step's metric families the record carries as they are (rollout_corr/*: the sampler/trainer mismatch)
LOGGED_STEP_PREFIXES = ("theory/", "token_filter/", "kl", "entropy_adv/", "rollout_corr/")


def step_record(cfg: Config, collected: CollectedBatch, m: dict, *, step_time_s: float, train_time_s: float) -> dict:
    """The metrics record of one step from what collection saw and the train step's (host) metrics `m`."""
    stare_on = cfg.rl.stare.enabled
    return {
        "entropy": float(m["entropy"]),
        "target_entropy": cfg.rl.stare.target_entropy,
        **collected.metrics(),
        "gate_on": reweighting_active(cfg, m),
        "stare_enabled": stare_on,
        # GRPO-ds never reweights: its effective W and M are 1 (the controller's values are unused)
        "stare_w": float(m["stare_w"]) if stare_on else 1.0,
        "stare_m": float(m["stare_m"]) if stare_on else 1.0,
        "selected_frac_pos": float(m.get("stare/frac_pos_high", m.get("stare/frac_pos_low", 0.0))),
        "selected_frac_neg": float(m.get("stare/frac_neg_high", m.get("stare/frac_neg_low", 0.0))),
        **{k: float(m[k]) for k in ("clipfrac", "clipfrac_lower", "approx_kl", "loss", "grad_norm", "skipped_updates")},
        **{f"stare/{k[6:]}": float(v) for k, v in m.items() if k.startswith("stare/")},
        **{k: float(v) for k, v in m.items() if k.startswith(LOGGED_STEP_PREFIXES)},
        "step_time_s": step_time_s,
        "train_time_s": train_time_s,
    }


def update_was_finite(record: dict) -> bool:
    """False when the step's loss or gradient was non-finite (the step then skipped its update)."""
    return math.isfinite(record["loss"]) and record["skipped_updates"] == 0


# ----------------------------------------------------------------------------------------------------------------
# A run: what the loop holds between steps, and its stages


@dataclasses.dataclass
class Run:
    cfg: Config
    rd: RunDir
    tokenizer: object
    stream: PromptStream
    prompt_of: dict  # id(row) -> prompt token ids
    eval_sets: list[EvalSet]
    prompt_len: int  # the sampler's prompt bucket (train and eval prompts)
    graphdef: nnx.GraphDef
    train_state: TrainState
    stare_state: StareState
    step_fn: Callable
    step_config: TrainStepConfig
    sampler: Sampler | Engine
    reward_fn: RewardFn
    ckpt: Checkpointer
    writer: MetricsWriter
    preempt: PreemptionHandler
    bar: ProgressBar
    start_step: int
    ref_params: Any = None  # the frozen reference policy (rl.kl.reference), never updated nor checkpointed
    tool_pool: SandboxPool | None = None  # the code interpreter's sandbox (tool.enabled)

    def refresh_sampler(self) -> None:
        """The sampler decodes with the current policy."""
        self.sampler.update_params(nnx.merge(self.graphdef, self.train_state.params, self.train_state.rest))

    def collect(self, step: int) -> CollectedBatch:
        """Stage 1: the step's train batch (sample -> score -> dynamic sampling -> advantages)."""
        self.refresh_sampler()
        return collect_batch(
            self.sampler,
            self.stream,
            lambda row: self.prompt_of[id(row)],
            rl=self.cfg.rl,
            sampling=self.cfg.sampling,
            tokenizer=self.tokenizer,
            reward_fn=self.reward_fn,
            prompt_len=self.prompt_len,
            seed=self.cfg.seed,
            step=step,
            tool=self.cfg.tool,
            tool_pool=self.tool_pool,
        )

    def update(self, batch: dict) -> tuple[dict, float]:
        """Stage 2: one jitted GRPO/STARE step on the batch; (host metrics, seconds)."""
        batch = host_layout(batch, self.step_config, batch_shards(self.sampler.mesh))  # packed / length bucket
        if dist.is_multiprocess():  # the same host batch on every process -> one global array
            assert self.sampler.mesh is not None  # several processes always share a mesh
            batch = dist.global_batch(batch, self.sampler.mesh)
        self.sampler.release()  # the sampler's weight copy is not alive during the train step
        t0 = time.time()
        self.train_state, self.stare_state, m = self.step_fn(self.train_state, batch, self.stare_state, self.ref_params)
        return jax.device_get(m), time.time() - t0

    def evaluate(self, step: int) -> dict:
        """eval/* metrics of the current policy on the eval sets (empty without eval sets), through the tool
        rollouts when tool.enabled (and eval_notool/* without them when tool.eval_without_tool)."""
        if not self.eval_sets:
            return {}
        self.refresh_sampler()
        s = self.cfg.sampling
        kw: dict[str, Any] = dict(
            tokenizer=self.tokenizer,
            reward_fn=self.reward_fn,
            prompt_len=self.prompt_len,
            max_new_tokens=s.max_new_tokens,
            seed=batch_seed(self.cfg.seed, step, 99_991),
            batch_prompts=s.max_prompts_per_call or 256,
        )
        out = evaluate(self.sampler, self.eval_sets, tool=self.cfg.tool, tool_pool=self.tool_pool, **kw)
        if self.cfg.tool.enabled and self.cfg.tool.eval_without_tool:
            out.update(
                {
                    k.replace("eval/", "eval_notool/", 1): v
                    for k, v in evaluate(self.sampler, self.eval_sets, **kw).items()
                }
            )
        return out

    def eval_due(self, done: int) -> bool:
        every = self.cfg.logging.eval_every_steps
        return bool(every) and (done % every == 0 or done == self.cfg.total_steps)

    def save(self, step: int, force: bool = False) -> None:
        """A checkpoint (when due, or forced) of the train and controller state and the data iterator."""
        self.ckpt.save(
            step,
            checkpoint_tree(self.cfg, self.train_state, self.stare_state),
            {"data": self.stream.state(), "step": step, "seed": self.cfg.seed},
            force=force,
        )

    def log(self, done: int, record: dict) -> dict:
        """Write the step's record (metrics.jsonl, TensorBoard, progress bar); returns the record as written."""
        written = self.writer.log(done, record)
        self.bar.update(written)
        return written

    def mirror(self, done: int) -> None:
        """Push the run folder's outputs to its remote copy (checkpoints too on checkpoint steps), if remote."""
        if jax.process_index() == 0:
            self.rd.push(with_dirs=done % max(self.cfg.checkpoint.every_steps, 1) == 0)

    def stop_on_nonfinite(self, step: int, record: dict) -> None:
        """checkpoint.on_nan=stop: write the record, save the pre-step state and raise; skip: only log it."""
        if self.cfg.checkpoint.on_nan == "stop":
            self.writer.log(step + 1, record)
            self.save(step, force=True)
            raise TrainingError(
                f"non-finite loss/gradient at step {step + 1}: the update was skipped and the run stopped "
                f"(checkpoint.on_nan=stop); parameters from before this step are saved at "
                f"{self.rd.checkpoints} step {step}"
            )

    def close(self) -> None:
        self.ckpt.wait()
        self.ckpt.close()
        self.writer.close()
        if jax.process_index() == 0:
            self.rd.push(with_dirs=True)
        self.bar.close()
        self.reward_fn.close()
        if self.tool_pool is not None:
            self.tool_pool.close()
        self.preempt.uninstall()


def run_training(
    cfg: Config,
    run_dir: str | pathlib.Path,
    *,
    resume: bool = False,
    require_checkpoint: bool = False,
    allow_config_change: bool = False,
    distributed: tuple = (None, None, None),
    inputs_for: InputsFn = resolve_inputs,
    log: Callable[[str], None] = print,
) -> dict:
    """Train per `cfg`, writing everything under run_dir; returns a summary dict. A stop signal (Ctrl-C, SIGTERM:
    the PreemptionHandler) ends it after the step under way, saved; the summary then has "stopped", "stop_signal"
    (SIGINT, SIGTERM; None when only another process got one), "stop_reason" (its words) and "checkpoint" (the
    saved step's folder), which the caller reports.

    resume: continue from RUN_DIR's newest checkpoint if it has one, else start a new run there (what the launch
    scripts pass); with require_checkpoint a missing checkpoint is an error instead. A resumed run keeps its
    config: a change beyond the operational keys (stare_jax.config.resume) is refused unless allow_config_change;
    every change on resume is recorded in RUN_DIR/config_changes.jsonl.

    inputs_for(cfg, log) -> (cfg, RunInputs) resolves the model, tokenizer and data once the processes are
    connected: the checkpoint paths the config names by default; the entry points pass
    stare_jax.toy.assets.run_inputs for the embedded toy."""
    t_start = time.time()
    init_distributed(*distributed)
    run = open_run(
        cfg,
        run_dir,
        resume=resume,
        require_checkpoint=require_checkpoint,
        allow_config_change=allow_config_change,
        inputs_for=inputs_for,
        log=log,
    )
    cfg = run.cfg
    summary: dict = {"steps_run": 0, "stopped": None, "new_compiles_per_step": []}
    last_record: dict = {}
    try:
        # the policy before any RL update is evaluated once; step 1's record carries it as eval_start/* (and
        # eval_start_notool/*)
        pending = (
            {k.replace("eval", "eval_start", 1): v for k, v in run.evaluate(0).items()}
            if cfg.logging.eval_every_steps and run.start_step == 0
            else {}
        )
        for step in range(run.start_step, cfg.total_steps):
            t0, compiles_before = time.time(), compile_count()
            collected = run.collect(step)
            metrics, train_s = run.update(collected.batch)
            record = step_record(cfg, collected, metrics, step_time_s=time.time() - t0, train_time_s=train_s)
            if not update_was_finite(record):
                run.stop_on_nonfinite(step, record)
                log(f"step {step + 1}: non-finite loss/gradient, update skipped (checkpoint.on_nan=skip)")
            done = step + 1
            if run.eval_due(done):
                pending.update(run.evaluate(done))
            record.update(pending)
            pending = {}
            last_record = run.log(done, record)
            run.save(done)
            run.mirror(done)
            summary["steps_run"] += 1
            summary["new_compiles_per_step"].append(compile_count() - compiles_before)
            if dist.any_process(run.preempt.should_stop(done)):  # every process stops at the same step
                run.save(done, force=True)
                # the entry point's last line names them (stare_jax.cli.train, experiments.demo.train_arm)
                summary["stopped"] = f"preempted (signal) after step {done}"
                summary["stop_signal"] = run.preempt.signal_name
                summary["stop_reason"] = run.preempt.reason()
                summary["checkpoint"] = f"{run.rd.checkpoints}/{done}"
                break
        else:
            run.save(cfg.total_steps, force=True)
    finally:
        run.close()
    summary.update({"run_dir": str(run_dir), "wall_s": time.time() - t_start, "last": last_record})
    if jax.process_index() == 0:
        (run.rd.local / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
        run.rd.push()
    return summary


# ----------------------------------------------------------------------------------------------------------------
# Opening a run


def check_run_dir(
    rd: RunDir,
    cfg: Config,
    run_dir,
    *,
    resume: bool,
    require_checkpoint: bool,
    allow_config_change: bool,
    log: Callable[[str], None],
) -> tuple[bool, dict]:
    """(resume, config changes): whether the run folder is resumed, and how the config differs from its saved one.
    Refuses to overwrite a run, to resume without a checkpoint when required, and disallowed config changes."""
    if resume and not rd.has_checkpoint():
        if require_checkpoint:
            raise TrainingError(f"--resume --require-checkpoint: no checkpoint in {rd.checkpoints}")
        if rd.exists("metrics.jsonl"):
            raise TrainingError(
                f"{run_dir} holds a run (metrics.jsonl) but no checkpoint to resume from; use a new --run-dir"
            )
        log(f"--resume: no checkpoint in {run_dir}, starting a new run there")
        resume = False
    changes = (
        run_config.check_resume_config(rd.root, cfg, allow=allow_config_change, run_dir=str(run_dir)) if resume else {}
    )
    if rd.exists("metrics.jsonl") and not resume:
        raise TrainingError(f"{run_dir} already holds a run (metrics.jsonl); use --resume or a new --run-dir")
    return resume, changes


def load_eval_sets(cfg: Config, eval_rows: dict, tokenizer) -> list[EvalSet]:
    """Each eval file tokenized, with its benchmark's protocol (samples per problem) unless the config sets it."""
    sets = []
    for name, rows in eval_rows.items():
        ids, keep = encode_rows(rows, tokenizer, cfg)
        n = cfg.sampling.eval_num_samples or DEFAULT_PROTOCOL.get(name, {}).get("n", 4)
        sets.append(
            EvalSet(
                name,
                ids,
                [rows[i].answer for i in keep],
                n,
                temperature=cfg.sampling.eval_temperature,
                top_p=cfg.sampling.eval_top_p,
            )
        )
    return sets


def open_run(
    cfg: Config,
    run_dir: str | pathlib.Path,
    *,
    resume: bool,
    require_checkpoint: bool = False,
    allow_config_change: bool = False,
    inputs_for: InputsFn = resolve_inputs,
    log: Callable[[str], None] = print,
) -> Run:
    """Everything the loop needs, in the order that fails fastest: inputs, run folder, data, then model, state,
    sampler and writers; restored from the newest checkpoint when resuming."""
    rd = RunDir.for_run(run_dir)  # local folder, or gs://... with a local mirror of the text outputs
    cfg, inputs = inputs_for(cfg, log)
    resume, changes = check_run_dir(
        rd,
        cfg,
        run_dir,
        resume=resume,
        require_checkpoint=require_checkpoint,
        allow_config_change=allow_config_change,
        log=log,
    )
    dist.barrier("stare_jax_run_dir_checked")  # every process decided before process 0 writes into the run dir
    # data first: a bad row fails in a second, before any model is loaded
    fields = dict(prompt_field=cfg.data.prompt_field, answer_field=cfg.data.answer_field)
    rows = read_rows(inputs.train_path, **fields)
    eval_rows = {name: read_rows(path, **fields) for name, path in inputs.eval_paths.items()}
    if jax.process_index() == 0:
        if not resume:
            rd.reset_mirror()
        save_config(cfg, rd.local)
        rd.push()
    mesh = mesh_for_config(cfg.mesh)
    tokenizer = load_tokenizer(inputs.tokenizer_path)
    model = models.from_pretrained(inputs.model_path, mesh=mesh, **cfg.model.architecture_overrides())
    model = init_adapters(model, cfg, inputs.model_path, resume=resume, log=log)  # model.lora.init_from
    stream, prompt_of = _prompt_stream(cfg, rows, tokenizer, inputs, log)
    eval_sets = load_eval_sets(cfg, eval_rows, tokenizer)
    prompt_len = next_bucket(
        max(len(p) for p in [*prompt_of.values(), *(q for es in eval_sets for q in es.prompts)]), 16
    )
    tcfg = train_step_config(cfg, mesh)
    graphdef, train_state, stare_state = init_run_state(model, tcfg, mesh)
    # before any restore: "initial" is the run's starting weights (model.path), on resume too
    ref_params = reference_params(cfg, train_state.params, mesh, log=log)
    step_fn = make_train_step(graphdef, tcfg, mesh=mesh, train_state=train_state)
    sampler = make_sampler(model, cfg, mesh, tokenizer.pad_id, log=log)
    ckpt = Checkpointer(
        rd.checkpoints,
        keep=cfg.checkpoint.keep,
        every_steps=cfg.checkpoint.every_steps,
        async_save=cfg.checkpoint.async_save,
        must_exist=resume,
    )
    start_step = 0
    if resume:
        restored = ckpt.restore(
            abstract_state=abstract_like(checkpoint_tree(cfg, train_state, stare_state)),
            fallback_to_intact=True,
        )
        train_state = restored_train_state(cfg, restored.state["train_state"], train_state)
        stare_state = restored.state["stare_state"]
        stream.restore(restored.extra["data"])
        start_step = int(restored.extra["step"])
        log(f"resumed from {rd.checkpoints} at step {start_step}")
        if changes and jax.process_index() == 0:
            run_config.record_changes(rd.root, start_step, changes, allowed=allow_config_change)
            log(
                f"config changed on resume at step {start_step}: {', '.join(changes)} "
                f"(recorded in {run_dir}/{run_config.CHANGES_FILE})"
            )
        if jax.process_index() == 0:
            rd.pull()  # a remote run's earlier metrics, so the writer appends to (and trims) the full history
    writer = MetricsWriter(
        rd.local,
        tensorboard=cfg.logging.tensorboard,
        wandb_project=cfg.logging.wandb_project,
        resume_step=start_step if resume else None,
        required_keys=REQUIRED_STEP_KEYS,
    )
    bar = ProgressBar(
        cfg.total_steps, start_step=start_step, enabled=cfg.logging.progress_bar and jax.process_index() == 0
    )
    return Run(
        cfg,
        rd,
        tokenizer,
        stream,
        prompt_of,
        eval_sets,
        prompt_len,
        graphdef,
        train_state,
        stare_state,
        step_fn,
        tcfg,
        sampler,
        reward_fn_for(cfg.data.task),
        ckpt,
        writer,
        install_preemption_handler(),
        bar,
        start_step,
        ref_params=ref_params,
        tool_pool=make_tool_pool(cfg, sampler),
    )


def _prompt_stream(
    cfg: Config, rows: list, tokenizer, inputs: RunInputs, log: Callable[[str], None]
) -> tuple[PromptStream, dict]:
    """The shuffled stream of generation batches over the rows whose prompts fit data.max_prompt_len, and each
    kept row's prompt token ids (by id(row))."""
    prompt_ids, keep = encode_rows(rows, tokenizer, cfg)
    if len(keep) < len(rows):
        log(
            f"data: {len(rows) - len(keep)} of {len(rows)} rows of {inputs.train_path} have prompts longer than "
            f"data.max_prompt_len={cfg.data.max_prompt_len} tokens and are left out"
        )
    kept = [rows[i] for i in keep]
    stream = PromptStream(kept, cfg.rl.gen_batch_size, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    return stream, {id(r): p for r, p in zip(kept, prompt_ids)}
