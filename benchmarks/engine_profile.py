"""Where the rollout engine's greedy call goes: a profile of the decode step, by kind of op, against the CPU's
matmul peak measured in the same run.

    .venv/bin/python benchmarks/engine_profile.py [--batch 64] [--new 128] [--json]

The workload is benchmarks/rollout_engine.py's greedy case (the same random Qwen2 shape made by transformers,
--batch prompts of 20-64 tokens, --new greedy tokens, no EOS). One untimed call compiles, --repeats calls are
timed, then one call runs under jax.profiler. Every op the XLA CPU runtime executed is mapped to its instruction
in the optimized HLO (dumped with --xla_dump_to) and put in one class:

- lm_head: the matmul whose result is [rows, vocab];
- layer_matmuls: every other dot (q/k/v/o projections, MLP);
- attention: ops inside the decode step's live-page switch (`over_live_pages`: the page gather and the attend);
- kv_write: the scatters that write the new token's k/v into its page;
- sampling: every op downstream of the LM head's logits (block max, argmax, log-prob, the token bookkeeping);
- other: norms, RoPE, embedding, loop bookkeeping.

Op time is thread time (two ops may run at once on two cores), so the classes can add up to more than the wall
time. The roofline line divides the decode's matmul FLOPs per step (analytic, from the model's shape) by the
matmul peak, the GFLOP/s of a jitted [rows, hidden] x [hidden, vocab] matmul timed in this process: a decode
step cannot be faster than that on this CPU with these matmuls (the greedy engine is bound by it).
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

CLASSES = ("lm_head", "layer_matmuls", "attention", "kv_write", "sampling", "other")
_LINE = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\S+|\(.*?\)) ([a-z][\w\-]*)\(")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CONTAINERS = ("conditional", "while", "call")


def hlo_ops(hlo_text: str) -> dict[str, dict]:
    """Instruction name -> {shape, opcode, op_name, operands, line} of an optimized HLO module's text (every
    computation, in the text's order: operands before their users within a computation)."""
    ops = {}
    for line in hlo_text.splitlines():
        m = _LINE.match(line)
        if m:
            name_meta = _OP_NAME.search(line)
            operands = re.findall(r"%([\w.\-]+)", line[m.end() :].split(")", 1)[0])
            ops[m.group(1)] = {
                "shape": m.group(2),
                "opcode": m.group(3),
                "operands": operands,
                "op_name": name_meta.group(1) if name_meta else "",
                "line": line,
            }
    return ops


def _is_dot(op: dict) -> bool:
    return "dot_general" in op["op_name"] or op["opcode"] == "dot"


def _is_lm_head(op: dict, vocab: int) -> bool:
    return _is_dot(op) and re.search(rf"\[\d+,{vocab}\]", op["shape"]) is not None


def classify_ops(ops: dict[str, dict], vocab: int) -> dict[str, str | None]:
    """Instruction name -> its class (CLASSES); None for a container (while / conditional / call) whose body's
    ops are counted themselves. `sampling` is every op downstream of the LM head's logits in its computation."""
    out: dict[str, str | None] = {}
    downstream: set[str] = set()
    for name, op in ops.items():
        name_meta = op["op_name"]
        if op["opcode"] in _CONTAINERS:
            out[name] = None
        elif _is_lm_head(op, vocab):
            out[name] = "lm_head"
            downstream.add(name)
        elif any(o in downstream for o in op["operands"]):
            out[name] = "sampling"
            downstream.add(name)
        elif "/cond/branch" in name_meta or "/switch/branch" in name_meta:
            out[name] = "attention"
        elif _is_dot(op):
            out[name] = "layer_matmuls"
        elif "scatter" in name or "scatter" in op["opcode"] or "scatter" in name_meta:
            out[name] = "kv_write"
        else:
            out[name] = "other"
    return out


