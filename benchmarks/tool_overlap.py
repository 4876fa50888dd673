"""Multi-turn tool rollouts: event-driven (each row's sandbox call overlaps the decoding of the other rows) vs
lock-step (every row of a turn stops, then the turn's calls run, then every observation is appended).

Workload: the tool demo's (configs/tiny_cpu_tool_base.yaml: the tool_mul toy task, its 4-layer warm-started model
from the toy cache - built on first use, about 5 min on 2 cores -, --prompts prompts x rl.group_size samples,
sampling.max_new_tokens, the run config's engine and tool settings). Calls run in the real local sandbox; each
call's latency is then raised to a draw uniform in [--latency-min, --latency-max] s (a remote sandbox's round
trip; draws seeded per call, the same for both sides). --workers sandbox calls at once. The two sides run
interleaved through benchmarks/harness.py (an untimed warm-up each, which compiles); their rows are checked
identical (tokens, masks, statuses).

    .venv/bin/python benchmarks/tool_overlap.py [--prompts 8] [--workers 8] [--latency-min 0.2]
                                                [--latency-max 0.5] [--repeats 3] [--cache-dir .cache/toy] [--json]
                                                [config overrides: sampling.engine.max_slots=16 ...]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import add_harness_args, compare, emit  # noqa: E402

from stare_jax import models  # noqa: E402
from stare_jax.config.loader import load_config  # noqa: E402
from stare_jax.data.tokenizer import load_tokenizer  # noqa: E402
from stare_jax.sampling import SamplingParams  # noqa: E402
from stare_jax.tools.config import make_backend  # noqa: E402
from stare_jax.tools.pool import Backend, SandboxPool  # noqa: E402
from stare_jax.tools.rollout import tool_rollouts  # noqa: E402
from stare_jax.toy import assets as toy
from stare_jax.training.setup import make_sampler  # noqa: E402


class LatencyBackend:
    """`inner`'s run, then a sleep to a total latency uniform in [lo, hi] s (the k-th call of a rollout draws
    from Random(seed + k), so both sides wait alike)."""

    def __init__(self, inner: Backend, lo: float, hi: float, seed: int = 0):
        self.inner, self.lo, self.hi, self.seed = inner, lo, hi, seed
        self.lock = threading.Lock()
        self.calls = 0

    def run(self, code):
        with self.lock:
            k, self.calls = self.calls, self.calls + 1
        t0 = time.monotonic()
        res = self.inner.run(code)
        target = random.Random(self.seed + k).uniform(self.lo, self.hi)
        time.sleep(max(0.0, target - (time.monotonic() - t0)))
        return res


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/tiny_cpu_tool_base.yaml")
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. sampling.engine.max_slots=16")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per rollout (x rl.group_size samples)")
    ap.add_argument("--workers", type=int, default=8, help="sandbox calls at once")
    ap.add_argument("--latency-min", type=float, default=0.2)
    ap.add_argument("--latency-max", type=float, default=0.5)
    ap.add_argument("--cache-dir", default=None, help="toy asset cache (default: the config's toy.cache_dir)")
    add_harness_args(ap, repeats=3)
    args = ap.parse_args(argv)
    out = sys.stderr if args.json else sys.stdout
    cfg = load_config(args.config, args.overrides)
    assets = toy.prepare(
        toy.asset_config(cfg.toy), cache_dir=args.cache_dir or cfg.toy.cache_dir, log=lambda m: print(m, file=out)
    )
    tok = load_tokenizer(assets.model_dir / "tokenizer.model")
    engine = make_sampler(models.from_pretrained(assets.model_dir), cfg, None, tok.pad_id)
    lines = assets.train_path.read_text().splitlines()[: args.prompts]
    prompts = [toy.encode_example(tok, json.loads(line)["problem"]) for line in lines]
    G, N = cfg.rl.group_size, cfg.sampling.max_new_tokens
    print(
        f"{len(prompts)} prompts x {G} samples, {N} new tokens, call latency U[{args.latency_min}, "
        f"{args.latency_max}] s, {args.workers} sandbox workers, engine {engine.engine_config}",
        file=out,
    )
    rows: dict[str, list] = {}
    calls: dict[str, int] = {}

    def side(overlap: bool):
        name = "overlapped" if overlap else "lock-step"

        def run():
            backend = LatencyBackend(make_backend(cfg.tool), args.latency_min, args.latency_max)
            with SandboxPool(args.workers, backend=backend) as pool:
                rows[name] = tool_rollouts(
                    engine,
                    prompts,
                    group_size=G,
                    tool_cfg=cfg.tool,
                    tokenizer=tok,
                    pool=pool,
                    max_new_tokens=N,
                    sampling=SamplingParams(temperature=cfg.sampling.temperature, seed=cfg.seed),
                    overlap=overlap,
                )
            calls[name] = backend.calls

        return run

    res = compare(
        {"overlapped": side(True), "lock-step": side(False)},
        repeats=args.repeats,
        reference="lock-step",
        label="tool rollout wall time",
        units=len(prompts) * G,
        unit_name="rows",
    )
    same = all(
        (a.tokens, a.model_mask, a.statuses, a.end) == (b.tokens, b.model_mask, b.statuses, b.end)
        for a, b in zip(rows["overlapped"], rows["lock-step"], strict=True)
    )
    turns = sum(r.turns for r in rows["lock-step"])
    print(f"rows identical: {same}; sandbox calls per rollout: {calls}; turns: {turns}", file=out)
    if not same:
        print("!!! the overlapped rows differ from the lock-step rows", file=sys.stderr)
    result = {
        "benchmark": "tool_overlap",
        "rows_identical": same,
        "sandbox_calls": calls,
        "turns": turns,
        "latency_s": [args.latency_min, args.latency_max],
        "workers": args.workers,
        "overrides": args.overrides,
        "comparisons": [res],
    }
    emit(result, args.json)
    return result


if __name__ == "__main__":
    main()
