"""`stare-jax plan`: an analytic per-device memory and FLOP estimate for a run config on a named accelerator.

Full-size models cannot be compiled on a small CPU host, so this is a model, not a measurement: parameter
shapes come from `jax.eval_shape` of the real model, and the rest from closed-form counts of what one RL step
holds per device (sharded parameters, gradients and AdamW moments, FSDP-gathered layer weights, remat-saved
activations, the chunked log-prob pass, the sampler's weight copy and KV cache). Every figure is labelled an
estimate; tests compare the activation model against XLA's compiled memory analysis on small configs.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import pathlib
import re

import jax
import numpy as np
from flax import nnx

from stare_jax.toy import spec as toy_spec
from stare_jax.models import Transformer, get_preset
from stare_jax.models.config import ModelConfig
from stare_jax.models.paged_attention import PREFILL_KEY_BLOCK
from stare_jax.models.sharding import batch_shards, resolve_mesh
from stare_jax.rl.packing import first_fit_decreasing
from stare_jax.sampling import quarter_octave_bucket

GiB = 1024**3


@dataclasses.dataclass(frozen=True)
class Accelerator:
    """One device of a slice/cluster: HBM per device and bf16 dense peak FLOP/s."""

    name: str
    kind: str  # "tpu" | "gpu"
    num_devices: int
    hbm_bytes: int
    peak_flops: float
    num_hosts: int


# per-chip HBM available to a program (bytes: libtpu's own figure, what the compiler enforces;
# stare_jax.training.aot reads
# it from the topology), bf16 dense peak, TensorCores per chip in the type name, chips per host
_TPU = {
    "v4": (int(30.5 * GiB), 275e12, 2, 4),
    "v5litepod": (int(15.75 * GiB), 197e12, 1, 4),
    "v5e": (int(15.75 * GiB), 197e12, 1, 4),
    "v5p": (int(95.74 * GiB), 459e12, 2, 4),
    "v6e": (int(31.25 * GiB), 918e12, 1, 4),
}
_GPU = {
    "A100": (80 * 10**9, 312e12),
    "H100": (80 * 10**9, 989e12),
    "H200": (141 * 10**9, 989e12),
    "B200": (180 * 10**9, 2250e12),
}


def parse_accelerator(name: str) -> Accelerator:
    """'v5p-64' (TPU type: cores for v4/v5p, chips for v5e/v6e) or 'NxGPU' / 'NODESxNxGPU' (e.g. '2x8xH100')."""
    m = re.fullmatch(r"(v4|v5litepod|v5e|v5p|v6e)-(\d+)", name)
    if m:
        family, n = m.group(1), int(m.group(2))
        hbm, peak, cores_per_chip, chips_per_host = _TPU[family]
        if n <= 0 or n % cores_per_chip:
            raise ValueError(f"accelerator {name!r}: the size must be a positive multiple of {cores_per_chip}")
        chips = n // cores_per_chip
        return Accelerator(name, "tpu", chips, hbm, peak, max(1, math.ceil(chips / chips_per_host)))
    m = re.fullmatch(r"(?:(\d+)x)?(\d+)x(A100|H100|H200|B200)", name)
    if m:
        nodes, per_node, gpu = int(m.group(1) or 1), int(m.group(2)), m.group(3)
        if nodes <= 0 or per_node <= 0:
            raise ValueError(f"accelerator {name!r}: node and GPU counts must be positive")
        hbm, peak = _GPU[gpu]
        return Accelerator(name, "gpu", nodes * per_node, hbm, peak, nodes)
    raise ValueError(
        f"unknown accelerator type {name!r}; accepted: TPU types v4-N, v5litepod-N (v5e), v5p-N, v6e-N, or GPUs "
        f"as [NODESx]GPUSx{{{','.join(_GPU)}}} (e.g. 8xH100, 2x8xH100)"
    )


def live_accelerator(devices=None) -> Accelerator | None:
    """The accelerator this process runs on, from its devices (all processes'): HBM per device as the runtime
    reports it (memory_stats()["bytes_limit"]); None where it reports none (the CPU)."""
    devices = list(jax.devices() if devices is None else devices)
    try:
        stats = devices[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - a backend without memory stats
        stats = {}
    limit = int(stats.get("bytes_limit", 0) or 0)
    if not limit:
        return None
    d = devices[0]
    return Accelerator(name=f"{len(devices)}x{d.device_kind}", kind=d.platform, num_devices=len(devices),
                       hbm_bytes=limit, peak_flops=0.0, num_hosts=len({x.process_index for x in devices}))


def _as_accelerator(accelerator: "str | Accelerator") -> Accelerator:
    return accelerator if isinstance(accelerator, Accelerator) else parse_accelerator(accelerator)


def param_count(model_cfg) -> int:
    """Parameter count from jax.eval_shape of the real model (no allocation)."""
    abstract = nnx.eval_shape(lambda: Transformer(model_cfg, rngs=nnx.Rngs(0)))
    state = nnx.state(abstract, nnx.Param)
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(state)))


_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def training_activation_bytes(model_cfg, seqs: float, seq_len: int, *, tensor: int = 1) -> float:
    """Bytes of activations live during forward+backward of `seqs` sequences on one device (one micro-batch).

    remat 'full': each layer keeps only its input; one layer's working set is rebuilt at a time.
    'none': every layer keeps its intermediates. 'dots*': matmul outputs are kept, elementwise ones rebuilt.
    Attention scores [H, T, T] in fp32 appear only for the 'xla' attention implementation."""
    b = _BYTES[model_cfg.dtype]
    d, i, L = model_cfg.hidden_size, model_cfg.intermediate_size, model_cfg.num_layers
    h, kv, dh = model_cfg.num_heads, model_cfg.num_kv_heads, model_cfg.head_dim
    tok = seqs * seq_len
    # per layer: 2 norms + 2 residual adds + o-proj out (6d); q,k,v, rotated q,k and attention out (3h+3kv)dh;
    # gate, up, silu(gate), product (4i)
    per_layer_all = tok * (6 * d + (3 * h + 3 * kv) * dh / tensor + 4 * i / tensor) * b
    per_layer_dots = tok * (d + (2 * h + 2 * kv) * dh / tensor + 2 * i / tensor) * b
    # scores, exp and probabilities in fp32 for the reference attention
    scores = seqs * (h / tensor) * seq_len * seq_len * 4 * 3 if model_cfg.attention_impl == "xla" else 0.0
    policy = model_cfg.remat_policy
    if policy == "full":  # saved layer inputs + one layer's working set, recomputed and differentiated (the TPU
        # peaks of the paper configs, 2026-12-06: counting that set twice over-counted their train steps by 10-48%)
        return L * tok * d * b + per_layer_all + scores
    if policy.startswith("dots"):
        return L * per_layer_dots + per_layer_all + scores
    return L * (per_layer_all + scores)


@dataclasses.dataclass(frozen=True)
class LengthModel:
    """The assumed length distribution of a step's sequences (the estimate cannot know the policy's): responses
    lognormal with `response_median` (None: max_new_tokens / 8) and `response_sigma`, clipped to [1, max_new_tokens],
    each after a prompt of `prompt_tokens` (None: data.max_prompt_len / 4)."""

    response_median: float | None = None
    response_sigma: float = 1.0
    prompt_tokens: int | None = None


def expected_packing(cfg, lengths: LengthModel = LengthModel(), *, shards: int = 1, draws: int = 8,
                     seed: int = 0) -> dict:
    """The packed layout of one step under `lengths`: each mini-batch's sequences packed first-fit-decreasing into
    rows of rl.packing.row_tokens (0: the padded length), averaged over `draws` random batches: fill rate (real
    tokens / rows' tokens), rows per step, rows computed (whole micro-batches of rl.micro_batch_tokens //
    row_tokens rows per device x `shards`: a micro-batch that runs computes all its rows), real and padded tokens
    per step."""
    rl = cfg.rl
    max_new = cfg.sampling.max_new_tokens
    seq_len = cfg.data.max_prompt_len + max_new
    row = rl.packing.row_tokens or seq_len
    median = lengths.response_median or max_new / 8
    prompt = lengths.prompt_tokens if lengths.prompt_tokens is not None else max(1, cfg.data.max_prompt_len // 4)
    B = rl.train_batch_size * rl.group_size
    mini = B // rl.mini_batches
    per_micro = max(1, rl.micro_batch_tokens // row) * shards
    rng = np.random.default_rng(seed)
    rows = computed = real = 0
    for _ in range(draws):
        resp = np.clip(np.round(rng.lognormal(np.log(median), lengths.response_sigma, size=B)), 1, max_new)
        n = (resp + prompt).astype(int)
        used = [len(first_fit_decreasing(n[j * mini:(j + 1) * mini], row)) for j in range(rl.mini_batches)]
        rows += sum(used)
        computed += sum(-(-u // per_micro) * per_micro for u in used)
        real += int(n.sum())
    return {"row_tokens": row, "response_median": float(median), "response_sigma": lengths.response_sigma,
            "prompt_tokens": prompt, "rows_per_step": rows / draws, "rows_computed_per_step": computed / draws,
            "real_tokens_per_step": real / draws,
            "padded_tokens_per_step": B * seq_len, "fill_rate": real / (rows * row),
            "padded_fill_rate": real / draws / (B * seq_len)}


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


def estimate(cfg, accelerator: "str | Accelerator | None" = None, *, num_params: int | None = None,
             lengths: LengthModel = LengthModel(), fit_slots: bool = True) -> dict:
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
    acc = _as_accelerator(acc_name)
    mesh = resolve_mesh(cfg.mesh, acc.num_devices)
    model_cfg = run_model_config(cfg)
    P = num_params if num_params is not None else param_count(model_cfg)
    dp = batch_shards(mesh)
    engine_cfg = tool_engine_config(cfg, acc.num_hosts, dp)
    generator = run_generator(engine_cfg, acc.num_hosts, dp, cfg.sampling.max_new_tokens)
    slots_fit = None  # max_slots_that_fit, computed once: for the report and for max_slots=auto
    if generator == "engine" and (fit_slots or engine_cfg.max_slots == "auto"):
        slots_fit = max_slots_that_fit(cfg, acc, num_params=P, lengths=lengths)
        cfg = resolve_max_slots(cfg, acc, fit=slots_fit)
        engine_cfg = tool_engine_config(cfg, acc.num_hosts, dp)
    shard = mesh["fsdp"] * mesh["tensor"]
    tensor = mesh["tensor"]
    pb, cb = _BYTES[model_cfg.param_dtype], _BYTES[model_cfg.dtype]
    kvb = _BYTES[cfg.sampling.kv_cache_dtype]
    seq_len = cfg.data.max_prompt_len + cfg.sampling.max_new_tokens
    if seq_len > model_cfg.max_position_embeddings:
        raise ValueError(
            f"prompt {cfg.data.max_prompt_len} + response {cfg.sampling.max_new_tokens} = {seq_len} tokens "
            f"exceeds the model's context ({model_cfg.max_position_embeddings})"
        )
    G = cfg.rl.group_size
    train_seqs = cfg.rl.train_batch_size * G
    if train_seqs % (cfg.rl.micro_batch_size * dp):
        raise ValueError(
            f"{train_seqs} training sequences (rl.train_batch_size x rl.group_size) do not split into "
            f"micro-batches of rl.micro_batch_size={cfg.rl.micro_batch_size} on each of {dp} data shards"
        )
    mb_seqs_dev = cfg.rl.micro_batch_size
    mb_len = seq_len  # tokens per row of a micro-batch
    packing = expected_packing(cfg, lengths, shards=dp) if cfg.rl.packing.enabled else None
    if packing is not None:
        mb_len = packing["row_tokens"]
        mb_seqs_dev = max(1, cfg.rl.micro_batch_tokens // mb_len)
    elif cfg.rl.micro_batch_tokens:
        mb_seqs_dev = max(1, cfg.rl.micro_batch_tokens // seq_len)
    d, L, V = model_cfg.hidden_size, model_cfg.num_layers, model_cfg.vocab_size
    layer_params = (P - V * d * (1 if model_cfg.tie_word_embeddings else 2)) / L

    # Calibrated against the compiled train step (stare-jax plan --compile, its peak_memory_in_bytes; BUILD.md): the
    # micro-batch scan holds the gradient accumulator and one micro-batch's gradient; the log-prob pass gathers the
    # unembedding in fp32 beside a bf16 copy of a vocab table (the Qwen3-8B step's buffer report, fsdp 64).
    # Layer weights in the compute dtype: with FSDP two layers' gathered weights at a time; without it (fsdp 1)
    # XLA hoists the cast of every layer's (tensor-sharded) weights out of the micro-batch loop and keeps them all
    # for the step (the 7B tool config's buffer report: bf16 [28, ...] stacks, 3.0 GiB per chip).
    cast_layers = L if mesh["fsdp"] == 1 and pb != cb else 2
    mem = {
        "params": P * pb / shard,
        "grads": 2 * P * pb / shard,
        "optimizer": 2 * P * 4 / shard,
        "gathered_layer_weights": cast_layers * layer_params * cb / tensor,
        "activations": training_activation_bytes(model_cfg, mb_seqs_dev, mb_len, tensor=tensor),
        "logits_chunks": mb_seqs_dev * min(cfg.rl.logprob_chunk_size, mb_len) * (V / tensor) * 4 * 3,
        "vocab_tables": V * d * (4 + cb) / tensor,
    }
    if cfg.rl.kl.enabled:  # the frozen reference policy: the policy's parameters and shardings, no optimizer state
        mem["reference_params"] = P * pb / shard
    kv_heads, dh = model_cfg.num_kv_heads, model_cfg.head_dim
    if generator == "engine":
        # each data shard's page pool (allocated once: sampling.engine.num_pages / dp, or auto-sized for its
        # max_slots / dp requests) on its devices, kv heads split over the tensor axis where it divides them;
        # one layer's gathered pages of the shard's slots (the prefill's, and the decode step's on the gather path:
        # sampling.engine.attention=pallas decodes without gathering, the prefill gathers either way; the layout of
        # the pool, [K, N, P, Dh], does not change its bytes); per prefill call one layer's fp32
        # attention logits and probabilities of a prefill chunk per slot over the longest request, or over one
        # key block where the context is longer than two (attention_kv_major_blocked: over the whole 9k context
        # they were 15.9 GiB per chip for the 7B tool configs)
        ec = engine_cfg
        slots = -(-ec.max_slots // dp)
        pool_pages = -(-ec.num_pages // dp) if ec.num_pages else dataclasses.replace(
            ec, max_slots=slots).pool_pages(seq_len)
        heads_dev = kv_heads / tensor if kv_heads % tensor == 0 else kv_heads
        # the prefill's scores over a long context are one key block wide (attention_kv_major_blocked), but the
        # compiled sampling programs of the 4k-8k configs hold more than the modelled terms (Math-7B, 32B: 15% and 12%
        # under an estimate with one block), so the term keeps the one-pass size up to 8 blocks (calibration)
        prefill_keys = min(seq_len, 8 * PREFILL_KEY_BLOCK)
        sampling = {
            "sampler_weights": P * cb / tensor,
            "kv_page_pool": 2 * L * pool_pages * ec.page_size * heads_dev * dh * kvb,
            "kv_gathered_pages": 2 * slots * seq_len * heads_dev * dh * cb,
            "sampler_logits": slots * (V / tensor) * 4 * 2,
            "prefill_attention_scores": 2 * slots * ec.prefill_width(seq_len) * prefill_keys
            * model_cfg.num_heads / tensor * 4,
        }
    else:
        # one sampler call holds sampling.max_prompts_per_call prompts (0: the whole generation batch), padded as
        # the sampler pads them (Sampler.batch_bucket)
        call_prompts = min(cfg.rl.gen_batch_size, cfg.sampling.max_prompts_per_call or cfg.rl.gen_batch_size)
        padded = -(-quarter_octave_bucket(call_prompts) // dp) * dp
        gen_seqs_dev = padded * G / dp
        sampling = {
            "sampler_weights": P * cb / tensor,
            "kv_cache": 2 * L * gen_seqs_dev * seq_len * kv_heads * dh * kvb / min(tensor, kv_heads),
            "sampler_logits": gen_seqs_dev * (V / tensor) * 4 * 2,
        }
    offload = cfg.rl.offload.optimizer
    memory_bytes = {**{f"train/{k}": v for k, v in mem.items()}, **{f"sample/{k}": v for k, v in sampling.items()}}
    peak = max(phase_peaks({"memory_bytes": memory_bytes, "offload_optimizer": offload}).values())
    fits = fits_hbm(peak, acc.hbm_bytes)
    peak_offloaded = None if fits or offload else max(
        phase_peaks({"memory_bytes": memory_bytes, "offload_optimizer": True}).values())

    # packed rows attend within a row of mb_len tokens (the whole causal row: segments are masked, not skipped)
    train_tokens = packing["rows_computed_per_step"] * mb_len if packing else train_seqs * seq_len
    gen_tokens = cfg.rl.gen_batch_size * G * seq_len
    attn_per_len = 4 * L * model_cfg.num_heads * model_cfg.head_dim / 2  # causal, per token per context token
    attn, train_attn = attn_per_len * seq_len, attn_per_len * mb_len
    recompute = 2 if model_cfg.remat_policy == "full" else 0
    flops = {
        "generation": gen_tokens * (2 * P + attn),
        "old_logprob_pass": train_tokens * (2 * P + train_attn) * (2 if cfg.rl.kl.enabled else 1),  # + reference
        "train_fwd_bwd": cfg.rl.ppo_epochs * train_tokens * ((6 + recompute) * P + 3 * train_attn),
    }
    total_flops = sum(flops.values())
    return {
        "estimate": True,
        "accelerator": acc.name,
        "devices": acc.num_devices,
        "hosts": acc.num_hosts,
        "mesh": mesh,
        "generator": generator,
        "model": {"params": P, "layers": L, "hidden": d, "vocab": V, "seq_len": seq_len},
        "memory_bytes": memory_bytes,
        "offload_optimizer": offload,
        "packing": packing,
        "peak_bytes_per_device": peak,
        "hbm_bytes_per_device": acc.hbm_bytes,
        "fits": fits,
        **({"peak_with_offload": peak_offloaded} if peak_offloaded is not None else {}),
        "flops_per_step": flops,
        "total_flops_per_step": total_flops,
        "step_time_s_at_40pct_mfu": total_flops / (acc.num_devices * acc.peak_flops * 0.4) if acc.peak_flops
        else None,
        "max_slots": engine_cfg.max_slots,
        "warnings": _warnings(model_cfg, acc),
        **({"max_slots_that_fit": slots_fit} if slots_fit is not None and fit_slots else {}),
    }


def auto_max_slots(cfg, accelerator: "str | Accelerator | None", *, num_params: int | None = None,
                   lengths: LengthModel = LengthModel(), fit: dict | None = None) -> int:
    """The number sampling.engine.max_slots=auto stands for: the largest slot count whose sampling phase fits
    (`max_slots_that_fit` on `accelerator`, or `fit` when the caller has it), or one slot per response of a
    generation batch where there is no accelerator figure (None: a CPU host). A ValueError naming the key when
    not even one slot per data shard fits."""
    if accelerator is None:
        return cfg.rl.gen_batch_size * cfg.rl.group_size
    fit = fit or max_slots_that_fit(cfg, accelerator, num_params=num_params, lengths=lengths)
    if not fit["max_slots"]:
        acc = _as_accelerator(accelerator)
        raise ValueError(f"sampling.engine.max_slots=auto: not even one decode slot per data shard fits in 90% "
                         f"of {acc.name}'s {acc.hbm_bytes / GiB:.1f} GiB per device (by `stare-jax plan`'s "
                         f"estimate): a larger slice, more tensor parallelism or a shorter sequence")
    return fit["max_slots"]


def resolve_max_slots(cfg, accelerator: "str | Accelerator | None", *, num_params: int | None = None,
                      lengths: LengthModel = LengthModel(), fit: dict | None = None):
    """`cfg` with sampling.engine.max_slots=auto replaced by `auto_max_slots`; other values: `cfg` unchanged."""
    engine = cfg.sampling.engine
    if engine.max_slots != "auto":
        return cfg
    slots = auto_max_slots(cfg, accelerator, num_params=num_params, lengths=lengths, fit=fit)
    return dataclasses.replace(cfg, sampling=dataclasses.replace(
        cfg.sampling, engine=dataclasses.replace(engine, max_slots=slots)))


def max_slots_that_fit(cfg, accelerator: "str | Accelerator", *, num_params: int | None = None,
                       lengths: LengthModel = LengthModel()) -> dict:
    """The largest sampling.engine.max_slots (a multiple of the data shards, at most one slot per response of a
    generation batch: more never run at once) whose estimated SAMPLING phase stays within 90% of HBM; slots change
    only that phase (the decode batch, and the auto-sized page pool). {"max_slots", "per_shard", "one_per_response",
    "sampling_peak_bytes"}; max_slots 0 when not even one slot per shard fits."""
    acc = _as_accelerator(accelerator)
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
    return {"max_slots": lo * dp, "per_shard": lo, "one_per_response": -(-responses // dp) * dp,
            "sampling_peak_bytes": sampling_peak(lo) if lo else None}


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
        raise ValueError("tool.enabled needs the rollout engine (multi-turn rollouts append tool output and "
                         "continue): set sampling.engine.enabled to true or auto")
    return dataclasses.replace(engine_cfg, enabled=True)


def run_generator(engine_cfg, hosts: int, data_shards: int, max_new_tokens: int) -> str:
    """"engine" or "static": what sampling.engine.enabled picks for a run on `hosts` processes whose mesh splits
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
        out.append("remat through the unrolled layer loop saves little on TPU (XLA schedules the recomputation "
                   "early; 25.5 GiB train-step temp for the 7B on v5p-64): the activation figure assumes "
                   "model.scan_layers=true")
    return out


