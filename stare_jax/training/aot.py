"""`stare-jax plan CONFIG --compile`: compile every program a run executes for a real TPU slice, on this host.

With libtpu installed (`pip install "jax[tpu]==<the jax version>"`), `jax.experimental.topologies` describes a
Cloud TPU slice by name (e.g. "v5p:2x4x4") with abstract devices, and `jax.jit(...).lower(...).compile()`
builds the real TPU executable for them on a CPU host. The figures below are the compiler's own:
`memory_analysis()` (argument / output / alias / temp / generated-code bytes per device) and `cost_analysis()`.

Nothing here is a copy of a program: the run's own code paths are given abstract inputs.
- The model is `models.abstract_model` (jax.ShapeDtypeStruct parameters with their NamedShardings on the
  topology's mesh); the train state comes from `init_train_state` (its abstract path), the step from
  `make_train_step`, the sampler program from `Sampler.trace` (or, where the run generates with the rollout
  engine - one host, long responses, tool use -, the engine's decode and prefill programs from
  `Engine.trace_programs` at their largest shapes, with the page pool the run allocates), the trainer -> sampler
  weight program from `reshard_for_sampling`'s jitted program. No weights are read and no device is queried.
- Per-step FLOPs: XLA's cost analysis counts a loop body once (the micro-batch scan, the update scan, the decode
  while loop), so the FLOPs are counted from the traced jaxpr instead, with every scan's length and the decode
  loop's worst-case trip count (max_new_tokens) applied. XLA's `optimal_seconds` is scaled by the same ratio
  (our per-device FLOPs / XLA's body-once FLOPs): an approximation, labelled as such.
- Collectives are read from the optimized HLO text (count and output bytes by kind, as they appear in the
  program: a collective inside a loop body is listed once).
- Phases: sampling = the sampler program (the larger of the engine's decode and prefill) + the train state
  (params + AdamW moments) and the frozen reference policy (rl.kl; the policy's shapes and shardings) that stay
  resident; the weight reshard = its program + the optimizer moments + the reference; training = the train step
  (its arguments are the train state, the batch and the reference; the sampler's copy is released before it, see
  Sampler.release).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import re
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import topologies
from jax.sharding import NamedSharding, PartitionSpec

from stare_jax import models
from stare_jax.models.sharding import batch_shards, make_mesh, mesh_for_config
from stare_jax.planning.estimate import (
    HEADROOM,
    Accelerator,
    GiB,
    estimate,
    fits_hbm,
    parse_accelerator,
    phase_peaks,
    resolve_max_slots,
    run_generator,
    run_model_config,
    tool_engine_config,
)
from stare_jax.rl.packing import batch_shapes
from stare_jax.rl.stare import init_stare_state
from stare_jax.rl.step import ShardedStep, init_train_state, make_train_step
from stare_jax.sampling import Sampler, next_bucket
from stare_jax.sampling.engine import Engine
from stare_jax.sampling.sharding import reshard_program, sampler_param_sharding
from stare_jax.training.setup import train_step_config
from stare_jax.training.sft import SFT_KEYS, init_sft_state, make_sft_step


class CompileError(ValueError):
    """The config cannot be compiled for the topology (the message says why and what to change)."""


# ------------------------------------------------------------------------------------------------ topologies


def topology_for(accelerator: str) -> str:
    """The libtpu topology name of a Cloud TPU type: v5p-64 (32 chips) -> 'v5p:2x4x4', v6e-16 -> 'v6e:4x4'.

    v4 / v5p types count TensorCores (2 per chip) and are 3-D tori; v5e (v5litepod) / v6e types count chips
    and are 2-D."""
    acc = parse_accelerator(accelerator)
    if acc.kind != "tpu":
        raise CompileError(
            f"accelerator {accelerator!r} is a GPU type: --compile targets TPU topologies only "
            f"(see BUILD.md for what the compiler can say about CUDA without a GPU)"
        )
    family = accelerator.split("-")[0].replace("v5litepod", "v5e")
    chips = acc.num_devices
    k = int(math.log2(chips)) if chips > 0 else -1
    if chips <= 0 or 2**k != chips:
        raise CompileError(
            f"accelerator {accelerator!r}: {chips} chips is not a Cloud TPU slice shape (a power of two)"
        )
    if family in ("v4", "v5p"):  # 3-D: 2x2x1, 2x2x2, 2x2x4, 2x4x4, 4x4x4, 4x4x8, ...
        if chips < 8:
            dims = {1: [1, 1, 1], 2: [1, 2, 1], 4: [2, 2, 1]}[chips]
        else:
            e = [k // 3] * 3
            for i in range(k % 3):
                e[2 - i] += 1
            dims = [2**x for x in e]
    else:  # 2-D: 1x1, 2x2, 2x4, 4x4, 4x8, 8x8, ...
        dims = [2 ** (k // 2), chips // 2 ** (k // 2)]
    return f"{family}:{'x'.join(map(str, dims))}"


def get_topology(name: str):
    """The slice's TopologyDescription (abstract devices); one-line errors for a missing libtpu or a bad name."""
    try:
        import libtpu  # noqa: F401  (only to say what to install when it is missing)
    except ImportError:
        raise CompileError(
            f'--compile needs libtpu: pip install "jax[tpu]=={jax.__version__}" '
            f"(in this checkout: .venv/bin/pip install -r requirements-test.txt -c constraints.txt)"
        ) from None

    # compile-only use: never take libtpu's one-process-per-host lock (a run, a test or another plan may hold it)
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    if not re.fullmatch(r"v(4|5p|5e|6e):\d+(x\d+){1,2}", name):
        raise CompileError(f"unknown TPU topology {name!r}; expected e.g. v5p:2x2x1, v5p:2x4x4, v6e:2x2, v4:2x2x1")
    try:
        return topologies.get_topology_desc(topology_name=name, platform="tpu")
    except Exception as e:  # libtpu's own message names what it did not accept
        raise CompileError(f"TPU topology {name!r}: {str(e).splitlines()[0]}") from None


