"""`stare-jax plan`: an analytic per-device memory and FLOP estimate for a run config on a named accelerator.

Full-size models cannot be compiled on a small CPU host, so this is a model, not a measurement: parameter
shapes come from `jax.eval_shape` of the real model, and the rest from closed-form counts of what one RL step
holds per device (sharded parameters, gradients and AdamW moments, FSDP-gathered layer weights, remat-saved
activations, the chunked log-prob pass, the sampler's weight copy and KV cache). Every figure is labelled an
estimate; tests compare the activation model against XLA's compiled memory analysis on small configs.

The accelerators are in stare_jax.planning.accelerators, the per-phase terms (the step's shape, the train step's
and the sampler's bytes, the FLOPs, the phase peaks) in stare_jax.planning.phases; this module puts them together
(`estimate`), sizes the engine's decode slots (`max_slots_that_fit`) and prints a plan (`format_plan`). Their
names are importable from here as before.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pathlib

import jax
from flax import nnx

from stare_jax.models import Transformer, get_preset
from stare_jax.models.config import ModelConfig
from stare_jax.models.sharding import batch_shards, resolve_mesh
from stare_jax.planning.accelerators import Accelerator, GiB, as_accelerator, live_accelerator, parse_accelerator
from stare_jax.planning.phases import (
    HEADROOM,
    LengthModel,
    engine_sampling_memory,
    expected_packing,
    fits_hbm,
    phase_peaks,
    static_sampling_memory,
    step_flops,
    step_shape,
    train_memory,
    training_activation_bytes,
)
from stare_jax.toy import spec as toy_spec

__all__ = [
    "HEADROOM",
    "Accelerator",
    "GiB",
    "LengthModel",
    "auto_max_slots",
    "estimate",
    "expected_packing",
    "fits_hbm",
    "format_plan",
    "live_accelerator",
    "max_slots_that_fit",
    "param_count",
    "parse_accelerator",
    "phase_peaks",
    "resolve_max_slots",
    "resolve_mesh",
    "run_generator",
    "run_model_config",
    "tool_engine_config",
    "training_activation_bytes",
]


def param_count(model_cfg) -> int:
    """Parameter count from jax.eval_shape of the real model (no allocation)."""
    abstract = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)))
    state = nnx.state(abstract, nnx.Param)
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(state)))


def run_model_config(cfg):
    """The ModelConfig a run config trains, read from its checkpoint's config.json when that exists, else its
    preset (the checkpoint folder need not exist to plan a run) or the embedded toy model, with the run's
    dtypes, attention kernel and remat policy applied. No weights are read."""
    hf_config = pathlib.Path(cfg.model.path or "") / "config.json"
    if cfg.model.path and hf_config.is_file():
        model_cfg = ModelConfig.from_json_file(hf_config)
    elif getattr(getattr(cfg, "toy", None), "enabled", False):  # the embedded toy model (e.g. a smoke test)
        model_cfg = toy_spec.model_config(toy_spec.asset_config(cfg.toy))
    elif cfg.model.preset:
        model_cfg = get_preset(cfg.model.preset)
    elif cfg.model.path:
        raise ValueError(f"{hf_config} does not exist and the config names no model.preset")
    else:
        raise ValueError("the config names no model (model.path or model.preset)")
    return model_cfg.replace(**cfg.model.architecture_overrides())


def estimate(
    cfg,
    accelerator: "str | Accelerator | None" = None,
    *,
    num_params: int | None = None,
    lengths: LengthModel = LengthModel(),
    fit_slots: bool = True,
) -> dict:
    """Per-device memory (bytes) and per-step FLOPs for run config `cfg` on `accelerator` (default: cfg.launch).

    rl.packing: micro-batches of micro_batch_tokens // row_tokens rows per device (at least one); the step's
    FLOPs count the packed rows `expected_packing` finds under `lengths`. rl.micro_batch_tokens without packing:
    micro_batch_tokens // the padded length sequences per device (the longest bucket). rl.offload.optimizer: the
    AdamW moments are off the device but for the update (phase_peaks); a config that does not fit without it gets
    `peak_with_offload`, the peak it would have with it. With the rollout engine (and fit_slots),
    `max_slots_that_fit` is added: see that function."""
    acc_name = accelerator or getattr(getattr(cfg, "launch", None), "accelerator", None)
    if not acc_name:
        raise ValueError("no accelerator given (pass one, or set launch.accelerator in the config)")
    acc = as_accelerator(acc_name)
    mesh = resolve_mesh(cfg.mesh, acc.num_devices)
    model_cfg = run_model_config(cfg)
    P = num_params if num_params is not None else param_count(model_cfg)
    dp = batch_shards(mesh)
    cfg, engine_cfg, generator, slots_fit = _generator(cfg, acc, dp, num_params=P, lengths=lengths, fit_slots=fit_slots)
    shape = step_shape(cfg, model_cfg, dp, lengths)
    sampling = (
        engine_sampling_memory(cfg, model_cfg, P, mesh, dp, shape.seq_len, engine_cfg)
        if generator == "engine"
        else static_sampling_memory(cfg, model_cfg, P, mesh, dp, shape.seq_len)
    )
    memory_bytes = {
        **{f"train/{k}": v for k, v in train_memory(cfg, model_cfg, P, mesh, shape).items()},
        **{f"sample/{k}": v for k, v in sampling.items()},
    }
    offload = cfg.rl.offload.optimizer
    peak = max(phase_peaks({"memory_bytes": memory_bytes, "offload_optimizer": offload}).values())
    fits = fits_hbm(peak, acc.hbm_bytes)
    peak_offloaded = (
        None
        if fits or offload
        else max(phase_peaks({"memory_bytes": memory_bytes, "offload_optimizer": True}).values())
    )
    flops = step_flops(cfg, model_cfg, P, shape)
    total_flops = sum(flops.values())
    return {
        "estimate": True,
        "accelerator": acc.name,
        "devices": acc.num_devices,
        "hosts": acc.num_hosts,
        "mesh": mesh,
        "generator": generator,
        "model": {
            "params": P,
            "layers": model_cfg.num_layers,
            "hidden": model_cfg.hidden_size,
            "vocab": model_cfg.vocab_size,
            "seq_len": shape.seq_len,
        },
        "memory_bytes": memory_bytes,
        "offload_optimizer": offload,
        "packing": shape.packing,
        "peak_bytes_per_device": peak,
        "hbm_bytes_per_device": acc.hbm_bytes,
        "fits": fits,
        **({"peak_with_offload": peak_offloaded} if peak_offloaded is not None else {}),
        "flops_per_step": flops,
        "total_flops_per_step": total_flops,
        "step_time_s_at_40pct_mfu": total_flops / (acc.num_devices * acc.peak_flops * 0.4) if acc.peak_flops else None,
        "max_slots": engine_cfg.max_slots,
        "warnings": _warnings(model_cfg, acc),
        **({"max_slots_that_fit": slots_fit} if slots_fit is not None and fit_slots else {}),
    }


def _generator(cfg, acc: Accelerator, dp: int, *, num_params: int, lengths: LengthModel, fit_slots: bool):
    """(cfg, its engine config, "engine" or "static", max_slots_that_fit or None) for the run on `acc`: with the
    engine, the slot search runs (once: for the report when `fit_slots`, and for max_slots=auto, which `cfg` then
    has resolved)."""
    engine_cfg = tool_engine_config(cfg, acc.num_hosts, dp)
    generator = run_generator(engine_cfg, acc.num_hosts, dp, cfg.sampling.max_new_tokens)
    slots_fit = None
    if generator == "engine" and (fit_slots or engine_cfg.max_slots == "auto"):
        slots_fit = max_slots_that_fit(cfg, acc, num_params=num_params, lengths=lengths)
        cfg = resolve_max_slots(cfg, acc, fit=slots_fit)
        engine_cfg = tool_engine_config(cfg, acc.num_hosts, dp)
    return cfg, engine_cfg, generator, slots_fit


def auto_max_slots(
    cfg,
    accelerator: "str | Accelerator | None",
    *,
    num_params: int | None = None,
    lengths: LengthModel = LengthModel(),
    fit: dict | None = None,
) -> int:
    """The number sampling.engine.max_slots=auto stands for: the largest slot count whose sampling phase fits
    (`max_slots_that_fit` on `accelerator`, or `fit` when the caller has it), or one slot per response of a
    generation batch where there is no accelerator figure (None: a CPU host). A ValueError naming the key when
    not even one slot per data shard fits."""
    if accelerator is None:
        return cfg.rl.gen_batch_size * cfg.rl.group_size
    fit = fit or max_slots_that_fit(cfg, accelerator, num_params=num_params, lengths=lengths)
    if not fit["max_slots"]:
        acc = as_accelerator(accelerator)
        raise ValueError(
            f"sampling.engine.max_slots=auto: not even one decode slot per data shard fits in 90% "
            f"of {acc.name}'s {acc.hbm_bytes / GiB:.1f} GiB per device (by `stare-jax plan`'s "
            f"estimate): a larger slice, more tensor parallelism or a shorter sequence"
        )
    return fit["max_slots"]


def resolve_max_slots(
    cfg,
    accelerator: "str | Accelerator | None",
    *,
    num_params: int | None = None,
    lengths: LengthModel = LengthModel(),
    fit: dict | None = None,
):
    """`cfg` with sampling.engine.max_slots=auto replaced by `auto_max_slots`; other values: `cfg` unchanged."""
    engine = cfg.sampling.engine
    if engine.max_slots != "auto":
        return cfg
    slots = auto_max_slots(cfg, accelerator, num_params=num_params, lengths=lengths, fit=fit)
    return dataclasses.replace(
        cfg, sampling=dataclasses.replace(cfg.sampling, engine=dataclasses.replace(engine, max_slots=slots))
    )


def max_slots_that_fit(
    cfg, accelerator: "str | Accelerator", *, num_params: int | None = None, lengths: LengthModel = LengthModel()
) -> dict:
    """The largest sampling.engine.max_slots (a multiple of the data shards, at most one slot per response of a
    generation batch: more never run at once) whose estimated SAMPLING phase stays within 90% of HBM; slots change
    only that phase (the decode batch, and the auto-sized page pool). {"max_slots", "per_shard", "one_per_response",
    "sampling_peak_bytes"}; max_slots 0 when not even one slot per shard fits."""
    acc = as_accelerator(accelerator)
    dp = batch_shards(resolve_mesh(cfg.mesh, acc.num_devices))
    responses = cfg.rl.gen_batch_size * cfg.rl.group_size
    P = num_params if num_params is not None else param_count(run_model_config(cfg))

    @functools.cache  # the search's last probe is the reported peak: not estimated twice
    def sampling_peak(per_shard: int) -> float:
        engine = dataclasses.replace(cfg.sampling.engine, max_slots=per_shard * dp)
        c = dataclasses.replace(cfg, sampling=dataclasses.replace(cfg.sampling, engine=engine))
        return phase_peaks(estimate(c, acc, num_params=P, lengths=lengths, fit_slots=False))["sampling"]

    lo, hi = 0, -(-responses // dp)  # per-shard slots: lo is known to fit (0: none), the answer is <= hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits_hbm(sampling_peak(mid), acc.hbm_bytes):
            lo = mid
        else:
            hi = mid - 1
    return {
        "max_slots": lo * dp,
        "per_shard": lo,
        "one_per_response": -(-responses // dp) * dp,
        "sampling_peak_bytes": sampling_peak(lo) if lo else None,
    }


def tool_engine_config(cfg, hosts: int, data_shards: int):
    """The engine config the run uses: with tool.enabled, auto means the engine (stare_jax.training.setup.make_sampler);
    the engine runs on any slice (one host or several: its host scheduler is replicated over the processes) and
    any mesh (each data shard has its own slots and page pool). tool.enabled with the engine off is a ValueError
    (the run would refuse to start)."""
    del hosts, data_shards  # every slice and mesh runs the engine (kept: the callers ask per slice)
    engine_cfg = cfg.sampling.engine
    tool = getattr(cfg, "tool", None)
    if tool is None or not tool.enabled:
        return engine_cfg
    if engine_cfg.enabled is False:
        raise ValueError(
            "tool.enabled needs the rollout engine (multi-turn rollouts append tool output and "
            "continue): set sampling.engine.enabled to true or auto"
        )
    return dataclasses.replace(engine_cfg, enabled=True)


def run_generator(engine_cfg, hosts: int, data_shards: int, max_new_tokens: int) -> str:
    """ "engine" or "static": what sampling.engine.enabled picks for a run on `hosts` processes whose mesh splits
    the batch over `data_shards` (the rule of stare_jax.sampling.engine.make_generator: any slice, any mesh)."""
    del hosts, data_shards  # the engine runs on every slice and mesh
    if engine_cfg.enabled is False:
        return "static"
    auto = max_new_tokens >= engine_cfg.auto_min_new_tokens
    return "engine" if engine_cfg.enabled is True or auto else "static"


def _warnings(model_cfg, acc: Accelerator) -> list[str]:
    """What the estimate assumes that the config does not give (found by compiling the programs)."""
    out = []
    if acc.kind == "tpu" and model_cfg.remat_policy != "none" and not model_cfg.scan_layers:
        out.append(
            "remat through the unrolled layer loop saves little on TPU (XLA schedules the recomputation "
            "early; 25.5 GiB train-step temp for the 7B on v5p-64): the activation figure assumes "
            "model.scan_layers=true"
        )
    return out


def format_plan(plan: dict) -> str:
    """Human-readable table of an `estimate` result."""
    lines = [
        f"ESTIMATE (analytic model, not a measurement) for {plan['accelerator']}: {plan['devices']} devices on "
        f"{plan['hosts']} host(s), mesh {plan['mesh']}, generator: {plan['generator']}"
        + (f" ({plan['max_slots']} decode slots)" if plan["generator"] == "engine" and "max_slots" in plan else ""),
        f"model: {plan['model']['params'] / 1e9:.2f}B params, {plan['model']['layers']} layers, "
        f"sequence {plan['model']['seq_len']} tokens",
        "per-device memory:",
    ]
    for k, v in plan["memory_bytes"].items():
        lines.append(f"  {k:<32} {v / GiB:8.2f} GiB")
    phases = phase_peaks(plan)
    off = "  (optimizer offloaded to host between updates)" if plan.get("offload_optimizer") else ""
    lines.append(
        f"  {'phase sampling / training':<32} {phases['sampling'] / GiB:8.2f} / {phases['training'] / GiB:.2f} GiB{off}"
    )
    pk = plan.get("packing")
    if pk:
        share = pk["rows_computed_per_step"] * pk["row_tokens"] / pk["padded_tokens_per_step"]
        lines.append(
            f"packing (assumed lengths: responses lognormal median {pk['response_median']:.0f} sigma "
            f"{pk['response_sigma']:.2g}, prompts {pk['prompt_tokens']} tokens): "
            f"{pk['rows_per_step']:.1f} rows of {pk['row_tokens']} per step, fill {pk['fill_rate']:.1%} "
            f"(padded: {pk['padded_fill_rate']:.1%}); {pk['rows_computed_per_step']:.0f} rows computed "
            f"(whole micro-batches) = {share:.1%} of the padded tokens"
        )
    verdict = "fits" if plan["fits"] else "DOES NOT FIT"
    lines.append(
        f"  {'peak':<32} {plan['peak_bytes_per_device'] / GiB:8.2f} GiB of {plan['hbm_bytes_per_device'] / GiB:.1f} GiB"
        f" HBM -> {verdict} (needs <= 90%)"
    )
    if plan.get("peak_with_offload") is not None:
        off_fits = fits_hbm(plan["peak_with_offload"], plan["hbm_bytes_per_device"])
        lines.append(
            f"  with rl.offload.optimizer=true (AdamW moments in host memory but for the update): "
            f"{plan['peak_with_offload'] / GiB:.2f} GiB -> {'fits' if off_fits else 'does not fit either'}"
        )
    fit = plan.get("max_slots_that_fit")
    if fit:
        per = f"{fit['per_shard']} per data shard" if fit["max_slots"] else "not one slot per data shard fits"
        lines.append(
            f"  largest sampling.engine.max_slots with the sampling phase <= 90% of HBM: {fit['max_slots']} "
            f"({per}; one slot per response of a generation batch = {fit['one_per_response']})"
        )
    lines.append("FLOPs per RL step:")
    for k, v in plan["flops_per_step"].items():
        lines.append(f"  {k:<32} {v:.3e}")
    step_s = plan.get("step_time_s_at_40pct_mfu")
    lines.append(
        f"  {'total':<32} {plan['total_flops_per_step']:.3e}"
        + (f"  (~{step_s:.0f} s/step at 40% MFU)" if step_s is not None else "")
    )
    lines += [f"WARNING: {w}" for w in plan.get("warnings", [])]
    return "\n".join(lines)
