"""Reward scoring throughput: RewardPool (sandboxed worker processes) vs in-process `score`.

A realistic mix built from MATH-500 reference answers: long-ish reasoning text around the final answer,
answers rewritten in equivalent forms (\\dfrac, a/b, spacing, \\left( \\right), units, \\text{}), wrong
answers, missing answers, `Final Answer:` lines and </think> tails.

    .venv/bin/python benchmarks/reward_throughput.py [--n 2000] [--workers 2] [--data ../shared/data/math]
                                                     [--repeats 3] [--json]

Prints items/s for the pool and for in-process scoring, and their ratio (pool speed / in-process speed), the two
timed interleaved through benchmarks/harness.py (an untimed warm-up batch each, then A B A B ...; load average
before/after, thread settings, `busy` when the load exceeded the core count). The pool is started once, before
the rounds (its start-up time is reported apart).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import add_harness_args, compare, emit  # noqa: E402

from stare_jax.rewards.math import score  # noqa: E402
from stare_jax.rewards.pool import RewardPool  # noqa: E402

DEFAULT_DATA = pathlib.Path(__file__).resolve().parents[2] / "shared" / "data" / "math"
FILLER = (
    "Let us think step by step. We set up the equation and simplify both sides carefully, "
    "checking each algebraic manipulation. "
)


def _rewrite(ans: str, rng: random.Random) -> str:
    """An equivalent-looking surface form of a reference answer."""
    choice = rng.randrange(5)
    if choice == 0:
        return ans.replace("\\frac", "\\dfrac")
    if choice == 1:
        return re.sub(r"\\frac\{(\d+)\}\{(\d+)\}", r"\1/\2", ans)
    if choice == 2:
        return " " + ans.replace(",", ", ") + " "
    if choice == 3 and re.fullmatch(r"-?\d+", ans):
        return ans + "\\text{ units}"
    return ans


def make_mix(data_dir: pathlib.Path, n: int, group_size: int = 8, seed: int = 0) -> tuple[list[str], list[str]]:
    rows = [json.loads(line) for line in (data_dir / "math500.jsonl").open()]
    rng = random.Random(seed)
    responses, references = [], []
    for i in range(n):
        ref = rows[(i // group_size) % len(rows)]["answer"]  # G rollouts per prompt, prompt-major like RL
        body = FILLER * rng.randint(5, 40)
        kind = rng.random()
        if kind < 0.45:
            ans = _rewrite(ref, rng)
            tail = f"Therefore the answer is $\\boxed{{{ans}}}$."
        elif kind < 0.75:
            tail = f"Therefore the answer is $\\boxed{{{ref}+1}}$."  # wrong
        elif kind < 0.85:
            tail = f"Final Answer: The final answer is ${ref}$. I hope it is correct."
        elif kind < 0.93:
            tail = f"</think>\n\nSo we get \\boxed{{{_rewrite(ref, rng)}}}."
            body = "<think>" + body
        else:
            tail = "I could not finish the computation."
        responses.append(body + tail)
        references.append(ref)
    return responses, references


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=8, help="responses per prompt (GRPO's G)")
    ap.add_argument("--timeout-s", type=float, default=5.0)
    ap.add_argument("--memory-mb", type=int, default=2048)
    ap.add_argument("--data", type=pathlib.Path, default=DEFAULT_DATA)
    add_harness_args(ap, repeats=3)
    args = ap.parse_args(argv)
    out = sys.stderr if args.json else sys.stdout

    responses, references = make_mix(args.data, args.n, args.group_size)
    mean_chars = sum(map(len, responses)) / len(responses)
    print(
        f"{args.n} responses ({args.group_size} per prompt) from math500 (mean {mean_chars:.0f} chars), "
        f"{args.workers} workers, {os.cpu_count()} CPUs",
        file=out,
    )

    t0 = time.perf_counter()
    with RewardPool(args.workers, timeout_s=args.timeout_s, memory_mb=args.memory_mb) as pool:
        t_start = time.perf_counter() - t0
        last = {}

        def run_pool():
            last["pool"], last["stats"] = pool.score_batch(responses, references)

        def run_local():
            last["local"] = [score(r, ref) for r, ref in zip(responses, references)]

        res = compare(
            {"pool": run_pool, "in-process": run_local},
            repeats=args.repeats,
            label=f"reward scoring ({args.workers} workers)",
            units=args.n,
            unit_name="items",
        )
    stats = last["stats"]
    n_diff = sum(a != b for a, b in zip(last["pool"], last["local"]))
    print(
        f"pool start-up: {t_start:.2f} s; pool accuracy {sum(last['pool']) / args.n:.3f} (timeouts "
        f"{stats['n_timeout']}, crashes {stats['n_crash']}, errors {stats['n_error']}); in-process accuracy "
        f"{sum(last['local']) / args.n:.3f}; score disagreements pool vs in-process: {n_diff}",
        file=out,
    )
    result = {
        "benchmark": "reward_throughput",
        "n": args.n,
        "workers": args.workers,
        "pool_startup_s": t_start,
        "score_disagreements": n_diff,
        "pool_stats": {k: v for k, v in stats.items() if k.startswith("n_")},
        "comparisons": [res],
    }
    emit(result, args.json)
    return result


if __name__ == "__main__":
    main()
