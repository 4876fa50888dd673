"""`stare-jax train`: the RL loop that joins the parts.

One RL step (DESIGN.md's data flow):
    PromptStream (grain)  -> prompts (paper instruction / chat template / raw) -> tokens
    Sampler               -> G rollouts per prompt (array API, left-padded prompt bucket)
    verifier              -> rewards (math: sandboxed RewardPool; digit_sum: exact string check)
    dynamic sampling      -> keep groups with reward spread, top up from further generation batches
    grpo_advantages       -> per-response advantages
    train step (jitted)   -> no-grad pass (old log-probs, entropy) -> gate/W/M -> omega -> micro-batch scan -> AdamW
    MetricsWriter         -> RUN_DIR/metrics.jsonl (+ timing.jsonl, TensorBoard); periodic eval; orbax checkpoints

Randomness is a pure function of (seed, step, generation batch), and the data iterator state is checkpointed, so a
resumed run continues exactly where the interrupted one was.
"""
from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from stare_jax import distributed as dist
from stare_jax import run_config
from stare_jax.config import Config, save_config
from stare_jax.data.prompts import PromptRow, PromptStream, format_prompt, read_rows
from stare_jax.eval.runner import EvalSet, evaluate
from stare_jax.models.sharding import mesh_for_config
from stare_jax.rewards import rollout_rewards
from stare_jax.rollouts import RewardFn, Rollouts, add_counts, generate_rollouts
from stare_jax.run_dir import RunDir, is_remote, local_copy


class TrainingError(RuntimeError):
    """The run cannot continue (the message says why and what was saved)."""


_COMPILES = [0]


def _count_compile(name: str, *_, **__) -> None:
    if name == "/jax/core/compile/jaxpr_to_mlir_module_duration":  # one per jit cache miss (lowering)
        _COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)


def compile_count() -> int:
    """Programs lowered (jit cache misses) so far in this process: a step after warm-up should add none."""
    return _COMPILES[0]


# ----------------------------------------------------------------------------------------------------------------
# Configuration of the compiled step from the run config


def train_step_config(cfg: Config, mesh=None):
    """The static TrainStepConfig of the jitted step, derived from the run config."""
    from stare_jax.rl.train_step import OptimizerConfig, TrainStepConfig
    from stare_jax.sampling.sharding import data_size as data_shards  # the batch (data x fsdp) shard count

    rl, s, o = cfg.rl, cfg.rl.stare, cfg.optimizer
    B = rl.train_batch_size * rl.group_size
    if B % rl.mini_batches:
        raise TrainingError(f"rl.train_batch_size x rl.group_size = {B} is not divisible by "
                            f"rl.mini_batches={rl.mini_batches}")
    mini = B // rl.mini_batches
    per_micro = rl.micro_batch_size * data_shards(mesh)
    if mini % per_micro:
        raise TrainingError(
            f"a mini-batch of {mini} sequences does not split into micro-batches of rl.micro_batch_size="
            f"{rl.micro_batch_size} x {data_shards(mesh)} data shards")
    # rl.stare is the step's StareConfig; scope micro_batch ranks groups of rl.micro_batch_size unless it says otherwise
    stare = s if s.scope != "micro_batch" or s.micro_batch_size else dataclasses.replace(
        s, micro_batch_size=rl.micro_batch_size)
    schedule = {"constant": "constant", "linear": "linear_warmup", "cosine": "cosine"}[o.schedule]
    opt = OptimizerConfig(lr=o.lr, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay, grad_clip=o.grad_clip,
                          schedule=schedule, warmup_steps=o.warmup_steps, total_steps=cfg.total_steps)
    return TrainStepConfig(
        optimizer=opt, stare=stare, clip_low=rl.clip_low, clip_high=rl.clip_high, clip_c=rl.clip_c,
        loss_agg=rl.loss_agg, loss_agg_constant=float(cfg.sampling.max_new_tokens),
        num_micro_batches=mini // per_micro, num_mini_batches=rl.mini_batches, ppo_epochs=rl.ppo_epochs,
        logprob_chunk_size=rl.logprob_chunk_size, theory_diagnostics=s.theory_diagnostics)