def aggregate(events: list[dict], classes_by_module: dict[str, dict]) -> dict[str, dict]:
    """Per HLO module: {"op_s": thread-seconds per class, "wall_s": the summed wall span of its executions (first
    op start to last op end, per run_id)}."""
    out: dict[str, dict] = {}
    for e in events:
        args = e.get("args", {})
        module, op_name = args.get("hlo_module"), args.get("hlo_op")
        if module not in classes_by_module or op_name not in classes_by_module[module]:
            continue
        rec = out.setdefault(module, {"op_s": collections.Counter(), "spans": {}})
        cls = classes_by_module[module][op_name]
        if cls is not None:
            rec["op_s"][cls] += e["dur"] / 1e6
        lo, hi = rec["spans"].get(args.get("run_id"), (float("inf"), 0.0))
        rec["spans"][args.get("run_id")] = (min(lo, e["ts"]), max(hi, e["ts"] + e["dur"]))
    for rec in out.values():
        rec["wall_s"] = sum(hi - lo for lo, hi in rec.pop("spans").values()) / 1e6
        rec["op_s"] = {c: rec["op_s"].get(c, 0.0) for c in CLASSES}
    return out


def merge_variants(class_maps: list[dict[str, str | None]]) -> tuple[dict[str, str | None], int]:
    """One instruction-name -> class map for a program compiled at several shapes (the engine's page-table width
    and row buckets): the profiler names an op by module and instruction only. A name whose class differs between
    variants is counted as "other"; returns (map, number of such names)."""
    merged: dict[str, str | None] = {}
    conflicts: set[str] = set()
    for m in class_maps:
        for name, cls in m.items():
            if name in merged and merged[name] != cls:
                conflicts.add(name)
            merged.setdefault(name, cls)
    for name in conflicts:
        merged[name] = None if any(m.get(name) is None for m in class_maps) else "other"
    return merged, len(conflicts)


def matmul_flops_per_token(cfg) -> tuple[int, int]:
    """(layer matmul FLOPs, LM-head FLOPs) of one decoded token: 2 x the weights each token multiplies."""
    d, h, k, dh, f = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    per_layer = d * (h + 2 * k) * dh + h * dh * d + 3 * d * f
    return 2 * per_layer * cfg.num_layers, 2 * d * cfg.vocab_size


