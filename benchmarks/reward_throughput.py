"""Reward scoring throughput: RewardPool (sandboxed worker processes) vs in-process `score`.

A realistic mix built from MATH-500 reference answers: long-ish reasoning text around the final answer,
answers rewritten in equivalent forms (\\dfrac, a/b, spacing, \\left( \\right), units, \\text{}), wrong
answers, missing answers, `Final Answer:` lines and </think> tails.

    .venv/bin/python benchmarks/reward_throughput.py [--n 2000] [--workers 2] [--data ../shared/data/math]

Prints items/s for the pool and for in-process scoring, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import re
import time

from stare_jax.rewards.math import score
from stare_jax.rewards.pool import RewardPool

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--group-size", type=int, default=8, help="responses per prompt (GRPO's G)")
    ap.add_argument("--timeout-s", type=float, default=5.0)
    ap.add_argument("--memory-mb", type=int, default=2048)
    ap.add_argument("--data", type=pathlib.Path, default=DEFAULT_DATA)
    args = ap.parse_args()

    responses, references = make_mix(args.data, args.n, args.group_size)
    mean_chars = sum(map(len, responses)) / len(responses)
    print(f"{args.n} responses ({args.group_size} per prompt) from math500 (mean {mean_chars:.0f} chars), "
          f"{args.workers} workers, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f}")

    t0 = time.perf_counter()
    with RewardPool(args.workers, timeout_s=args.timeout_s, memory_mb=args.memory_mb) as pool:
        t_start = time.perf_counter() - t0
        pool_scores, stats = pool.score_batch(responses, references)
    pool_ips = args.n / stats["wall_s"]
    print(f"pool start-up: {t_start:.2f} s")
    print(f"pool:       {pool_ips:8.1f} items/s  ({stats['wall_s']:.2f} s; accuracy {sum(pool_scores) / args.n:.3f}; "
          f"timeouts {stats['n_timeout']}, crashes {stats['n_crash']}, errors {stats['n_error']})")

    t0 = time.perf_counter()
    local_scores = [score(r, ref) for r, ref in zip(responses, references)]
    t_local = time.perf_counter() - t0
    local_ips = args.n / t_local
    print(f"in-process: {local_ips:8.1f} items/s  ({t_local:.2f} s; accuracy {sum(local_scores) / args.n:.3f})")
    print(f"ratio pool/in-process: {pool_ips / local_ips:.2f}x")
    n_diff = sum(a != b for a, b in zip(pool_scores, local_scores))
    print(f"score disagreements pool vs in-process: {n_diff}")


if __name__ == "__main__":
    main()