_HBM_CACHE: dict[str, int | None] = {}


def hbm_bytes_per_device(topology_name: str, devices) -> int | None:
    """HBM per device as libtpu sees it: compiled from a probe program that cannot fit, whose error names the
    available HBM ("exceeds available HBM (95.74G)", binary units). None when libtpu does not say."""
    if topology_name in _HBM_CACHE:
        return _HBM_CACHE[topology_name]
    mesh = jax.sharding.Mesh(np.asarray(devices[:1]), ("x",))
    rep = NamedSharding(mesh, PartitionSpec())
    huge = jax.ShapeDtypeStruct((1 << 40,), jnp.float32, sharding=rep)  # 4 TiB
    found = None
    try:
        jax.jit(lambda x: x * 2, in_shardings=rep, out_shardings=rep).lower(huge).compile()
    except Exception as e:
        m = re.search(r"available HBM \(([\d.]+)([KMGT])\)", str(e))
        if m:
            found = int(float(m.group(1)) * 1024 ** "KMGT".index(m.group(2)) * 1024)
    _HBM_CACHE[topology_name] = found
    return found


# ------------------------------------------------------------------------------------------------ analysis

_DT_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "bf16": 2,
    "f16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
}
_COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


def collectives(hlo_text: str) -> dict[str, dict[str, int]]:
    """{kind: {"count", "bytes"}} of the collectives in an optimized HLO module (output bytes per device; async
    pairs counted once at their -start)."""
    out = {k: {"count": 0, "bytes": 0} for k in _COLLECTIVES}
    pattern = re.compile(r"=\s*(.+?)\s+(" + "|".join(_COLLECTIVES) + r")(-start)?\(")
    for line in hlo_text.splitlines():
        m = pattern.search(line)
        if not m:
            continue
        shapes = re.findall(r"\b([a-z]+\d*)\[([\d,]*)\]", m.group(1))
        if m.group(3) and len(shapes) > 1:  # async start: (operands..., outputs...) -> the output half
            shapes = shapes[len(shapes) // 2 :]
        nbytes = sum(_DT_BYTES.get(dt, 4) * math.prod(int(d) for d in dims.split(",") if d) for dt, dims in shapes)
        out[m.group(2)]["count"] += 1
        out[m.group(2)]["bytes"] += nbytes
    return {k: v for k, v in out.items() if v["count"]}


def _sub_jaxprs(params: dict):
    for v in params.values():
        for x in v if isinstance(v, (tuple, list)) else (v,):
            if isinstance(x, jax.extend.core.ClosedJaxpr):
                yield x.jaxpr
            elif isinstance(x, jax.extend.core.Jaxpr):
                yield x


def jaxpr_flops(jaxpr, *, while_trips: int = 1) -> float:
    """Matmul FLOPs (2 x MACs of every dot_general) of a jaxpr, with loop trip counts applied: a scan's body
    times its length, a while loop's body times `while_trips` (the caller's worst case), the costlier branch of
    a cond, a shard_map body times its shard count, a Pallas kernel by its own cost estimate. Elementwise work
    is not counted (it is a rounding error next to the matmuls of a transformer)."""
    total = 0.0
    for eqn in jaxpr.eqns:
        name, p = eqn.primitive.name, eqn.params
        if name == "dot_general":
            (contract, _), _ = p["dimension_numbers"], None
            lhs = eqn.invars[0].aval.shape
            k = math.prod(lhs[d] for d in contract[0])
            total += 2.0 * k * math.prod(eqn.outvars[0].aval.shape)
        elif name == "scan":
            total += p["length"] * jaxpr_flops(p["jaxpr"].jaxpr, while_trips=while_trips)
        elif name == "while":
            total += while_trips * jaxpr_flops(p["body_jaxpr"].jaxpr, while_trips=while_trips)
        elif name == "cond":
            total += max(jaxpr_flops(b.jaxpr, while_trips=while_trips) for b in p["branches"])
        elif name == "shard_map":
            mesh = p["mesh"]
            shards = math.prod(mesh.shape[a] for a in p.get("manual_axes", mesh.axis_names))
            total += shards * sum(jaxpr_flops(j, while_trips=while_trips) for j in _sub_jaxprs(p))
        elif name == "pallas_call":
            est = p.get("cost_estimate")
            total += float(getattr(est, "flops", 0) or 0)
        else:
            total += sum(jaxpr_flops(j, while_trips=while_trips) for j in _sub_jaxprs(p))
    return total


def _shard_bytes(x) -> int:
    """Bytes of one device's shard of an abstract array."""
    shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
    return math.prod(shape) * jnp.dtype(x.dtype).itemsize


def tree_bytes_per_device(tree) -> int:
    return int(sum(_shard_bytes(x) for x in jax.tree.leaves(tree)))


@contextlib.contextmanager
def _no_persistent_cache():
    """Compile-only executables cannot be loaded back from JAX's persistent cache: keep them out of it."""
    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", before)


@dataclasses.dataclass
class Program:
    """One compiled program's figures (bytes per device; FLOPs per call, all devices)."""

    name: str
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    generated_code_bytes: int
    peak_bytes: int
    flops_per_step: float
    xla_flops_body_once: float
    optimal_seconds: float
    collectives: dict
    mosaic_kernels: int  # Pallas/Mosaic custom calls in the compiled program (e.g. splash attention)
    compile_s: float
    host_bytes: int = 0  # host-memory (memory kind pinned_host) arguments + outputs - aliases + temps
    xla_temp_bytes: int = 0  # memory_analysis().temp_size_in_bytes as reported (over-counts on TPU: see compile)

    @classmethod
    def compile(cls, name: str, traced, mesh_ctx, num_devices: int, *, while_trips: int = 1) -> "Program":
        t0 = time.time()
        with mesh_ctx(), _no_persistent_cache():
            compiled = traced.lower().compile()
        compile_s = time.time() - t0
        ma = compiled.memory_analysis()
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        hlo = compiled.as_text()
        flops = jaxpr_flops(traced.jaxpr.jaxpr, while_trips=while_trips)
        xla_flops = float(cost.get("flops", 0.0))
        scale = (flops / num_devices) / xla_flops if xla_flops else 1.0
        # The peak: libtpu's peak_memory_in_bytes (arguments + the buffer assignment's temp allocation: the figure
        # the TPU compiler itself refuses a program over, "total memory required ... exceeds available HBM") +
        # the code. Its temp_size_in_bytes is larger than that allocation by an amount that grows with the program
        # (+16 GiB for the 7B tool train step; a program whose arguments + temp_size exceed HBM still compiles,
        # one whose peak_memory_in_bytes does not is refused), so temps are taken from the peak where it exists.
        # peak_memory_in_bytes also counts the host-memory buffers (memory kind pinned_host: arguments, outputs,
        # temps), which the compiler does not hold against HBM (60 GiB of host + 60 GiB of device arguments
        # compile on a 95.74 GiB chip with peak_memory_in_bytes 120 GiB: benchmarks/tpu_peak_memory.py), so they
        # are taken out of the device peak and reported as host_bytes.
        resident = ma.argument_size_in_bytes + ma.output_size_in_bytes - ma.alias_size_in_bytes
        host = (
            ma.host_argument_size_in_bytes
            + ma.host_output_size_in_bytes
            - ma.host_alias_size_in_bytes
            + ma.host_temp_size_in_bytes
        )
        xla_peak = int(getattr(ma, "peak_memory_in_bytes", 0) or 0)
        temp = max(0, xla_peak - host - resident) if xla_peak else ma.temp_size_in_bytes
        peak = resident + temp + ma.generated_code_size_in_bytes
        return cls(
            name=name,
            argument_bytes=ma.argument_size_in_bytes,
            output_bytes=ma.output_size_in_bytes,
            alias_bytes=ma.alias_size_in_bytes,
            temp_bytes=int(temp),
            xla_temp_bytes=ma.temp_size_in_bytes,
            generated_code_bytes=ma.generated_code_size_in_bytes,
            peak_bytes=int(peak),
            flops_per_step=flops,
            xla_flops_body_once=xla_flops,
            optimal_seconds=float(cost.get("optimal_seconds", 0.0)) * scale,
            collectives=collectives(hlo),
            mosaic_kernels=hlo.count('custom_call_target="tpu_custom_call"'),
            compile_s=compile_s,
            host_bytes=int(host),
        )


# ------------------------------------------------------------------------------------------------ the run's programs


def _abstract(x, sharding):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def train_batch_shape(cfg) -> tuple[int, int]:
    """[B, L] of the train step's batch as the loop builds it: train_batch_size x G responses of the prompt
    bucket (power of two of data.max_prompt_len, the worst case) + max_new_tokens."""
    return cfg.rl.train_batch_size * cfg.rl.group_size, next_bucket(
        cfg.data.max_prompt_len, 16
    ) + cfg.sampling.max_new_tokens


def sampler_call_prompts(cfg) -> int:
    """Prompts in one sampler call: sampling.max_prompts_per_call (0: the whole generation batch)."""
    return min(cfg.rl.gen_batch_size, cfg.sampling.max_prompts_per_call or cfg.rl.gen_batch_size)


def compile_train_step(cfg, tcfg, model, mesh) -> tuple[Any, Program]:
    """(abstract TrainState, compiled train step) of run config `cfg` (static step config `tcfg`) for the abstract
    `model` on `mesh`: the run's shardings, donation and batch shape."""
    graphdef, train_state = init_train_state(model, tcfg)
    rep = NamedSharding(mesh, PartitionSpec())
    step = make_train_step(graphdef, tcfg, mesh=mesh, train_state=train_state)
    assert isinstance(step, ShardedStep)  # a mesh is given
    B, L = train_batch_shape(cfg)
    shapes = batch_shapes(tcfg, B, L, batch_shards(mesh))
    shapes.update({k: ((B,), jnp.float32) for k in step.keys if k not in shapes})  # rewards_B (rl.kl reward)
    batch = {
        k: jax.ShapeDtypeStruct(shape, dtype, sharding=step.batch_shardings[k])
        for k, (shape, dtype) in shapes.items()
        if k in step.keys
    }
    stare_state = jax.tree.map(lambda x: _abstract(x, rep), jax.eval_shape(lambda: init_stare_state(tcfg.stare)))
    # the frozen reference policy (rl.kl): abstract parameters with the policy's shapes, dtypes and shardings
    ref = (train_state.params,) if step.with_ref else ()
    traced = step.trace(train_state, batch, stare_state, *ref)
    return train_state, Program.compile("train_step", traced, step.context, mesh.size)


def sampler_key(cfg, topology: str, model_cfg=None) -> str:
    """What the sampler and the weight-reshard programs depend on, hashed: the model, the mesh, the sampling
    section, the prompt bucket, the call's prompts and group size, and the slice. Two configs with the same key
    (e.g. the GRPO-ds / STARE arms of one setting, which differ only under rl.stare) compile the very same
    sampler and reshard programs."""
    model_cfg = model_cfg or run_model_config(cfg)
    key = {
        "model": dataclasses.asdict(model_cfg),
        "mesh": dataclasses.asdict(cfg.mesh),
        "sampling": dataclasses.asdict(cfg.sampling),
        "max_prompt_len": cfg.data.max_prompt_len,
        "call_prompts": sampler_call_prompts(cfg),
        "gen_batch_size": cfg.rl.gen_batch_size,
        "group_size": cfg.rl.group_size,
        "topology": topology,
    }
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()


def _compile_static_sampler(cfg, model, mesh, programs: dict, log) -> int:
    """Compile the static sampler's program at the run's buckets into programs["sampler"] (FLOPs per generation
    batch); returns the sampler weight copy's bytes per device."""
    sampler = Sampler(model, mesh=mesh, cache_dtype=cfg.sampling.kv_cache_dtype, compute_dtype=cfg.sampling.dtype)
    call_prompts = sampler_call_prompts(cfg)
    prompt_bucket = next_bucket(cfg.data.max_prompt_len, 16)
    log(
        f"compiling the sampler: {call_prompts} prompts x {cfg.rl.group_size} samples, prompt bucket "
        f"{prompt_bucket}, {cfg.sampling.max_new_tokens} new tokens"
    )
    traced = sampler.trace(
        call_prompts, prompt_bucket, max_new_tokens=cfg.sampling.max_new_tokens, num_samples=cfg.rl.group_size
    )
    programs["sampler"] = Program.compile(
        "sampler", traced, sampler.program_context, mesh.size, while_trips=cfg.sampling.max_new_tokens - 1
    )
    gen_calls = math.ceil(cfg.rl.gen_batch_size / call_prompts)
    programs["sampler"].flops_per_step *= gen_calls  # calls per generation batch (one batch: no top-up)
    return tree_bytes_per_device(sampler.state)


def _compile_engine(cfg, engine_cfg, model, mesh, programs: dict, log, *, prefill: bool = True) -> Engine:
    """Compile the rollout engine's decode and prefill programs at their largest shapes (every slot live, the
    page table of the longest request, the pool the run allocates: Engine.trace_programs) into programs["sampler"]
    (decode) and programs["sampler_prefill"]; their FLOPs per generation batch are the worst case (every response
    at max_new_tokens, one prefill per prompt). Returns the (abstract) engine."""
    engine = Engine(
        model, mesh=mesh, cache_dtype=cfg.sampling.kv_cache_dtype, config=engine_cfg, compute_dtype=cfg.sampling.dtype
    )
    prompt_bucket = next_bucket(cfg.data.max_prompt_len, 16)
    longest = prompt_bucket + cfg.sampling.max_new_tokens
    log(
        f"compiling the rollout engine: {engine_cfg.max_slots} slots over {engine.data_shards} data shard(s), "
        f"pages of {engine_cfg.page_size} tokens, decode chunks of {engine_cfg.decode_chunk} steps, prefill chunks "
        f"of {engine_cfg.prefill_chunk} tokens, requests of up to {longest} tokens, decode attention "
        f"{engine.attention} (sampling.engine.attention={engine_cfg.attention})"
    )
    traced = engine.trace_programs(longest)
    decode = Program.compile(
        "sampler", traced["decode"], engine.program_context, mesh.size, while_trips=engine_cfg.decode_chunk
    )
    rows = cfg.rl.gen_batch_size * cfg.rl.group_size
    slots = engine.slots_per_shard() * engine.data_shards  # rows of one decode or prefill call
    decode.flops_per_step *= math.ceil(rows / slots) * math.ceil(cfg.sampling.max_new_tokens / engine_cfg.decode_chunk)
    programs["sampler"] = decode
    if prefill:
        programs["sampler_prefill"] = Program.compile(
            "sampler_prefill", traced["prefill"], engine.program_context, mesh.size
        )
        programs["sampler_prefill"].flops_per_step *= math.ceil(cfg.rl.gen_batch_size / slots) * math.ceil(
            prompt_bucket / engine_cfg.prefill_width(longest)
        )
    return engine


def compile_engine(
    cfg, *, topology: str | None = None, attention: str | None = None, model_cfg=None, prefill: bool = True, log=print
) -> dict:
    """Compile only the rollout engine's decode and prefill programs of run config `cfg` (as compile_run does for a
    run that generates with the engine) for a TPU slice. `attention` overrides sampling.engine.attention (e.g. to
    compare the gather path with the Pallas kernel), `model_cfg` the run's model; prefill=False compiles the decode
    program alone (the prefill program gathers whatever the decode backend). Returns {"topology", "mesh",
    "attention" (the decode backend the engine resolved), "compiled": {"sampler" (decode), "sampler_prefill"},
    "sampler_weights_bytes"}."""
    accelerator, topology, devices, mesh = slice_mesh(cfg, topology)
    cfg = _resolve_slots(cfg, accelerator, topology, devices)
    hosts = len({getattr(d, "process_index", 0) for d in devices})
    try:
        engine_cfg = dataclasses.replace(tool_engine_config(cfg, hosts, batch_shards(mesh)), enabled=True)
        if attention is not None:
            engine_cfg = dataclasses.replace(engine_cfg, attention=attention)
    except ValueError as e:
        raise CompileError(f"topology {topology}: {e}") from None
    programs: dict = {}
    model = models.abstract_model(model_cfg or run_model_config(cfg), mesh)
    engine = _compile_engine(cfg, engine_cfg, model, mesh, programs, log, prefill=prefill)
    return {
        "topology": topology,
        "mesh": dict(mesh.shape),
        "attention": engine.attention,
        "compiled": {k: dataclasses.asdict(v) for k, v in programs.items()},
        "sampler_weights_bytes": tree_bytes_per_device(engine.state),
    }


def _resolve_slots(cfg, accelerator: str | None, topology: str, devices: list):
    """cfg with sampling.engine.max_slots=auto resolved for the slice (planning.estimate.resolve_max_slots: the
    accelerator's HBM, or the topology's where only a topology is named); a CompileError when nothing fits."""
    if cfg.sampling.engine.max_slots != "auto":
        return cfg
    hosts = len({getattr(d, "process_index", 0) for d in devices})
    acc = (
        parse_accelerator(accelerator)
        if accelerator
        else Accelerator(topology, "tpu", len(devices), hbm_bytes_per_device(topology, devices) or 0, 0.0, hosts)
    )
    try:
        return resolve_max_slots(cfg, acc)
    except ValueError as e:
        raise CompileError(f"topology {topology}: {e}") from None


def slice_mesh(cfg, topology: str | None = None) -> tuple[str | None, str, list, jax.sharding.Mesh]:
    """(accelerator, topology, abstract devices, the config's mesh over them) of a run or SFT config: the slice
    of cfg.launch.accelerator unless `topology` names one."""
    accelerator = getattr(getattr(cfg, "launch", None), "accelerator", None)
    if topology is None:
        if not accelerator:
            raise CompileError("no accelerator: set launch.accelerator in the config or pass --topology")
        topology = topology_for(accelerator)
    devices = list(get_topology(topology).devices)
    try:
        mesh = mesh_for_config(cfg.mesh, devices)
    except ValueError as e:
        raise CompileError(f"topology {topology} ({len(devices)} devices): {e}") from None
    if mesh is None:
        mesh = make_mesh({"fsdp": 1}, devices=devices)
    return accelerator, topology, devices, mesh


def compile_run(
    cfg, *, topology: str | None = None, model_cfg=None, reuse_sampler: dict | None = None, log=print
) -> dict:
    """Compile the train step, the sampler program and the weight reshard of run config `cfg` for a TPU slice
    (`topology`, default: the one of cfg.launch.accelerator) and report the compiler's figures.
    `model_cfg` replaces the run's model (e.g. a few-layer variant for a quick study). `reuse_sampler`: an
    earlier report of a config with the same sampler_key; its sampler and reshard figures are taken instead of
    compiling the same programs again (a CompileError if the keys differ)."""
    accelerator, topology, devices, mesh = slice_mesh(cfg, topology)
    n = len(devices)
    hosts = len({getattr(d, "process_index", 0) for d in devices})
    try:  # with tool.enabled: the engine, and only where it runs (planning.estimate.tool_engine_config)
        engine_cfg = tool_engine_config(cfg, hosts, batch_shards(mesh))
    except ValueError as e:
        raise CompileError(f"topology {topology}: {e}") from None
    generator = run_generator(engine_cfg, hosts, batch_shards(mesh), cfg.sampling.max_new_tokens)
    if generator == "engine":  # max_slots=auto matters only where the engine generates
        cfg = _resolve_slots(cfg, accelerator, topology, devices)
        engine_cfg = tool_engine_config(cfg, hosts, batch_shards(mesh))
    model_cfg = model_cfg or run_model_config(cfg)
    key = sampler_key(cfg, topology, model_cfg)
    if reuse_sampler is not None and reuse_sampler.get("sampler_key") != key:
        raise CompileError(
            "the report given to reuse the sampler from was compiled for another model, mesh, "
            "sampling section or slice (its sampler_key differs): compile the sampler instead"
        )
    model = models.abstract_model(model_cfg, mesh)
    tcfg = train_step_config(cfg, mesh)
    layout = (
        f"packed rows of {cfg.rl.packing.row_tokens or train_batch_shape(cfg)[1]} tokens"
        if cfg.rl.packing.enabled
        else "padded"
    )
    log(
        f"compiling the train step for {topology} ({n} devices, mesh {dict(mesh.shape)}): batch "
        f"{list(train_batch_shape(cfg))} ({layout}{', optimizer offloaded' if cfg.rl.offload.optimizer else ''})"
    )
    train_state, train_program = compile_train_step(cfg, tcfg, model, mesh)
    programs = {"train_step": train_program}
    if reuse_sampler is not None:
        log("sampler and weight reshard: the same programs as in the given report (same sampler_key), reused")
        for name in ("weight_reshard", "sampler", "sampler_prefill"):
            if name in reuse_sampler["compiled"]:
                programs[name] = Program(**reuse_sampler["compiled"][name])
        sampler_weights_b = reuse_sampler["state_bytes_per_device"]["sampler_weights"]
    else:
        # the trainer -> sampler weight program (cast to the compute dtype + reshard)
        state = jax.tree.leaves(nnx.split(model)[1])
        targets = tuple(sampler_param_sharding(x, mesh) for x in state)
        reshard = reshard_program(targets, jnp.dtype(model_cfg.dtype))
        log("compiling the trainer -> sampler weight reshard")
        programs["weight_reshard"] = Program.compile(
            "weight_reshard", reshard.trace(state), lambda: jax.set_mesh(mesh), n
        )
        if generator == "engine":
            engine = _compile_engine(cfg, engine_cfg, model, mesh, programs, log)
            sampler_weights_b = tree_bytes_per_device(engine.state)
        else:
            sampler_weights_b = _compile_static_sampler(cfg, model, mesh, programs, log)

    params_b = tree_bytes_per_device(train_state.params)
    # the rest of the model state stays resident through sampling too: a LoRA run's frozen base (7.2 GiB per chip
    # for the 7B arm on v5p-8, which the sampling phase once left out), else nothing
    frozen_b = tree_bytes_per_device(train_state.rest)
    opt_b = tree_bytes_per_device(train_state.opt_state)
    ref_b = params_b if tcfg.kl.enabled else 0  # the reference: the policy's shapes and shardings, no optimizer state
    opt_dev_b = 0 if tcfg.offload.optimizer else opt_b  # rl.offload.optimizer: the moments wait in host memory
    resident_train = params_b + frozen_b + opt_dev_b + ref_b
    t, r = programs["train_step"], programs["weight_reshard"]
    sampler_peak = max(programs[k].peak_bytes for k in ("sampler", "sampler_prefill") if k in programs)
    phases = {
        "sampling": {
            # the reshard reads the whole model state (params and rest) as its arguments
            "peak_bytes": max(sampler_peak + resident_train, r.peak_bytes + opt_dev_b + ref_b),
            "program_peak_bytes": sampler_peak,
            "resident_bytes": resident_train,
            "reshard_peak_bytes": r.peak_bytes + opt_dev_b + ref_b,
        },
        "training": {"peak_bytes": t.peak_bytes, "program_peak_bytes": t.peak_bytes, "resident_bytes": 0},
    }
    hbm = hbm_bytes_per_device(topology, devices)
    peak = max(p["peak_bytes"] for p in phases.values())
    try:
        est = estimate(cfg, accelerator) if accelerator else None
    except ValueError as e:
        est = {"error": str(e)}
    return {
        "topology": topology,
        "accelerator": accelerator,
        "devices": n,
        "mesh": dict(mesh.shape),
        "hbm_bytes_per_device": hbm,
        "sampler_key": key,
        "generator": generator,
        "sampler_reused": reuse_sampler is not None,
        "compiled": {k: dataclasses.asdict(v) for k, v in programs.items()},
        "state_bytes_per_device": {
            "params": params_b,
            "frozen_params": frozen_b,
            "optimizer": opt_b,
            "reference_params": ref_b,
            "sampler_weights": sampler_weights_b,
        },
        "optimizer_offloaded": bool(tcfg.offload.optimizer),
        "packing": bool(tcfg.packing.enabled),
        "phases": phases,
        "peak_bytes": peak,
        "fits": None if hbm is None else fits_hbm(peak, hbm),
        "estimate": est,
    }


def format_compiled(report: dict) -> str:
    """Human-readable table: each program and phase, compiled beside the analytic estimate."""
    hbm = report["hbm_bytes_per_device"]
    est = report.get("estimate") or {}
    lines = [
        f"COMPILED for {report['topology']} ({report['devices']} devices, mesh {report['mesh']}); "
        f"HBM per device {hbm / GiB:.2f} GiB"
        if hbm
        else "HBM per device unknown"
    ]
    lines.append(
        f"  {'program':<16}{'args':>9}{'out':>9}{'alias':>9}{'temp':>9}{'code':>8}{'peak':>9}"
        f"{'TFLOP/step':>12}{'compile s':>11}   (GiB per device)"
    )
    for name, p in report["compiled"].items():
        lines.append(
            f"  {name:<16}{p['argument_bytes'] / GiB:9.2f}{p['output_bytes'] / GiB:9.2f}"
            f"{p['alias_bytes'] / GiB:9.2f}{p['temp_bytes'] / GiB:9.2f}{p['generated_code_bytes'] / GiB:8.2f}"
            f"{p['peak_bytes'] / GiB:9.2f}{p['flops_per_step'] / 1e12:12.1f}{p['compile_s']:11.1f}"
        )
    est_peak = est.get("peak_bytes_per_device")
    est_phases = phase_peaks(est) if "memory_bytes" in est else {}
    for name, ph in report["phases"].items():
        e = est_phases.get(name)
        lines.append(
            f"  phase {name:<10} peak {ph['peak_bytes'] / GiB:8.2f} GiB"
            + (f"   (estimate {e / GiB:.2f} GiB)" if e else "")
        )
    for name, p in report["compiled"].items():
        if p.get("host_bytes"):
            lines.append(f"  {name} host memory (pinned_host): {p['host_bytes'] / GiB:.2f} GiB per device")
    for name, p in report["compiled"].items():
        if p["collectives"]:
            lines.append(
                f"  {name} collectives: "
                + ", ".join(f"{k} x{v['count']} ({v['bytes'] / GiB:.2f} GiB)" for k, v in p["collectives"].items())
            )
    if report["fits"] is not None:
        verdict = "fits" if report["fits"] else "DOES NOT FIT"
        lines.append(
            f"  peak {report['peak_bytes'] / GiB:.2f} GiB of {hbm / GiB:.2f} GiB -> {verdict} "
            f"(needs <= {1 - HEADROOM:.0%})" + (f"; the estimate said {est_peak / GiB:.2f} GiB" if est_peak else "")
        )
    return "\n".join(lines)


def summary_row(report: dict) -> dict[str, Any]:
    """The figures of one config for the BUILD.md table."""
    est = report.get("estimate") or {}
    return {
        "topology": report["topology"],
        "sampling_gib": report["phases"]["sampling"]["peak_bytes"] / GiB,
        "training_gib": report["phases"]["training"]["peak_bytes"] / GiB,
        "hbm_gib": (report["hbm_bytes_per_device"] or 0) / GiB,
        "fits": report["fits"],
        "estimate_gib": (est.get("peak_bytes_per_device") or 0) / GiB,
        "compile_s": sum(p["compile_s"] for p in report["compiled"].values()),
    }


def compile_sft(cfg, *, topology: str | None = None, log=print) -> dict:
    """Compile the SFT step of `stare-jax sft` config `cfg` (stare_jax.training.sft.ConversationSFTConfig) for a TPU
    slice
    (`topology`, default: the one of cfg.launch.accelerator) at its largest batch (batch_size conversations of
    max_len tokens, in its micro-batches) and report the compiler's figures: the step's arguments are the train
    state (fp32 parameters and AdamW moments, sharded by the model's rules; donated) and the batch, so its peak is
    the run's per-device peak."""
    accelerator, topology, devices, mesh = slice_mesh(cfg, topology)
    model_cfg = run_model_config(cfg)
    train_cfg = cfg.train_config(batch_shards(mesh))
    graphdef, state = init_sft_state(models.abstract_model(model_cfg, mesh), train_cfg, mesh)
    step = make_sft_step(graphdef, train_cfg, mesh=mesh, train_state=state)
    assert isinstance(step, ShardedStep)  # a mesh is given
    shape = (cfg.batch_size, cfg.padded_length())
    batch = {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=step.batch_shardings[k]) for k in SFT_KEYS}
    log(
        f"compiling the SFT step for {topology} ({len(devices)} devices, mesh {dict(mesh.shape)}): batch "
        f"{list(shape)} in {train_cfg.micro_batches} micro-batch(es), remat {model_cfg.remat_policy}"
    )
    program = Program.compile("sft_step", step.trace(state, batch), step.context, mesh.size)
    hbm = hbm_bytes_per_device(topology, devices)
    return {
        "topology": topology,
        "accelerator": accelerator,
        "devices": len(devices),
        "mesh": dict(mesh.shape),
        "hbm_bytes_per_device": hbm,
        "batch": list(shape),
        "micro_batches": train_cfg.micro_batches,
        "compiled": {"sft_step": dataclasses.asdict(program)},
        "state_bytes_per_device": {
            "params": tree_bytes_per_device(state.params),
            "optimizer": tree_bytes_per_device(state.opt_state),
        },
        "phases": {
            "training": {
                "peak_bytes": program.peak_bytes,
                "program_peak_bytes": program.peak_bytes,
                "resident_bytes": 0,
            }
        },
        "peak_bytes": program.peak_bytes,
        "fits": None if hbm is None else fits_hbm(program.peak_bytes, hbm),
        "estimate": None,
    }
