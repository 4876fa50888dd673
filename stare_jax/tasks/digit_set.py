"""A second embedded toy task: "write K digits, each taken from the given set".

`digits 4 from 2 5 8 =` is answered correctly by any string of exactly 4 digits drawn from {2, 5, 8} (e.g. `5282`):
|set|^K valid answers per prompt, so a policy can spread its probability over many right answers (high entropy) or
collapse onto one (low entropy) while being equally correct, which is the situation STARE is about. Validity is a
local rule (each digit is in the prompt's set), so a tiny transformer learns it quickly; the warm start is made
deliberately imperfect (some answer digits are replaced by random ones) so RL has accuracy to gain.

The reference 'answer' stored with a row is the spec `4:258`; the verifier only reads it.
"""

from __future__ import annotations

import itertools
import random
import re

_RESPONSE_RE = re.compile(r"\s*([0-9]+)\s*")


def prompt_text(k: int, digits: str) -> str:
    return f"digits {k} from {' '.join(digits)} ="


def spec(k: int, digits: str) -> str:
    return f"{k}:{digits}"


def parse_spec(answer: str) -> tuple[int, str]:
    try:
        k_text, digits = answer.split(":")
        k = int(k_text)
    except ValueError:
        raise ValueError(f"digit-set answer spec must look like 'K:DIGITS', got {answer!r}") from None
    if k < 1 or not digits or not digits.isdigit() or len(set(digits)) != len(digits):
        raise ValueError(f"digit-set spec {answer!r}: need k >= 1 and distinct digits")
    return k, digits


def sample_answer(k: int, digits: str, rng: random.Random) -> str:
    """A valid answer drawn uniformly among all |digits|^k of them."""
    return "".join(rng.choice(digits) for _ in range(k))


def score(response: str, answer: str) -> float:
    """1.0 iff the response (up to surrounding whitespace) is exactly k digits, each from the set, else 0.0."""
    k, digits = parse_spec(answer)
    m = _RESPONSE_RE.fullmatch(response)
    if m is None:
        return 0.0
    got = m.group(1)
    return float(len(got) == k and all(c in digits for c in got))


def all_specs(k_range: tuple[int, int], set_size: int) -> list[tuple[int, str]]:
    return [
        (k, "".join(c))
        for k in range(k_range[0], k_range[1] + 1)
        for c in itertools.combinations("0123456789", set_size)
    ]


def make_rows(
    n: int,
    *,
    seed: int,
    k_range: tuple[int, int] = (3, 5),
    set_size: int = 3,
    specs: list[tuple[int, str]] | None = None,
) -> list[dict]:
    """n prompt rows {id, problem, answer}, drawn uniformly from `specs` (default: all (k, set) pairs)."""
    rng = random.Random(seed)
    specs = specs if specs is not None else all_specs(k_range, set_size)
    rows = []
    for i in range(n):
        k, digits = rng.choice(specs)
        rows.append({"id": f"digitset-{seed}-{i}", "problem": prompt_text(k, digits), "answer": spec(k, digits)})
    return rows
