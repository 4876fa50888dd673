"""Math answer extraction, normalisation and equivalence scoring (the verifiable reward of RLVR).

Pipeline for one response:  extract_answer(text) -> normalize_answer(...) -> string match, else math-verify.

Safety notes (read before changing anything here):
- Nothing taken from model output is ever evaluated as Python.  We never call eval/exec/sympify/parse_expr
  on response text.  Equivalence goes through math-verify with *only* `LatexExtractionConfig`, which parses
  with latex2sympy2_extended's ANTLR grammar into SymPy objects.  math-verify's `ExprExtractionConfig`
  (the default second extractor) calls sympy's `parse_expr`, which uses Python `eval` internally; it is
  deliberately NOT used here.  The one place SymPy still evaluates a string is latex2sympy's
  `sympy.Number(token)` for NUMBER tokens, which the grammar restricts to digits and a decimal point
  (tests/unit/rewards/test_math.py spies on SymPy's eval and checks exactly that).  Our own numeric fast path
  uses fractions.Fraction on regex-validated digit strings, and the relative-error check evaluates SymPy
  objects (sympy.N), never strings.
- Extraction and normalisation are linear-time scans (str.rfind, brace counting, anchored regexes without
  nested quantifiers), so a 1 MB response or 10,000 nested braces cannot cause regex backtracking blow-ups.
- Bounded time on any input, in any thread, without a subprocess (`score(..., timeout_s=5.0)`):
  1. before parsing, answers nesting brackets deeper than `_sympy_budget.MAX_NESTING` are refused (the LaTeX
     parser's prediction is super-linear in nesting depth);
  2. after parsing (latex2sympy builds *unevaluated* trees, in milliseconds) and before anything is evaluated,
     `_sympy_budget` bounds the size of every exact number evaluation could build (`MAX_BITS` per node,
     `MAX_TOTAL_BITS` summed) and the monomials of the symbolic parts multiplied out (`MAX_TERMS`); a tree
     past them is never evaluated.  This is what stops 9^{9^{9^{9}}},
     99999! and 2^{10^{9}}: their cost is one uninterruptible big-integer C call, which no timer can stop.
     Equality of such over-budget answers is structural: equal iff the unevaluated trees are identical (so
     `10^{10^{100}}` equals `10^{10^{100}}` and `{10}^{10^{100}}`, but not `(10^{10})^{10^{99}}` or
     `10^{10^{100}}+1`); the value is never computed.
  3. what remains (simplify / solve / integrate on in-budget trees) runs in a helper thread the caller waits
     for at most `timeout_s` (`_deadline.call_with_timeout`); past it the answer scores 0, a warning is logged
     and the helper is stopped in the background.  The limit is wall-clock, so only pathological answers can
     depend on machine load; steps 1-2 are deterministic.
  `RewardPool` (stare_jax/rewards/pool.py) adds process isolation, an address-space limit and a kill for
  training at scale; its workers call `score(..., timeout_s=None)` and own the timeout themselves.
- math-verify's own timeouts use signal.alarm and only work in a process's main thread; we switch them off
  (parsing_timeout=None, timeout_seconds=None).
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Sequence
from fractions import Fraction

from stare_jax.data.boxed import last_boxed, scan_braced
from stare_jax.rewards import _sympy_budget
from stare_jax.rewards._deadline import DeadlineExceeded, call_with_timeout
from stare_jax.rewards.shaping import overlong_penalty, reward_from_correct  # re-exported: their old home

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "MAX_ANSWER_CHARS",
    "extract_answer",
    "normalize_answer",
    "is_equivalent",
    "score",
    "reward_from_correct",
    "overlong_penalty",
    "reference_alternatives",
]

# Extracted answers longer than this are not handed to the SymPy-based checker (only string-compared):
# no benchmark answer is longer than ~210 characters, and SymPy's parser cost grows quickly with size.
MAX_ANSWER_CHARS = 1000
# Default wall-clock limit (s) of score / is_equivalent's symbolic check (the slowest labelled case takes 0.3 s).
DEFAULT_TIMEOUT_S = 5.0

_log = logging.getLogger(__name__)
logging.getLogger("math_verify").setLevel(logging.ERROR)
logging.getLogger("latex2sympy2_extended").setLevel(logging.ERROR)


# ----------------------------------------------------------------------------------------------------------
# Extraction
# ----------------------------------------------------------------------------------------------------------
_FINAL_PHRASES = ("final answer", "the answer is")
_HOPE = "i hope it is correct"


def _after_final_phrase(text: str) -> str | None:
    """The answer after the last 'Final Answer:' / '**Final Answer**' / 'The final answer is' /
    'The answer is': the rest of that line, or the next non-empty line if the phrase ends its line."""
    lower = text.lower()
    best, best_len = -1, 0
    for phrase in _FINAL_PHRASES:
        pos = lower.rfind(phrase)
        if pos > best:
            best, best_len = pos, len(phrase)
    if best < 0:
        return None
    i, n = best + best_len, len(text)
    while i < n and text[i] in " \t*:":
        i += 1
    if lower.startswith("is", i) and (i + 2 == n or not text[i + 2].isalpha()):  # 'The final answer is X'
        i += 2
    while i < n and text[i] in " \t*:\n\r":
        i += 1
    nl = text.find("\n", i)
    line = text[i:] if nl < 0 else text[i:nl]
    inner = last_boxed(line)
    if inner is not None:
        return inner
    line = line.rstrip(" \t\r.")
    if line.lower().endswith(_HOPE):  # Minerva style: 'The final answer is X. I hope it is correct.'
        line = line[: -len(_HOPE)]
    line = line.rstrip(" \t\r.$").lstrip(" \t$")
    return line or None


def extract_answer(text: str) -> str | None:
    """The final answer in a model response, or None.

    Order: if the response closes a `</think>` block, only the text after the last `</think>` is searched
    (the reasoning is a draft).  In that text: the last \\boxed{...} (nested braces), `\\boxed 5`, \\fbox{...};
    else the text after 'Final Answer:' / 'The final answer is' / 'The answer is'; else (after </think> only)
    the whole short tail itself.  The result is raw (not normalised), stripped of surrounding space.
    """
    if not isinstance(text, str):
        raise ValueError(f"extract_answer: text must be str, got {type(text).__name__}")
    think_end = text.rfind("</think>")
    region = text[think_end + len("</think>") :] if think_end >= 0 else text
    boxed = last_boxed(region)
    if boxed is not None:
        return boxed
    final = _after_final_phrase(region)
    if final is not None:
        return final
    if think_end >= 0:
        tail = region.strip()
        if tail and len(tail) <= 100 and "\n" not in tail:
            tail = tail.strip("$").strip().rstrip(".").strip()
            return tail or None
    return None


# ----------------------------------------------------------------------------------------------------------
# Normalisation
# ----------------------------------------------------------------------------------------------------------
_UNIT_WORDS = (
    "square units|square feet|square inches|square meters|square centimeters|sq units|units|unit|"
    "centimeters|centimeter|millimeters|millimeter|kilometers|kilometer|meters|meter|cm|mm|km|"
    "inches|inch|in|feet|foot|ft|yards|yard|miles|mile|mph|"
    "degrees|degree|radians|dollars|dollar|cents|cent|"
    "hours|hour|hrs|hr|minutes|minute|mins|min|seconds|second|sec|days|day|weeks|week|years|year|"
    "pounds|pound|lbs|lb|ounces|ounce|oz|grams|gram|kg|liters|liter|ml|"
    "people|students|points|ways|cups|apples|eggs|marbles|times|percent"
)
# A trailing unit word (optionally ^2/^3), after a numeric-looking prefix.  Anchored, no nested quantifiers.
_TRAILING_UNIT_RE = re.compile(r"^(?P<num>.*?[0-9}])\s*(?:" + _UNIT_WORDS + r")(?:\^\{?[23]\}?)?$")
_TEXT_CMDS = ("\\text", "\\textbf", "\\textit", "\\mathrm", "\\mathbf", "\\mbox", "\\operatorname")
_SPACING = ("\\,", "\\;", "\\:", "\\quad", "\\qquad", "\\displaystyle")
_DEGREE = ("^{\\circ}", "^\\circ", "^{\\circ }", "\\circ", "°", "\\degree")
_THOUSANDS_RE = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_VAR_PREFIX_RE = re.compile(r"^(?:\\?[A-Za-z]+(?:_\{?[A-Za-z0-9]+\}?)?|[A-Za-z]\([A-Za-z]\))\s*=\s*")
_SQRT_BARE_RE = re.compile(r"\\sqrt(\d)")
_FRAC_BARE_RE = re.compile(r"\\frac(\d)(\d)")
_LEADING_ZEROS_RE = re.compile(r"^(-?)0+(\d)")
_CHOICE_RE = re.compile(r"^\(([A-Ea-e])\)$")
_LATEX_SPACE_RE = re.compile(r"(?<!\\)\\ ")  # a LaTeX space '\ ', not a row break '\\'
_LEFT_RIGHT_RE = re.compile(r"\\(?:left|right)(?![A-Za-z])")
_BASE_RE = re.compile(r"^(-?[0-9A-Za-z]+)_\{?(\d+)\}?$")
_SCI_RE = re.compile(r"^(-?\d+(?:\.\d+)?)[eE]([+-]?\d+)$")


def _unwrap_text_cmds(s: str, drop_trailing_unit: bool) -> str:
    """Replace \\text{X} (and friends) by X; a trailing one after other content is a unit and is dropped.
    Linear: each brace scan ends where the next search starts; after an unbalanced one, scanning stops."""
    out: list[str] = []
    has_content = False
    balanced = True
    content_end = len(s.rstrip())
    i = 0
    n = len(s)
    while i < n:
        j = s.find("\\", i) if balanced else -1
        if j != i:  # copy the plain chunk up to the next backslash in one step
            chunk = s[i:] if j < 0 else s[i:j]
            out.append(chunk)
            has_content = has_content or bool(chunk.strip())
            if j < 0:
                break
            i = j
        if balanced:
            cmd = next((c for c in _TEXT_CMDS if s.startswith(c + "{", i) or s.startswith(c + " {", i)), None)
            if cmd is not None:
                open_pos = s.index("{", i)
                end = scan_braced(s, open_pos)
                if end < 0:
                    balanced = False
                else:
                    inner = s[open_pos + 1 : end - 1]
                    is_trailing = end >= content_end
                    if drop_trailing_unit and is_trailing and has_content and _looks_like_unit(inner):
                        i = end
                        continue
                    out.append(inner)
                    has_content = has_content or bool(inner.strip())
                    i = end
                    continue
        out.append(s[i])
        has_content = has_content or not s[i].isspace()
        i += 1
    return "".join(out)


def _looks_like_unit(inner: str) -> bool:
    """Unit text such as ' cm', 'inches', ' kcal m}^{-2': letters, spaces, ^, digits, signs and braces only."""
    t = inner.strip()
    return bool(t) and t[0].isalpha() and all(c.isalnum() or c in " ^{}-/." for c in t)


def normalize_answer(ans: str) -> str:
    """Canonical string form of an answer, for exact string comparison and before math-verify.

    Handles: $...$ / \\(...\\) wrappers, \\dfrac/\\tfrac, \\left/\\right, LaTeX spacing, \\text{} wrappers and
    trailing units, degrees, dollars, percentages, thousands separators, `x =` prefixes, trailing periods,
    `\\sqrt2` / `\\frac12`, leading zeros of integers, `(C)` multiple-choice parentheses.  All scans linear.
    """
    s = ans.strip()
    s = s.replace("\\$", "").replace("$", "")
    s = s.replace("\\(", "").replace("\\)", "").replace("\\[", "").replace("\\]", "")
    s = s.replace("\n", " ").replace("~", " ")
    s = _LATEX_SPACE_RE.sub(" ", s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = _LEFT_RIGHT_RE.sub("", s)
    s = s.replace("\\!", "")
    for sp in _SPACING:
        s = s.replace(sp, " ")
    for d in _DEGREE:
        s = s.replace(d, "")
    s = s.replace("\\%", "").replace("%", "")
    s = s.replace("{,}", ",")
    s = _unwrap_text_cmds(s, drop_trailing_unit=True)
    s = s.strip()
    s = s.rstrip(".").rstrip(",;").strip()
    if s.count("=") == 1 and "\\le" not in s and "\\ge" not in s:
        s = _VAR_PREFIX_RE.sub("", s, count=1)
    m = _TRAILING_UNIT_RE.match(s)
    if m is not None:
        s = m.group("num")
    s = s.strip()
    if _THOUSANDS_RE.match(s):
        s = s.replace(",", "")
    s = _SQRT_BARE_RE.sub(r"\\sqrt{\1}", s)
    s = _FRAC_BARE_RE.sub(r"\\frac{\1}{\2}", s)
    s = " ".join(s.split())
    s = _SCI_RE.sub(r"\1 \\times 10^{\2}", s)
    s = _LEADING_ZEROS_RE.sub(r"\1\2", s)
    m = _CHOICE_RE.match(s)
    if m is not None:
        s = m.group(1).upper()
    return s


def _string_key(s: str) -> str:
    """Whitespace-free normalised form for the exact-match fast path."""
    return "".join(s.split())


def _is_text_answer(norm_ref: str) -> bool:
    """A word answer ('Evelyn', 'ellipse', 'east') or a choice letter: compared as text, never symbolically
    (SymPy would read 'Evelyn' as the product E*v*e*l*y*n and accept any anagram)."""
    t = norm_ref.replace(" ", "")
    return (len(t) >= 2 and t.isalpha() and not norm_ref.startswith("\\")) or (len(t) == 1 and t in "ABCDE")


# ----------------------------------------------------------------------------------------------------------
# Equivalence
# ----------------------------------------------------------------------------------------------------------
_LATEX_CFG = None


def _latex_config():
    global _LATEX_CFG
    if _LATEX_CFG is None:
        from math_verify import LatexExtractionConfig

        _LATEX_CFG = [LatexExtractionConfig()]
    return _LATEX_CFG


def _mv_parse(latex: str):
    """math-verify parse of one normalised answer, LaTeX extraction only (no Python eval path; see module doc)."""
    from math_verify import parse

    return parse("$" + latex + "$", extraction_config=_latex_config(), parsing_timeout=None)


_NUM_RE = re.compile(r"^(-?)(\d+)(?:\.(\d+))?$")
_SLASH_RE = re.compile(r"^(-?)(\d+)\s*/\s*(\d+)$")
_FRAC_RE = re.compile(r"^(-?)\\frac\{(-?\d+)\}\{(\d+)\}$")


def _as_exact_number(s: str) -> Fraction | None:
    """Exact value of a plain integer / decimal / a/b / \\frac{a}{b} string (regex-validated, never eval'd)."""
    t = s.replace(" ", "")
    if len(t) > 40:
        return None
    m = _NUM_RE.match(t)
    if m is not None:
        sign, whole, frac = m.groups()
        v = Fraction(int(whole + (frac or "")), 10 ** len(frac or ""))
        return -v if sign else v
    m = _SLASH_RE.match(t) or _FRAC_RE.match(t)
    if m is not None:
        sign, num, den = m.groups()
        if int(den) == 0:
            return None
        v = Fraction(int(num), int(den))
        return -v if sign else v
    return None


@functools.lru_cache(maxsize=4096)
def _parse_reference(norm_ref: str):
    """Parsed reference, cached: the G responses of a prompt share one reference (SymPy objects are immutable).
    Returns a tuple so cached values cannot be mutated by callers."""
    return tuple(_mv_parse(norm_ref))


_WARMED_UP = False


def _warm_up() -> None:
    """Import math-verify / SymPy and load the LaTeX grammar once, outside any time limit (an import stopped
    half-way would leave half-initialised modules behind; loading takes ~1 s, more on a busy machine)."""
    global _WARMED_UP
    if not _WARMED_UP:
        from math_verify import verify

        verify(list(_parse_reference("\\sqrt{2}")), _mv_parse("2^{1/2}"), timeout_seconds=None)
        _WARMED_UP = True


def _same_tree(gold, target) -> bool:
    """Structural equality of two unevaluated parse results (SymPy's == compares trees, evaluates nothing)."""
    try:
        return type(gold) is type(target) and bool(gold == target)
    except Exception:  # noqa: BLE001 - not comparable: not equal
        return False


def is_equivalent(pred: str, reference: str, *, timeout_s: float | None = DEFAULT_TIMEOUT_S) -> bool:
    """Whether an extracted answer `pred` equals `reference`: normalised string match, else math-verify.

    Bounded time (see the module doc): over-deep or over-large answers are decided without evaluation, and the
    symbolic check gives up after `timeout_s` seconds (None: no limit) with False and a logged warning."""
    verdict = _quick_verdict(pred, reference)
    if isinstance(verdict, bool):
        return verdict
    return _symbolic_verdict(pred, [verdict], timeout_s)


def _quick_verdict(pred: str, reference: str) -> bool | tuple[str, str]:
    """The verdict where string rules decide it, else the normalised (pred, reference) for the symbolic check."""
    if len(pred) > MAX_ANSWER_CHARS:
        return pred.strip() == reference.strip()  # no reference is this long; skip all heavier work
    p = normalize_answer(pred)
    r = normalize_answer(reference)
    if not p or not r:
        return False
    if _string_key(p) == _string_key(r):
        return True
    if _is_text_answer(r):
        return _string_key(p).lower() == _string_key(r).lower()
    # Exact fast path for plain numbers (most RL answers): saves the ~15 ms LaTeX parse per answer.  Unequal
    # non-integers still go to math-verify, which accepts answers rounded to 6 decimals.
    pv, rv = _as_exact_number(p), _as_exact_number(r)
    if pv is not None and rv is not None:
        if pv == rv:
            return True
        if pv.denominator == 1 and rv.denominator == 1:
            return False
    pb, rb = _BASE_RE.match(p), _BASE_RE.match(r)
    if pb is not None and rb is not None:  # numbers in an explicit base, e.g. 52_8 (math-verify drops the base)
        return pb.group(2) == rb.group(2) and pb.group(1).lower() == rb.group(1).lower()
    if max(_sympy_budget.nesting_depth(p), _sympy_budget.nesting_depth(r)) > _sympy_budget.MAX_NESTING:
        return False  # the parser would take seconds to minutes; no real answer nests this deep
    return p, r


def _symbolic_verdict(pred: str, pairs: list[tuple[str, str]], timeout_s: float | None) -> bool:
    """Whether any normalised (pred, reference) pair is equal by math-verify, within timeout_s seconds."""
    _warm_up()
    try:
        return call_with_timeout(lambda: any(_symbolic_equal(p, r) for p, r in pairs), timeout_s)
    except DeadlineExceeded:
        _log.warning(
            "math reward: symbolic check of answer %r stopped after %s s; scored as not equivalent",
            pred[:80] + ("..." if len(pred) > 80 else ""),
            timeout_s,
        )
        return False


def _symbolic_equal(p: str, r: str) -> bool:
    """math-verify on normalised strings, never evaluating trees past the size bounds (module doc)."""
    from math_verify import verify

    gold = _parse_reference(r)
    if not gold:
        return False
    target = _mv_parse(p)
    if not target:
        return False
    if not all(_sympy_budget.within_budget(x) for x in (*gold, *target)):
        # evaluating would build astronomically large numbers: the written forms must agree (module doc)
        return _same_tree(gold[0], target[0])
    if not verify(list(gold), target, timeout_seconds=None):
        # math-verify misses some equal numbers (e.g. an unevaluated `1/2 + 3*4` against 12.5)
        return _exactly_equal_numbers(gold[0], target[0])
    # math-verify compares `(a - b).evalf(chop=True) == 0`, and chop zeroes any tiny difference, so it calls
    # 2^{-98} == 2^{-99} and 4.6e-24 == 4.6e-25 (Minerva's physics answers live at such scales): veto those.
    rel = _relative_difference(gold[0], target[0])
    return rel is None or rel <= 1e-5


def _exactly_equal_numbers(gold, target) -> bool:
    """Both SymPy scalar numbers and (gold - target) evaluates to exactly zero (no tolerance: 2^{100} - 2 and
    2^{100} - 3 differ).  Works on SymPy objects, never strings."""
    import sympy

    try:
        if not (isinstance(gold, sympy.Expr) and isinstance(target, sympy.Expr)):
            return False
        if not (gold.is_number and target.is_number):
            return False
        return bool((gold - target).doit().is_zero)
    except Exception:  # noqa: BLE001 - not comparable: not equal
        return False


def _relative_difference(gold, target) -> float | None:
    """|a - b| / max(|a|, |b|) for two SymPy scalar numbers (0.0 if both are 0), None if either is not a
    finite number.  Evaluates the SymPy objects math-verify already built (no string evaluation)."""
    import sympy

    try:
        if not (isinstance(gold, sympy.Expr) and isinstance(target, sympy.Expr)):
            return None
        if not (gold.is_number and target.is_number):
            return None
        a = complex(sympy.N(gold, 30))
        b = complex(sympy.N(target, 30))
        d = complex(sympy.N(gold - target, 30))  # evalf of the difference: no cancellation error
    except Exception:  # noqa: BLE001 - not a plain number
        return None
    scale = max(abs(a), abs(b))
    if scale != scale or scale == float("inf") or abs(d) != abs(d):
        return None
    return 0.0 if scale == 0.0 else abs(d) / scale


def score(
    response_text: str, reference_answer: str | Sequence[str], *, timeout_s: float | None = DEFAULT_TIMEOUT_S
) -> float:
    """1.0 if the final answer of `response_text` is equivalent to the reference (or any of a list of
    acceptable references), else 0.0.

    Safe and bounded on untrusted text, in any thread: nothing is evaluated as Python, huge or deeply nested
    answers are decided without evaluation, and the symbolic check (all references together) stops after
    `timeout_s` seconds with 0.0 and a logged warning (None: no limit, for callers that own the timeout, such as
    RewardPool's workers).  The first call in a process also loads math-verify (~1 s, outside the limit)."""
    if not isinstance(response_text, str):
        raise ValueError(f"score: response_text must be str, got {type(response_text).__name__}")
    refs = [reference_answer] if isinstance(reference_answer, str) else list(reference_answer)
    if not refs or not all(isinstance(r, str) for r in refs):
        raise ValueError(f"score: reference_answer must be a str or a non-empty list of str, got {reference_answer!r}")
    pred = extract_answer(response_text)
    if pred is None:
        return 0.0
    pairs = []
    for r in refs:
        verdict = _quick_verdict(pred, r)
        if verdict is True:
            return 1.0
        if verdict is not False:
            pairs.append(verdict)
    return 1.0 if pairs and _symbolic_verdict(pred, pairs, timeout_s) else 0.0


def reference_alternatives(answer: str) -> list[str]:
    """Split a reference that lists several acceptable forms (Minerva's rows such as '0.01\\n, 0.02\\n' or
    '-\\frac{1}{3}\\n, -1/3\\n') into its alternatives.  Only answers containing a newline are split (that is
    how the joined lists are recognisable); commas inside brackets are not split points.  Single answers are
    returned as [answer.strip()]."""
    whole = answer.strip()
    if "\n" not in answer:
        return [whole]
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(answer):
        if ch in "({[":
            depth += 1
        elif ch in ")}]":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(answer[start:i])
            start = i + 1
    parts.append(answer[start:])
    alts = []
    for p in parts:
        p = p.strip()
        if p and p not in alts:
            alts.append(p)
    if whole not in alts:
        alts.append(whole)
    return alts
