"""The embedded toy task: "write k digits whose sum is S".

A verifiable task family that needs no download, is checked exactly, and has many valid answers per prompt
(so policy entropy means something, as in math RL): a prompt `digits 4 sum 17 =` is answered correctly by any
string of exactly 4 decimal digits summing to 17 (e.g. `9350`, `4418`, ...). The reference answer stored in
a row is the spec `4:17`, which the verifier reads; nothing from the response is ever evaluated.

Uniform sampling of valid answers (for the warm-start SFT corpus) uses exact counts from a small DP table.
"""

from __future__ import annotations

import functools
import random
import re

_RESPONSE_RE = re.compile(r"\s*([0-9]+)\s*")


def prompt_text(k: int, s: int) -> str:
    return f"digits {k} sum {s} ="


def spec(k: int, s: int) -> str:
    """The reference 'answer' stored with a prompt row."""
    return f"{k}:{s}"


def parse_spec(answer: str) -> tuple[int, int]:
    try:
        k_text, s_text = answer.split(":")
        k, s = int(k_text), int(s_text)
    except ValueError:
        raise ValueError(f"digit-sum answer spec must look like 'K:S', got {answer!r}") from None
    if k < 1 or not 0 <= s <= 9 * k:
        raise ValueError(f"digit-sum spec {answer!r}: need k >= 1 and 0 <= S <= 9k")
    return k, s


@functools.lru_cache(maxsize=None)
def count_strings(k: int, s: int) -> int:
    """Number of k-digit strings (leading zeros allowed) whose digits sum to s."""
    if k == 0:
        return int(s == 0)
    if s < 0:
        return 0
    return sum(count_strings(k - 1, s - d) for d in range(10))


def sample_answer(k: int, s: int, rng: random.Random) -> str:
    """A valid answer drawn uniformly among all count_strings(k, s) of them."""
    if count_strings(k, s) == 0:
        raise ValueError(f"no {k}-digit string sums to {s}")
    out = []
    for pos in range(k, 0, -1):
        r = rng.randrange(count_strings(pos, s))
        for d in range(10):
            c = count_strings(pos - 1, s - d)
            if r < c:
                out.append(str(d))
                s -= d
                break
            r -= c
    return "".join(out)


def score(response: str, answer: str) -> float:
    """1.0 iff the response (up to surrounding whitespace) is exactly k digits summing to S, else 0.0."""
    k, s = parse_spec(answer)
    m = _RESPONSE_RE.fullmatch(response)
    if m is None:
        return 0.0
    digits = m.group(1)
    return float(len(digits) == k and sum(map(int, digits)) == s)


def make_rows(n: int, *, seed: int, k_range: tuple[int, int] = (3, 6), min_count: int = 10) -> list[dict]:
    """n prompt rows {id, problem, answer} with k in k_range and S chosen so at least min_count answers exist."""
    rng = random.Random(seed)
    rows: list[dict] = []
    while len(rows) < n:
        k = rng.randint(*k_range)
        s = rng.randint(0, 9 * k)
        if count_strings(k, s) < min_count:
            continue
        rows.append({"id": f"digitsum-{seed}-{len(rows)}", "problem": prompt_text(k, s), "answer": spec(k, s)})
    return rows
