"""Side-by-side timing for every benchmark: callables run interleaved in one process, with the machine's state.

A ratio measured by timing one side and then the other is decided by whatever else ran on the machine during
one of the two windows. `compare` runs the sides in turn (A B A B ...) after an untimed warm-up, so a load
change hits both alike, and records what the reader needs to judge the figure: min/median/max per side, the
ratio of medians and the median of the per-round ratios, the load average before and after (and its peak over
the rounds), the CPU count and each framework's thread settings. When the load average exceeded the core count
it warns on stderr and sets `busy: true`.

    from harness import add_harness_args, compare, emit   # benchmarks/ is sys.path[0] for a script
    res = compare({"stare_jax": run_jax, "transformers": run_torch}, repeats=args.repeats, label="fwd+bwd")
    emit({"benchmark": "model_fwd_bwd", "comparisons": [res]}, as_json=args.json)

Ratios are speed ratios against the reference side (the last one unless `reference=` names one):
ratio = median_s[reference] / median_s[side], so > 1 means `side` is faster.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Callable

THREAD_ENV_VARS = (
    "XLA_FLAGS",
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "TF_NUM_INTRAOP_THREADS",
    "TF_NUM_INTEROP_THREADS",
    "JAX_PLATFORMS",
    "KMP_AFFINITY",
)


def load_average() -> list[float]:
    """1-, 5- and 15-minute load averages."""
    return [round(x, 2) for x in os.getloadavg()]


def usable_cpus() -> int:
    """CPUs this process may run on (the affinity mask; os.cpu_count() where the platform has none)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def thread_settings() -> dict:
    """Threading knobs of the frameworks already imported (nothing is imported here) and of the environment."""
    out = {"env": {k: os.environ.get(k) for k in THREAD_ENV_VARS if os.environ.get(k) is not None}}
    torch = sys.modules.get("torch")
    if torch is not None:
        out["torch"] = {
            "version": torch.__version__,
            "num_threads": torch.get_num_threads(),
            "num_interop_threads": torch.get_num_interop_threads(),
        }
    jax = sys.modules.get("jax")
    if jax is not None:
        devices = jax.devices()
        out["jax"] = {
            "version": jax.__version__,
            "backend": jax.default_backend(),
            "devices": len(devices),
            "device_kind": devices[0].device_kind,
        }
    return out


def machine_state() -> dict:
    """CPU count, usable CPUs, load average now and the thread settings."""
    return {
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable_cpus(),
        "loadavg": load_average(),
        "niceness": os.nice(0),
        "threads": thread_settings(),
    }


def _block(out):
    """Wait for asynchronous JAX results so the timing covers the computation, not its dispatch."""
    jax = sys.modules.get("jax")
    if jax is not None:
        jax.block_until_ready(out)
    return out


def time_call(fn: Callable) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) of one call, JAX results waited for."""
    t0, c0 = time.perf_counter(), time.process_time()
    _block(fn())
    return time.perf_counter() - t0, time.process_time() - c0


def summarize(times_s: list[float]) -> dict:
    """min / median / max of one side's timed calls."""
    return {"min_s": min(times_s), "median_s": statistics.median(times_s), "max_s": max(times_s)}


def is_busy(loadavgs: list[list[float]], cores: int) -> bool:
    """True when any 1-minute load average seen exceeded the core count."""
    return any(la[0] > cores for la in loadavgs)


def interleave(fns: dict[str, Callable], repeats: int, warmup: int = 1) -> tuple[dict, list[list[float]]]:
    """Warm each side up (untimed), then call them in turn `repeats` times. Returns per side
    {"times_s", "cpu_s"} and the load averages sampled after each round."""
    for fn in fns.values():
        for _ in range(warmup):
            _block(fn())
    runs = {name: {"times_s": [], "cpu_s": []} for name in fns}
    loads = []
    for _ in range(repeats):
        for name, fn in fns.items():
            wall, cpu = time_call(fn)
            runs[name]["times_s"].append(wall)
            runs[name]["cpu_s"].append(cpu)
        loads.append(load_average())
    return runs, loads


def ratios(runs: dict, reference: str) -> dict:
    """Per side: the ratio of medians and the median (min, max) of per-round ratios, as reference time / side time."""
    ref_t = runs[reference]["times_s"]
    out = {}
    for name, r in runs.items():
        if name == reference:
            continue
        pair = [a / b for a, b in zip(ref_t, r["times_s"])]
        out[name] = {
            "ratio_of_medians": statistics.median(ref_t) / statistics.median(r["times_s"]),
            "median_of_pair_ratios": statistics.median(pair),
            "pair_ratio_min": min(pair),
            "pair_ratio_max": max(pair),
        }
    return out


