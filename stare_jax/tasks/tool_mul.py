"""The tool-use toy task: "multiply m by any k-digit number made of these digits" - for `stare-jax demo --scenario
tool` (multi-turn RL with the code interpreter).

A prompt `mul 37 by 5 from 2 4 5 8 =` is answered correctly by any number equal to 37 * D where D is a 5-digit
number whose digits all come from {2, 4, 5, 8}: |set|^k correct answers (1024 here), so policy entropy can be held,
as in the digit-set task. Computing 37 * 54282 in its head is out of reach for the toy's 4-layer model (the
product's digits depend on every digit of both factors; by construction accuracy without the tool is ~0), but with
the tool it writes `<code>print(37*54282)</code>`, gets `<interpreter>2008434</interpreter>` back and copies
`2008434`: choosing D is the digit-set task, the multiplication is the tool's. Why this design (and not e.g. "add
two numbers"):

- (a) no shortcut: multiples of 10 are never the multiplier (m*D would be D followed by a 0), and 0 is never in the
  set (no leading zeros, so D is read back from the answer unambiguously as answer // m);
- (b) many correct answers: the choice of D carries the entropy; the call, the copy and the answer's length do not.
  The toy's tokenizer keeps the call's opener `<code>print(` and its closing tag as single pieces, so D's k digits
  are k of the ~2k + 8 tokens the model writes (the demo's k = 4-6, 4-digit sets: an always-right policy that
  keeps D uniform has ~0.36 nats/token);
- (c) a tiny model learns the format: the call copies m from the prompt and draws D from the set; the answer
  copies the interpreter's digits (an induction-head job).

The reference stored with a row is the spec `37:5:2458` (m:k:digits). The verifier reads only the response's
digits after its last closing tag (</interpreter> or </code>: the tool-disabled ablation has no observation), never
evaluates model text, and checks answer % m == 0 and answer // m has exactly k digits, all from the set.
"""

from __future__ import annotations

import itertools
import random
import re

_RESPONSE_RE = re.compile(r"\s*([0-9]+)\s*")
_CLOSING_TAGS = ("</interpreter>", "</code>")
SET_DIGITS = "123456789"


def prompt_text(m: int, k: int, digits: str) -> str:
    return f"mul {m} by {k} from {' '.join(digits)} ="


def spec(m: int, k: int, digits: str) -> str:
    """The reference 'answer' stored with a prompt row."""
    return f"{m}:{k}:{digits}"


def parse_spec(answer: str) -> tuple[int, int, str]:
    try:
        m_text, k_text, digits = answer.split(":")
        m, k = int(m_text), int(k_text)
    except ValueError:
        raise ValueError(f"tool-mul answer spec must look like 'M:K:DIGITS', got {answer!r}") from None
    if (
        m < 2
        or m % 10 == 0
        or k < 1
        or not digits
        or not all(c in SET_DIGITS for c in digits)
        or len(set(digits)) != len(digits)
    ):
        raise ValueError(
            f"tool-mul spec {answer!r}: need m >= 2 not a multiple of 10, k >= 1 and distinct digits from 1-9"
        )
    return m, k, digits


def sample_factor(k: int, digits: str, rng: random.Random) -> str:
    """A k-digit D drawn uniformly among the |digits|^k valid ones."""
    return "".join(rng.choice(digits) for _ in range(k))


def sample_answer(m: int, k: int, digits: str, rng: random.Random) -> str:
    """A valid answer (m * D) drawn uniformly among all |digits|^k of them."""
    return str(m * int(sample_factor(k, digits, rng)))


def call_text(m: int, factor: str) -> str:
    """The model's tool call that computes m * factor (the retool format's <code> tags)."""
    return f"<code>print({m}*{factor})</code>"


def answer_text(response: str) -> str:
    """The part of a response the verifier reads: the text after its last closing tag (all of it if none)."""
    cut = max((response.rfind(t) + len(t) for t in _CLOSING_TAGS if t in response), default=0)
    return response[cut:]


def score(response: str, answer: str) -> float:
    """1.0 iff the response's answer (answer_text, up to surrounding whitespace) is a number N with N % m == 0 and
    N // m exactly k digits, each from the set; else 0.0."""
    m, k, digits = parse_spec(answer)
    got = _RESPONSE_RE.fullmatch(answer_text(response))
    if got is None:
        return 0.0
    n = int(got.group(1))
    factor = str(n // m)
    return float(n % m == 0 and len(factor) == k and all(c in digits for c in factor))


def all_specs(m_range: tuple[int, int], k_range: tuple[int, int], set_size: int) -> list[tuple[int, int, str]]:
    """Every (m, k, digits) with m in m_range (multiples of 10 left out), k in k_range and a set of set_size digits."""
    return [
        (m, k, "".join(c))
        for m in range(m_range[0], m_range[1] + 1)
        if m % 10
        for k in range(k_range[0], k_range[1] + 1)
        for c in itertools.combinations(SET_DIGITS, set_size)
    ]