def build_mesh(cfg: Config, devices=None):
    """None on a single device; otherwise the configured (data, fsdp, tensor) mesh over `devices` (default all)."""
    return mesh_for_config(cfg.mesh, devices)


# ----------------------------------------------------------------------------------------------------------------
# From rollouts to a train batch


def train_batch_from_rollouts(r: Rollouts, advantages_PxG: np.ndarray) -> dict:
    """[P*G, T+N] prompt + response ids with attention/response masks, response-major within each prompt."""
    P, G, N = r.tokens_PxGxN.shape
    T = r.prompt_ids_PxT.shape[1]
    resp_mask = (np.arange(N)[None, None, :] < r.lengths_PxG[..., None]).astype(np.int32)
    ids = np.concatenate([np.repeat(r.prompt_ids_PxT[:, None], G, 1), r.tokens_PxGxN], axis=2)
    attn = np.concatenate([np.repeat(r.prompt_mask_PxT[:, None], G, 1), resp_mask], axis=2)
    resp = np.concatenate([np.zeros((P, G, T), np.int32), resp_mask], axis=2)
    ids = np.where(attn > 0, ids, 0)
    return {"input_ids_BxT": ids.reshape(P * G, T + N), "attention_mask_BxT": attn.reshape(P * G, T + N),
            "response_mask_BxT": resp.reshape(P * G, T + N),
            "advantages_B": advantages_PxG.reshape(P * G).astype(np.float32)}


# ----------------------------------------------------------------------------------------------------------------
# The run


@dataclasses.dataclass
class RunInputs:
    model_path: pathlib.Path
    tokenizer_path: pathlib.Path
    train_path: str | pathlib.Path  # a local path or an object-store URL (gs://...)
    eval_paths: dict


def resolve_inputs(cfg: Config, log: Callable[[str], None]) -> tuple[Config, RunInputs]:
    """Paths of the model, tokenizer and data; for the embedded toy default, builds (or reuses) its assets."""
    if cfg.toy.enabled:
        from stare_jax import toy

        t = cfg.toy
        asset_cfg = toy.asset_config(t)
        # multi-process: process 0 builds the assets first; the others then find them in a shared cache (or,
        # on hosts with their own disks, build the same deterministic assets themselves)
        if jax.process_index() == 0:
            assets = toy.prepare(asset_cfg, t.cache_dir, log=log)
        dist.barrier("stare_jax_toy_assets")
        if jax.process_index() != 0:
            assets = toy.prepare(asset_cfg, t.cache_dir, log=log)
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, task=t.task, prompt_template="raw"))
        return cfg, RunInputs(assets.model_dir, assets.model_dir / "tokenizer.model", assets.train_path,
                              {"heldout": str(assets.eval_path)})
    if not cfg.model.path:
        raise TrainingError("model.path is not set: point it at a Hugging Face checkpoint folder")
    if not cfg.data.train_path:
        raise TrainingError("data.train_path is not set: point it at a jsonl/parquet file of {problem, answer} rows")
    # a checkpoint on gs:// is copied to local disk once per host (the safetensors loader reads local files)
    local = lambda p: local_copy(p, log=log) if is_remote(p) else pathlib.Path(p)  # noqa: E731
    model_path = local(cfg.model.path)
    if not (model_path / "config.json").is_file():
        raise TrainingError(f"model.path {cfg.model.path} has no config.json (not a Hugging Face checkpoint folder)")
    tok_path = local(cfg.model.tokenizer_path) if cfg.model.tokenizer_path else model_path
    return cfg, RunInputs(model_path, tok_path, cfg.data.train_path, dict(cfg.data.eval_paths))