HEADROOM = 0.10  # a config fits when every phase's peak is <= 90% of HBM (the estimate here, compiled: aot)


def fits_hbm(peak_bytes: float, hbm_bytes: float) -> bool:
    """Whether a per-device peak leaves HEADROOM of the device's HBM free: the one fit rule of the plan and aot."""
    return bool(peak_bytes <= (1 - HEADROOM) * hbm_bytes)


def phase_peaks(plan: dict) -> dict[str, float]:
    """Per-phase peak bytes per device of an `estimate` result, as stare_jax.training.aot defines the phases: sampling =
    the sampler's buffers + the params and AdamW moments that stay resident; training = the train step. With
    rl.offload.optimizer the moments are in host memory while sampling and through the train step's micro-batch
    loop; they come in for the update only, which then holds the params, the gradients and the moments (counted
    in full: the compiled 7B tool step is 33.2 GiB offloaded vs 48.1 not, the 14.2 GiB of moments)."""
    mem = plan["memory_bytes"]
    opt = mem["train/optimizer"]
    ref = mem.get("train/reference_params", 0.0)
    off = plan.get("offload_optimizer", False)
    train = sum(v for k, v in mem.items() if k.startswith("train/"))
    if off:
        update = mem["train/params"] + mem["train/grads"] + opt + ref
        train = max(train - opt, update)
    return {"sampling": mem["train/params"] + (0.0 if off else opt) + ref
            + sum(v for k, v in mem.items() if k.startswith("sample/")),
            "training": train}


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
    lines.append(f"  {'phase sampling / training':<32} {phases['sampling'] / GiB:8.2f} / "
                 f"{phases['training'] / GiB:.2f} GiB{off}")
    pk = plan.get("packing")
    if pk:
        share = pk["rows_computed_per_step"] * pk["row_tokens"] / pk["padded_tokens_per_step"]
        lines.append(f"packing (assumed lengths: responses lognormal median {pk['response_median']:.0f} sigma "
                     f"{pk['response_sigma']:.2g}, prompts {pk['prompt_tokens']} tokens): "
                     f"{pk['rows_per_step']:.1f} rows of {pk['row_tokens']} per step, fill {pk['fill_rate']:.1%} "
                     f"(padded: {pk['padded_fill_rate']:.1%}); {pk['rows_computed_per_step']:.0f} rows computed "
                     f"(whole micro-batches) = {share:.1%} of the padded tokens")
    verdict = "fits" if plan["fits"] else "DOES NOT FIT"
    lines.append(
        f"  {'peak':<32} {plan['peak_bytes_per_device'] / GiB:8.2f} GiB of {plan['hbm_bytes_per_device'] / GiB:.1f} GiB"
        f" HBM -> {verdict} (needs <= 90%)"
    )
    if plan.get("peak_with_offload") is not None:
        off_fits = fits_hbm(plan["peak_with_offload"], plan["hbm_bytes_per_device"])
        lines.append(f"  with rl.offload.optimizer=true (AdamW moments in host memory but for the update): "
                     f"{plan['peak_with_offload'] / GiB:.2f} GiB -> {'fits' if off_fits else 'does not fit either'}")
    fit = plan.get("max_slots_that_fit")
    if fit:
        per = f"{fit['per_shard']} per data shard" if fit["max_slots"] else "not one slot per data shard fits"
        lines.append(f"  largest sampling.engine.max_slots with the sampling phase <= 90% of HBM: {fit['max_slots']} "
                     f"({per}; one slot per response of a generation batch = {fit['one_per_response']})")
    lines.append("FLOPs per RL step:")
    for k, v in plan["flops_per_step"].items():
        lines.append(f"  {k:<32} {v:.3e}")
    step_s = plan.get("step_time_s_at_40pct_mfu")
    lines.append(f"  {'total':<32} {plan['total_flops_per_step']:.3e}"
                 + (f"  (~{step_s:.0f} s/step at 40% MFU)" if step_s is not None else ""))
    lines += [f"WARNING: {w}" for w in plan.get("warnings", [])]
    return "\n".join(lines)