def compare(
    fns: dict[str, Callable],
    repeats: int = 5,
    warmup: int = 1,
    reference: str | None = None,
    label: str = "",
    units: float | None = None,
    unit_name: str = "items",
) -> dict:
    """Time the callables interleaved and return the JSON-ready record (see the module docstring).

    units: work per call (tokens, items) so each side also gets units/s at its median; reference: the side the
    ratios divide by (default the last)."""
    if len(fns) < 2:
        raise ValueError("compare needs at least two sides")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    reference = reference or list(fns)[-1]
    before = load_average()
    runs, loads = interleave(fns, repeats, warmup)
    after = load_average()
    sides = {}
    for name, r in runs.items():
        s = summarize(r["times_s"])
        s.update(
            times_s=r["times_s"],
            cpu_s=r["cpu_s"],
            median_cpu_s=statistics.median(r["cpu_s"]),
            median_cores_busy=statistics.median(c / max(t, 1e-9) for c, t in zip(r["cpu_s"], r["times_s"])),
        )
        if units:
            s[f"{unit_name}_per_s"] = units / s["median_s"]
        sides[name] = s
    cores = usable_cpus()
    res = {
        "label": label,
        "reference": reference,
        "repeats": repeats,
        "warmup": warmup,
        "sides": sides,
        "ratios": ratios(runs, reference),
        "loadavg_before": before,
        "loadavg_after": after,
        "loadavg_peak_1m": max(la[0] for la in [before, after] + loads),
        "cpu_count": os.cpu_count(),
        "cpus_usable": cores,
        "niceness": os.nice(0),
        "threads": thread_settings(),
        "busy": is_busy([before, after] + loads, cores),
    }
    if res["busy"]:
        warn_busy(res)
    return res


def warn_busy(res: dict) -> None:
    """The loud stderr warning for a ratio measured on an oversubscribed machine."""
    print(
        f"\n!!! WARNING [{res['label']}]: load average peaked at {res['loadavg_peak_1m']:.2f} > "
        f"{res['cpus_usable']} usable cores: the machine was busy, these timings are not a quiet-machine "
        f"figure (busy: true) !!!\n",
        file=sys.stderr,
        flush=True,
    )


def format_comparison(res: dict) -> str:
    """Human-readable lines for one `compare` record."""
    lines = [
        f"[{res['label']}] {res['repeats']} interleaved rounds (+{res['warmup']} warm-up), load "
        f"{res['loadavg_before'][0]:.2f} before / {res['loadavg_after'][0]:.2f} after "
        f"(peak {res['loadavg_peak_1m']:.2f}), {res['cpus_usable']}/{res['cpu_count']} CPUs, "
        f"nice {res['niceness']}" + ("  ** BUSY **" if res["busy"] else "")
    ]
    for name, s in res["sides"].items():
        rate = next((f"  {v:10.1f} {k.replace('_', ' ')}" for k, v in s.items() if k.endswith("_per_s")), "")
        lines.append(
            f"  {name:22s} median {s['median_s'] * 1e3:9.1f} ms  (min {s['min_s'] * 1e3:.1f}, max "
            f"{s['max_s'] * 1e3:.1f}; CPU {s['median_cpu_s']:.2f} s, {s['median_cores_busy']:.2f} cores)" + rate
        )
    for name, r in res["ratios"].items():
        lines.append(
            f"  ratio {name} / {res['reference']} (speed): {r['ratio_of_medians']:.3f} of medians, "
            f"{r['median_of_pair_ratios']:.3f} median of per-round ratios"
        )
    return "\n".join(lines)


def format_threads(threads: dict) -> str:
    """One line: torch threads, jax backend, thread env vars."""
    parts = []
    if "torch" in threads:
        t = threads["torch"]
        parts.append(f"torch {t['version']} threads {t['num_threads']}/{t['num_interop_threads']} interop")
    if "jax" in threads:
        j = threads["jax"]
        parts.append(f"jax {j['version']} {j['backend']} x{j['devices']}")
    parts += [f"{k}={v}" for k, v in threads["env"].items()]
    return ", ".join(parts) or "-"


def add_harness_args(parser, repeats: int = 5) -> None:
    """--repeats and --json, the flags every benchmark shares."""
    parser.add_argument("--repeats", type=int, default=repeats, help="interleaved timed rounds per side")
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout (text to stderr)")


def emit(result: dict, as_json: bool) -> None:
    """Print the comparisons (to stderr under --json) and, with --json, the whole record as JSON on stdout."""
    result.setdefault("machine", machine_state())
    text = "\n".join(format_comparison(c) for c in result.get("comparisons", []))
    text += f"\nthreads: {format_threads(result['machine']['threads'])}"
    print(text, file=sys.stderr if as_json else sys.stdout, flush=True)
    if as_json:
        print(json.dumps(result, default=float))