def encode_rows(rows: Sequence[PromptRow], tokenizer, cfg: Config) -> tuple[list[list[int]], list[int]]:
    """Token ids of each row's prompt; rows longer than data.max_prompt_len are reported and left out."""
    ids, keep = [], []
    for i, row in enumerate(rows):
        text = format_prompt(row.problem, cfg.data.prompt_template, tokenizer)
        # a rendered chat template carries its own special tokens; otherwise the tokenizer's default BOS rule
        toks = tokenizer.encode(text, add_bos=False if cfg.data.prompt_template == "chat" else None)
        if len(toks) <= cfg.data.max_prompt_len:
            ids.append(toks)
            keep.append(i)
    return ids, keep


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


def _seed_for(seed: int, step: int, j: int) -> int:
    return (seed * 1_000_003 + step * 1_009 + j) % (2**31 - 1)


def init_distributed(coordinator_address: str | None, num_processes: int | None, process_id: int | None) -> None:
    """jax.distributed.initialize for multi-process runs: explicit arguments (GPU over ssh, local CPU processes),
    or automatic on Cloud TPU / Slurm / when JAX_COORDINATOR_ADDRESS is set. Single-process runs skip it."""
    import os

    given = [coordinator_address, num_processes, process_id]
    if any(v is not None for v in given):
        if any(v is None for v in given):
            raise TrainingError("multi-process runs need all of --coordinator-address, --num-processes and "
                                "--process-id (or none of them, for automatic detection)")
        if not 0 <= process_id < num_processes:
            raise TrainingError(f"--process-id {process_id} is outside [0, --num-processes={num_processes})")
        # CPU cross-process collectives (local multi-process runs) go through gloo; GPU/TPU are unaffected
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                                   process_id=process_id)
    elif os.environ.get("JAX_COORDINATOR_ADDRESS") or os.environ.get("TPU_WORKER_HOSTNAMES", "").count(",") > 0:
        jax.distributed.initialize()