def matmul_peak_gflops(rows: int, hidden: int, vocab: int, repeats: int = 10) -> float:
    """GFLOP/s of a jitted fp32 [rows, hidden] x [hidden, vocab] matmul (the LM head's shape), best of repeats."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (rows, hidden), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (hidden, vocab), jnp.float32)
    f = jax.jit(lambda x, y: x @ y)
    f(a, b).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        f(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * rows * hidden * vocab / best / 1e9


def _parse(argv=None):
    from sampler_bench import add_model_args

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64, help="greedy prompts (rollout_engine --greedy-batch)")
    ap.add_argument("--new", type=int, default=128, help="greedy new tokens (rollout_engine --greedy-new)")
    ap.add_argument("--min-prompt", type=int, default=20)
    ap.add_argument("--max-prompt", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=2, help="timed calls before the profiled one")
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout (text to stderr)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", action="store_true", help="keep the HLO dump and the trace (paths printed)")
    add_model_args(ap)
    return ap.parse_args(argv)


def main(argv=None):
    args = _parse(argv)
    dump = tempfile.mkdtemp(prefix="engine_profile_hlo_")
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump} --xla_dump_hlo_as_text"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import numpy as np
    from harness import machine_state
    from rollout_engine import _prompts
    from sampler_bench import _make_checkpoint

    from stare_jax.models import from_pretrained
    from stare_jax.sampling import SamplingParams
    from stare_jax.sampling.engine import Engine, EngineConfig

    with tempfile.TemporaryDirectory() as tmp:
        _make_checkpoint(args, tmp)
        model = from_pretrained(tmp)
    cfg = model.config
    engine = Engine(model, config=EngineConfig(max_slots=args.batch))
    prompts = _prompts(np.random.default_rng(args.seed), args.batch, args.min_prompt, args.max_prompt, args.vocab)
    kw = dict(max_new_tokens=args.new, sampling=SamplingParams(temperature=0.0, eos_ids=[], seed=0))
    engine.generate(prompts, **kw)  # compiles
    calls_s = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        engine.generate(prompts, **kw)
        calls_s.append(time.perf_counter() - t)
    trace_dir = tempfile.mkdtemp(prefix="engine_profile_trace_")
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        engine.generate(prompts, **kw)
    steps = engine.stats["decode_steps"]
    trace = json.load(gzip.open(glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)[0]))
    classes_by_module, conflicts = {}, {}
    for module in ("jit__decode_chunk", "jit__prefill"):
        files = sorted(glob.glob(f"{dump}/*.{module}.cpu_after_optimizations.txt"))
        if not files:
            raise SystemExit(f"no optimized HLO of {module} under {dump}: did XLA_FLAGS reach XLA?")
        classes_by_module[module], conflicts[module] = merge_variants(
            [classify_ops(hlo_ops(open(f).read()), cfg.vocab_size) for f in files]
        )
    agg = aggregate([e for e in trace["traceEvents"] if e.get("ph") == "X"], classes_by_module)
    decode, prefill = agg["jit__decode_chunk"], agg.get("jit__prefill", {"wall_s": 0.0})
    layer_flops, head_flops = matmul_flops_per_token(cfg)
    peak = matmul_peak_gflops(args.batch, cfg.hidden_size, cfg.vocab_size)
    step_flops = args.batch * (layer_flops + head_flops)
    result = {
        "benchmark": "engine_profile",
        "batch": args.batch,
        "new_tokens": args.new,
        "call_s": calls_s,
        "call_median_s": statistics.median(calls_s),
        "decode_steps": steps,
        "prefill_wall_s": prefill["wall_s"],
        "decode_wall_s": decode["wall_s"],
        "decode_step_ms": 1e3 * decode["wall_s"] / steps,
        "decode_op_ms_per_step": {c: 1e3 * s / steps for c, s in decode["op_s"].items()},
        "matmul_gflop_per_step": step_flops / 1e9,
        "matmul_peak_gflops": peak,
        "step_ms_at_matmul_peak": 1e3 * step_flops / (peak * 1e9),
        "instruction_names_classed_other_by_variant_conflict": conflicts["jit__decode_chunk"],
    }
    result["decode_step_vs_matmul_roofline"] = result["decode_step_ms"] / result["step_ms_at_matmul_peak"]
    result["machine"] = machine_state()
    out = sys.stderr if args.json else sys.stdout
    print(
        f"greedy {args.batch} x {args.new}: call {result['call_median_s']:.2f} s (median of {args.repeats}); "
        f"profiled call: prefill {prefill['wall_s']:.2f} s, decode {decode['wall_s']:.2f} s over {steps} steps "
        f"= {result['decode_step_ms']:.1f} ms/step",
        file=out,
    )
    for c, ms in result["decode_op_ms_per_step"].items():
        print(f"  {c:14s} {ms:7.2f} ms/step (op time)", file=out)
    print(
        f"matmuls {result['matmul_gflop_per_step']:.2f} GFLOP/step at the measured peak {peak:.0f} GFLOP/s = "
        f"{result['step_ms_at_matmul_peak']:.1f} ms/step: the decode step is "
        f"{result['decode_step_vs_matmul_roofline']:.2f}x that roofline",
        file=out,
    )
    if args.json:
        print(json.dumps(result, indent=1))
    if args.keep:
        print(f"HLO dump: {dump}\ntrace: {trace_dir}", file=sys.stderr)
    else:  # last: every compile (the peak matmul's too) writes into the dump
        shutil.rmtree(dump, ignore_errors=True)
        shutil.rmtree(trace_dir, ignore_errors=True)
    return result


if __name__ == "__main__":
    main()