def run_training(cfg: Config, run_dir: str | pathlib.Path, *, resume: bool = False, require_checkpoint: bool = False,
                 allow_config_change: bool = False, distributed: tuple = (None, None, None),
                 log: Callable[[str], None] = print) -> dict:
    """Train per `cfg`, writing everything under run_dir; returns a summary dict.

    resume: continue from RUN_DIR's newest checkpoint if it has one, else start a new run there (what the launch
    scripts pass); with require_checkpoint a missing checkpoint is an error instead. A resumed run keeps its
    config: a change beyond the operational keys (stare_jax.run_config) is refused unless allow_config_change;
    every change on resume is recorded in RUN_DIR/config_changes.jsonl."""
    from flax import nnx

    from stare_jax import models
    from stare_jax.checkpoint import Checkpointer, install_preemption_handler
    from stare_jax.metrics import REQUIRED_STEP_KEYS, MetricsWriter, ProgressBar
    from stare_jax.rl.advantages import DynamicSamplingAccumulator, dynamic_sampling_keep_mask, grpo_advantages
    from stare_jax.rl.stare import init_stare_state
    from stare_jax.rl.train_step import init_train_state, make_train_step, place_train_state
    from stare_jax.sampling import Sampler, next_bucket
    from stare_jax.tokenizer import load_tokenizer

    rd = RunDir.for_run(run_dir)  # local folder, or gs://... with a local mirror of the text outputs
    t_start = time.time()
    init_distributed(*distributed)
    cfg, inputs = resolve_inputs(cfg, log)
    has_ckpt = rd.has_checkpoint()
    if resume and not has_ckpt:
        if require_checkpoint:
            raise TrainingError(f"--resume --require-checkpoint: no checkpoint in {rd.checkpoints}")
        if rd.exists("metrics.jsonl"):
            raise TrainingError(f"{run_dir} holds a run (metrics.jsonl) but no checkpoint to resume from; "
                                f"use a new --run-dir")
        log(f"--resume: no checkpoint in {run_dir}, starting a new run there")
        resume = False
    config_changes = (run_config.check_resume_config(rd.root, cfg, allow=allow_config_change, run_dir=str(run_dir))
                      if resume else {})
    if rd.exists("metrics.jsonl") and not resume:
        raise TrainingError(f"{run_dir} already holds a run (metrics.jsonl); use --resume or a new --run-dir")
    dist.barrier("stare_jax_run_dir_checked")  # every process decided before process 0 writes into the run dir
    # data first: a bad row fails in a second, before any model is loaded
    rows = read_rows(inputs.train_path, prompt_field=cfg.data.prompt_field, answer_field=cfg.data.answer_field)
    eval_rows = {name: read_rows(path, prompt_field=cfg.data.prompt_field, answer_field=cfg.data.answer_field)
                 for name, path in inputs.eval_paths.items()}
    if jax.process_index() == 0:
        if not resume:
            rd.reset_mirror()
        save_config(cfg, rd.local)
        rd.push()
    mesh = build_mesh(cfg)
    tokenizer = load_tokenizer(inputs.tokenizer_path)
    model = models.from_pretrained(inputs.model_path, mesh=mesh, **cfg.model.architecture_overrides())

    prompt_ids, keep = encode_rows(rows, tokenizer, cfg)
    if len(keep) < len(rows):
        log(f"data: {len(rows) - len(keep)} of {len(rows)} rows of {inputs.train_path} have prompts longer than "
            f"data.max_prompt_len={cfg.data.max_prompt_len} tokens and are left out")
    rows = [rows[i] for i in keep]
    prompt_of = {id(r): p for r, p in zip(rows, prompt_ids)}
    stream = PromptStream(rows, cfg.rl.gen_batch_size, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    eval_sets = []
    for name, erows in eval_rows.items():
        eids, ekeep = encode_rows(erows, tokenizer, cfg)
        from stare_jax.eval.benchmarks import DEFAULT_PROTOCOL

        n = cfg.sampling.eval_num_samples or DEFAULT_PROTOCOL.get(name, {}).get("n", 4)
        eval_sets.append(EvalSet(name, eids, [erows[i].answer for i in ekeep], n,
                                 temperature=cfg.sampling.eval_temperature, top_p=cfg.sampling.eval_top_p))
    prompt_len = next_bucket(max(len(p) for p in prompt_ids + [q for es in eval_sets for q in es.prompts]), 16)

    tcfg = train_step_config(cfg, mesh)
    graphdef, train_state = init_train_state(model, tcfg)
    stare_state = init_stare_state(tcfg.stare)
    # commit the initial state to its devices, as the step's outputs are, so step 2 does not recompile
    if mesh is not None:
        from jax.sharding import NamedSharding, PartitionSpec

        train_state = place_train_state(train_state, mesh)
        # created replicated by a jitted init: device_put would compare the NaN last_entropy across processes
        stare_state = jax.jit(lambda: init_stare_state(tcfg.stare),
                              out_shardings=NamedSharding(mesh, PartitionSpec()))()
    else:
        train_state, stare_state = jax.device_put((train_state, stare_state), jax.devices()[0])
    step_fn = make_train_step(graphdef, tcfg, mesh=mesh, train_state=train_state)
    sampler = Sampler(model, mesh=mesh, cache_dtype=cfg.sampling.kv_cache_dtype,
                      pad_id=tokenizer.pad_id if tokenizer.pad_id is not None else None)
    reward_fn = RewardFn(cfg.data.task)

    ckpt = Checkpointer(rd.checkpoints, keep=cfg.checkpoint.keep, every_steps=cfg.checkpoint.every_steps,
                        async_save=cfg.checkpoint.async_save, must_exist=resume)
    start_step = 0
    if resume:
        abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding),
                                {"train_state": train_state, "stare_state": stare_state})
        restored = ckpt.restore(abstract_state=abstract, fallback_to_intact=True)
        train_state, stare_state = restored.state["train_state"], restored.state["stare_state"]
        stream.restore(restored.extra["data"])
        start_step = int(restored.extra["step"])
        log(f"resumed from {rd.checkpoints} at step {start_step}")
        if config_changes and jax.process_index() == 0:
            run_config.record_changes(rd.root, start_step, config_changes, allowed=allow_config_change)
            log(f"config changed on resume at step {start_step}: {', '.join(config_changes)} "
                f"(recorded in {run_dir}/{run_config.CHANGES_FILE})")
        if jax.process_index() == 0:
            rd.pull()  # a remote run's earlier metrics, so the writer appends to (and trims) the full history
    writer = MetricsWriter(rd.local, tensorboard=cfg.logging.tensorboard, wandb_project=cfg.logging.wandb_project,
                           resume_step=start_step if resume else None, required_keys=REQUIRED_STEP_KEYS)
    preempt = install_preemption_handler()
    bar = ProgressBar(cfg.total_steps, start_step=start_step,
                      enabled=cfg.logging.progress_bar and jax.process_index() == 0)

    def refresh_sampler():
        sampler.update_params(nnx.merge(graphdef, train_state.params, train_state.rest))

    def run_eval(step: int) -> dict:
        if not eval_sets:
            return {}
        refresh_sampler()
        return evaluate(sampler, eval_sets, tokenizer=tokenizer, reward_fn=reward_fn, prompt_len=prompt_len,
                        max_new_tokens=cfg.sampling.max_new_tokens, seed=_seed_for(cfg.seed, step, 99_991),
                        batch_prompts=cfg.sampling.max_prompts_per_call or 256)

    def save(step: int, force: bool = False):
        ckpt.save(step, {"train_state": train_state, "stare_state": stare_state},
                  {"data": stream.state(), "step": step, "seed": cfg.seed}, force=force)

    eval_every = cfg.logging.eval_every_steps
    # The policy before any RL update is evaluated once; step 1's record carries it as eval_start/*.
    pending_eval = ({k.replace("eval/", "eval_start/", 1): v for k, v in run_eval(0).items()}
                    if (eval_every and start_step == 0) else {})
    summary = {"steps_run": 0, "stopped": None, "new_compiles_per_step": []}
    last_record = {}
    G = cfg.rl.group_size
    try:
        for step in range(start_step, cfg.total_steps):
            t0 = time.time()
            compiles_before = compile_count()
            refresh_sampler()
            acc = DynamicSamplingAccumulator(cfg.rl.train_batch_size,
                                             cfg.rl.max_num_gen_batches if cfg.rl.dynamic_sampling else 1)
            gen_correct, gen_lengths, reward_stats = [], [], {}
            j = 0
            while not acc.ready:
                batch_rows = next(stream)
                r, _, stats = generate_rollouts(
                    sampler, [prompt_of[id(x)] for x in batch_rows], [x.answer for x in batch_rows],
                    tokenizer=tokenizer, reward_fn=reward_fn, prompt_len=prompt_len,
                    max_new_tokens=cfg.sampling.max_new_tokens, num_samples=G,
                    temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p, top_k=cfg.sampling.top_k,
                    seed=_seed_for(cfg.seed, step, j), index_offset=j * cfg.rl.gen_batch_size,
                    max_prompts_per_call=cfg.sampling.max_prompts_per_call)
                gen_correct.append(r.correct_PxG)
                gen_lengths.append(r.lengths_PxG)
                add_counts(reward_stats, stats)
                keep = (np.asarray(dynamic_sampling_keep_mask(r.correct_PxG)) if cfg.rl.dynamic_sampling
                        else np.ones(r.correct_PxG.shape[0], bool))
                acc.add(dataclasses.asdict(r), keep)
                j += 1
            kept = Rollouts(**acc.result())
            t_gen = time.time() - t0
            rewards = rollout_rewards(kept.correct_PxG, kept.lengths_PxG, mode=cfg.rl.reward,
                                      max_length=cfg.sampling.max_new_tokens, overlong_buffer=cfg.rl.overlong_buffer,
                                      overlong_penalty_factor=cfg.rl.overlong_penalty)
            adv = np.asarray(grpo_advantages(jnp.asarray(rewards), norm_by_std=cfg.rl.norm_adv_by_std))
            batch = train_batch_from_rollouts(kept, adv)
            if dist.is_multiprocess():  # the same host batch on every process -> one global array
                batch = dist.global_batch(batch, mesh)
            sampler.release()  # the sampler's weight copy is not alive during the train step
            t1 = time.time()
            train_state, stare_state, m = step_fn(train_state, batch, stare_state)
            m = jax.device_get(m)
            t_train = time.time() - t1
            all_correct = np.concatenate([c.reshape(-1) for c in gen_correct])
            all_len = np.concatenate([x.reshape(-1) for x in gen_lengths])
            record = {
                "entropy": float(m["entropy"]), "target_entropy": cfg.rl.stare.target_entropy,
                "reward_mean": float(rewards.mean()), "accuracy": float(all_correct.mean()),
                "train_accuracy": float(kept.correct_PxG.mean()),
                "response_len_mean": float(all_len.mean()), "gate_on": reweighting_active(cfg, m),
                "stare_enabled": cfg.rl.stare.enabled,
                # GRPO-ds never reweights: its effective W and M are 1 (the controller's values are unused)
                "stare_w": float(m["stare_w"]) if cfg.rl.stare.enabled else 1.0,
                "stare_m": float(m["stare_m"]) if cfg.rl.stare.enabled else 1.0,
                "selected_frac_pos": float(m.get("stare/frac_pos_high", m.get("stare/frac_pos_low", 0.0))),
                "selected_frac_neg": float(m.get("stare/frac_neg_high", m.get("stare/frac_neg_low", 0.0))),
                "clipfrac": float(m["clipfrac"]), "clipfrac_lower": float(m["clipfrac_lower"]),
                "approx_kl": float(m["approx_kl"]), "loss": float(m["loss"]), "grad_norm": float(m["grad_norm"]),
                "skipped_updates": float(m["skipped_updates"]),
                "kept_groups_frac": acc.num_kept / max(acc.num_prompts_seen, 1),
                "num_gen_batches": j,
                **{f"stare/{k[6:]}": float(v) for k, v in m.items() if k.startswith("stare/")},
                **{k: float(v) for k, v in m.items() if k.startswith("theory/")},
                **{f"reward/{k}": v for k, v in reward_stats.items()},
                "step_time_s": time.time() - t0, "gen_time_s": t_gen, "train_time_s": t_train,
            }
            if not math.isfinite(record["loss"]) or record["skipped_updates"] > 0:
                if cfg.checkpoint.on_nan == "stop":
                    writer.log(step + 1, record)
                    save(step, force=True)
                    raise TrainingError(
                        f"non-finite loss/gradient at step {step + 1}: the update was skipped and the run stopped "
                        f"(checkpoint.on_nan=stop); parameters from before this step are saved at "
                        f"{rd.checkpoints} step {step}")
                log(f"step {step + 1}: non-finite loss/gradient, update skipped (checkpoint.on_nan=skip)")
            done = step + 1
            if eval_every and (done % eval_every == 0 or done == cfg.total_steps):
                pending_eval.update(run_eval(done))
            record.update(pending_eval)
            pending_eval = {}
            last_record = writer.log(done, record)
            bar.update(last_record)
            save(done)
            if jax.process_index() == 0:
                rd.push(with_dirs=done % max(cfg.checkpoint.every_steps, 1) == 0)
            summary["steps_run"] += 1
            summary["new_compiles_per_step"].append(compile_count() - compiles_before)
            if dist.any_process(preempt.should_stop(done)):  # every process stops at the same step
                save(done, force=True)
                summary["stopped"] = f"preempted (signal) after step {done}"
                log(f"preemption signal: saved checkpoint at step {done}, exiting")
                break
        else:
            save(cfg.total_steps, force=True)
    finally:
        ckpt.wait()
        ckpt.close()
        writer.close()
        if jax.process_index() == 0:
            rd.push(with_dirs=True)
        bar.close()
        reward_fn.close()
        preempt.uninstall()
    summary.update({"run_dir": str(run_dir), "wall_s": time.time() - t_start, "last": last_record})
    if jax.process_index() == 0:
        (rd.local / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
        rd.push()
    return summary
