"""Math reward: extraction, normalisation, equivalence (labelled cases from real benchmark answers),
reward modes, DAPO overlong penalty, linear-time behaviour on hostile text, no Python evaluation."""

import importlib.util
import json
import pathlib
import time

import numpy as np
import pytest

from stare_jax.eval.benchmarks import load_benchmark
from stare_jax.rewards.math import (
    MAX_ANSWER_CHARS,
    extract_answer,
    is_equivalent,
    normalize_answer,
    overlong_penalty,
    reference_alternatives,
    reward_from_correct,
    score,
)

DATA = pathlib.Path(__file__).resolve().parents[2] / "data"
CASES_PATH = DATA / "reward_cases.jsonl"


def _cases():
    with CASES_PATH.open() as f:
        return [json.loads(line) for line in f]


# ------------------------------------------------------------------------------------------- labelled set
def test_labelled_cases_are_many_and_balanced():
    cases = _cases()
    assert len(cases) >= 200
    kinds = {c["kind"] for c in cases}
    n_pos = sum(c["verdict"] for c in cases)
    assert 0.3 < n_pos / len(cases) < 0.7
    for must in [
        "frac_slash",
        "frac_decimal",
        "frac_dfrac",
        "radical_merge",
        "list_reordered",
        "tuple_swapped",
        "interval_open_closed",
        "interval_endpoint",
        "text_plain",
        "units",
        "percent",
        "thousands_sep",
        "int_off_by_one",
        "int_wrong_sign",
        "tuple_left_right",
        "degrees_plain",
    ]:
        assert must in kinds, must


def test_labelled_cases_generator_is_reproducible(shared_data_dir):
    spec = importlib.util.spec_from_file_location("make_reward_cases", DATA / "make_reward_cases.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    regenerated = mod.main(shared_data_dir / "math")
    assert regenerated == _cases()


def test_labelled_cases_all_agree():
    wrong = []
    for c in _cases():
        got = score(c["response"], c["reference"])
        if got != float(c["verdict"]):
            wrong.append((c["kind"], c["response"][-60:], c["reference"], got))
    assert not wrong, f"{len(wrong)} disagreements, e.g. {wrong[:5]}"


def _self_match_failures(shared_data_dir, stride):
    failures = []
    for name in ["aime24", "aime25", "amc23", "math500", "minerva", "olympiadbench"]:
        for row in load_benchmark(shared_data_dir / "math" / f"{name}.jsonl")[::stride]:
            for alt in row["answers"]:
                if score(f"So the answer is $\\boxed{{{alt}}}$.", row["answers"]) != 1.0:
                    failures.append((name, alt))
    return failures


def test_benchmark_answers_match_themselves_boxed(shared_data_dir):
    """Each reference (and each listed alternative) boxed in a sentence scores 1 against the row's answers
    (every 3rd row of each eval benchmark; all rows under --runslow)."""
    failures = _self_match_failures(shared_data_dir, stride=3)
    assert not failures, failures[:10]


@pytest.mark.slow
def test_all_benchmark_answers_match_themselves_boxed(shared_data_dir):
    failures = _self_match_failures(shared_data_dir, stride=1)
    assert not failures, failures[:10]


# ------------------------------------------------------------------------------------------- extraction
@pytest.mark.parametrize(
    "text, expected",
    [
        ("so \\boxed{42}.", "42"),
        ("\\boxed{1} then \\boxed{2}", "2"),
        ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{1}{\\sqrt{2}}"),
        ("\\boxed{\\{1, 2\\}}", "\\{1, 2\\}"),
        ("\\boxed{{{x}}}", "{{x}}"),
        ("\\boxed{\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}"),
        ("the answer is \\boxed 5", "5"),
        ("$\\boxed 17$ is it", "17"),
        ("\\fbox{7}", "7"),
        ("\\boxed {3}", "3"),
        ("\\boxed{2} and a broken \\boxed{3", "2"),
        ("Final Answer: 12", "12"),
        ("Final Answer: The final answer is $\\frac{3}{4}$. I hope it is correct.", "\\frac{3}{4}"),
        ("blah\nThe final answer is 8.\nmore text", "8"),
        ("The answer is $x = 3$.", "x = 3"),
        ("**Final Answer**\n\n42\n", "42"),
        ("**Final Answer:** $\\frac{1}{2}$", "\\frac{1}{2}"),
        ("The final answer is: 7", "7"),
        ("Final answer\n\\[ \\boxed{9} \\]", "9"),
        ("The final answer is", None),
        ("<think>maybe \\boxed{1}</think>\n\\boxed{2}", "2"),
        ("<think>maybe \\boxed{1}</think>\n\n  14  ", "14"),
        ("<think>maybe \\boxed{1}</think>\n", None),
        ("no answer here", None),
        ("", None),
        ("\\boxed{}", None),
        ("\\boxed{" + "{" * 50, None),
        ("\\boxedfoo{3}", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


def test_extract_answer_rejects_non_str():
    with pytest.raises(ValueError, match="text must be str"):
        extract_answer(None)


@pytest.mark.parametrize(
    "raw, expected",
    [
        ("\\dfrac{1}{2}", "\\frac{1}{2}"),
        ("\\tfrac12", "\\frac{1}{2}"),
        ("\\left( 1, 2 \\right)", "( 1, 2 )"),
        ("5\\text{ cm}", "5"),
        ("10 inches", "10"),
        ("\\text{Evelyn}", "Evelyn"),
        ("\\text{(C)}", "C"),
        ("50\\%", "50"),
        ("2,220", "2220"),
        ("10,\\!080", "10080"),
        ("1,-2", "1,-2"),
        ("90^\\circ", "90"),
        ("\\$32", "32"),
        ("7.", "7"),
        ("x = 5", "5"),
        ("f(x)=2x", "2x"),
        ("a=1, b=2", "a=1, b=2"),
        ("025", "25"),
        ("11\\sqrt2", "11\\sqrt{2}"),
        ("$\\frac{25}{2}$", "\\frac{25}{2}"),
        ("4.4e7", "4.4 \\times 10^{7}"),
        ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}"),
    ],
)
def test_normalize_answer(raw, expected):
    assert normalize_answer(raw) == expected


def test_is_equivalent_is_not_fooled_by_anagrams_or_prefixes():
    assert not is_equivalent("Levyen", "\\text{Evelyn}")
    assert not is_equivalent("12", "123")
    assert is_equivalent("\\frac{\\sqrt{3}}{2}", "\\frac{1}{2}\\sqrt{3}")


def test_score_accepts_alternatives_and_validates():
    assert score("\\boxed{-1/3}", ["-\\frac{1}{3}", "-1/3"]) == 1.0
    assert score("\\boxed{1/3}", ["-\\frac{1}{3}", "-1/3"]) == 0.0
    with pytest.raises(ValueError, match="reference_answer"):
        score("\\boxed{1}", [])
    with pytest.raises(ValueError, match="response_text"):
        score(3, "3")


def test_reference_alternatives():
    assert reference_alternatives("0.01\n, 0.02\n") == ["0.01", "0.02", "0.01\n, 0.02"]
    assert reference_alternatives("(1, 2)\n") == ["(1, 2)"]
    assert reference_alternatives("1,-2") == ["1,-2"]
    assert reference_alternatives("\\frac{a}{b}\n, \\frac{a}{b}") == ["\\frac{a}{b}", "\\frac{a}{b}\n, \\frac{a}{b}"]


# ------------------------------------------------------------------------------------------- reward modes
def test_reward_modes():
    assert [reward_from_correct(c, "binary") for c in (1.0, 0.0)] == [1.0, 0.0]
    assert [reward_from_correct(c, "signed") for c in (1.0, 0.0)] == [1.0, -1.0]
    np.testing.assert_array_equal(reward_from_correct(np.array([1.0, 0.0, 1.0]), "signed"), [1.0, -1.0, 1.0])
    assert isinstance(reward_from_correct(1.0), float)
    with pytest.raises(ValueError, match="mode"):
        reward_from_correct(1.0, "dapo")
    with pytest.raises(ValueError, match="finite"):
        reward_from_correct(np.nan)


def _train_rewards_reference(correct, lengths, mode, max_len, buf, factor):
    """The formula train.py used before rewards.rollout_rewards held the one implementation."""
    r = correct if mode == "binary" else 2.0 * correct - 1.0
    if buf > 0:
        r = r + np.asarray(overlong_penalty(lengths, max_len, buf, factor), np.float32)
    return r.astype(np.float32)


@pytest.mark.parametrize("mode, buf", [("binary", 0), ("signed", 0), ("binary", 8), ("signed", 8)])
def test_rollout_rewards_is_the_training_formula_bit_for_bit(mode, buf):
    from stare_jax.rewards import rollout_rewards

    rng = np.random.default_rng(0)
    correct = (rng.random((5, 4)) < 0.5).astype(np.float32)
    lengths = rng.integers(0, 40, size=(5, 4))
    got = rollout_rewards(correct, lengths, mode=mode, max_length=32, overlong_buffer=buf, overlong_penalty_factor=0.7)
    assert got.dtype == np.float32 and got.shape == (5, 4)
    np.testing.assert_array_equal(got, _train_rewards_reference(correct, lengths, mode, 32, buf, 0.7))


def _overlong_reference(L, max_len, buf, factor):
    expected = max_len - buf
    if L <= expected:
        return 0.0
    if L <= max_len:
        return (expected - L) / buf * factor
    return -1.0 * factor


def test_overlong_penalty_matches_piecewise_definition():
    max_len, buf, factor = 20480, 4096, 1.0
    lengths = np.array([0, 100, 16384, 16385, 18432, 20479, 20480, 20481, 50000])
    got = overlong_penalty(lengths, max_len, buf, factor)
    want = np.array([_overlong_reference(int(L), max_len, buf, factor) for L in lengths])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-12)
    assert got[0] == 0.0 and got[-1] == -1.0 and got[4] == pytest.approx(-0.5)
    assert overlong_penalty(18432, max_len, buf, 0.5) == pytest.approx(-0.25)
    assert isinstance(overlong_penalty(5, 10, 4), float)


@pytest.mark.parametrize("args", [(10, 10, 11), (10, 0, 4), (10, 10, 0)])
def test_overlong_penalty_rejects_bad_config(args):
    L, max_len, buf = args
    with pytest.raises(ValueError):
        overlong_penalty(L, max_len, buf)
    with pytest.raises(ValueError, match="penalty_factor"):
        overlong_penalty(1, 10, 4, -1.0)
    with pytest.raises(ValueError, match="negative"):
        overlong_penalty([-1], 10, 4)


# ------------------------------------------------------------------------------------------- hostile text
@pytest.mark.parametrize(
    "text",
    [
        "x" * 1_000_000,
        "\\boxed{" + "{" * 10_000 + "1" + "}" * 10_000 + "}",
        "\\boxed{" + "{" * 100_000,
        "\\boxed{" * 100_000,
        "Final Answer:" + " " * 1_000_000 + "x",
        "The final answer is " + "\\text{" * 50_000,
        "<think>" + "(" * 500_000 + "</think>" + " " * 500_000,
        "\\boxed{" + "1" * 1_000_000 + "}",
    ],
)
def test_hostile_text_is_linear_time_and_scores_zero(text):
    t0 = time.perf_counter()
    extract_answer(text)
    normalize_answer(text)
    assert score(text, "1") == 0.0
    assert time.perf_counter() - t0 < 4.0


def test_long_answers_skip_the_symbolic_checker():
    long_ans = "1+" * (MAX_ANSWER_CHARS // 2) + "1"
    assert not is_equivalent(long_ans, str(MAX_ANSWER_CHARS // 2 + 1))


def test_model_output_is_never_evaluated_as_python(tmp_path, monkeypatch):
    """Payloads do nothing.  math-verify's eval-based expression extractor (parse_expr on raw text) is never
    reached, and the only strings SymPy ever evaluates are numeric literals (latex2sympy turns NUMBER tokens
    into sympy.Number(text)) and plain-letter Symbol names (SymPy's own units tables)."""
    import re

    import math_verify.parser
    import sympy.parsing.sympy_parser as sympy_parser

    raw_parse_calls = []
    monkeypatch.setattr(math_verify.parser, "parse_expr", lambda *a, **k: raw_parse_calls.append(a))
    evaluated = []
    real_eval_expr = sympy_parser.eval_expr

    def spy_eval_expr(code, local_dict, global_dict):
        evaluated.append(code)
        return real_eval_expr(code, local_dict, global_dict)

    monkeypatch.setattr(sympy_parser, "eval_expr", spy_eval_expr)
    marker = tmp_path / "pwned"
    payloads = [
        f"\\boxed{{__import__('os').system('touch {marker}')}}",
        f"\\boxed{{import os; os.system('touch {marker}')}}",
        f"Final Answer: __import__('os').system('touch {marker}')",
        f"\\boxed{{exec(\"open('{marker}','w')\")}}",
        f"\\boxed{{eval(\"__import__('os').system('touch {marker}')\")}}",
        f"\\boxed{{\\text{{__import__('os').system('touch {marker}')}}}}",
    ]
    for p in payloads:
        assert score(p, "0") == 0.0
        assert score(p, p) in (0.0, 1.0)  # even when the reference itself is hostile
    assert score("\\boxed{1/2 + 3*4}", "12.5") == 1.0  # an expression ExprExtractionConfig would eval
    assert not marker.exists()
    assert raw_parse_calls == []
    safe = re.compile(r"^(Integer \(\d+ \)|Float \('\d*\.?\d*' \)|Symbol \('[A-Za-z]+' \))$")
    assert [c for c in evaluated if not safe.match(c)] == []


def test_score_works_off_the_main_thread():
    """math-verify's signal-based timeouts would raise in threads; ours are off (the pool owns timeouts)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as ex:
        got = list(ex.map(score, ["\\boxed{\\sqrt{18}}", "\\boxed{(1,2)}"], ["3\\sqrt{2}", "(2,1)"]))
    assert got == [1.0, 0.0]


@pytest.mark.parametrize(
    "response, reference",
    [
        ("\\boxed{3 \\text{ or } 4}", "4"),
        ("\\boxed{3, 4}", "4"),
        ("\\boxed{\\{4, 5\\}}", "4"),
        ("\\boxed{\\pm 4}", "4"),
        ("\\boxed{3 \\le x \\le 4}", "4"),
        ("\\boxed{x}", "5"),
        ("\\boxed{4.0000001}", "4"),
        ("\\boxed{1000001}", "1000000"),
        ("\\boxed{4} \\boxed{5}", "4"),
    ],
)
def test_hedged_or_multiple_answers_do_not_score(response, reference):
    """Guards against reward hacking by listing several candidates or hedging."""
    assert score(response, reference) == 0.0


@pytest.mark.parametrize(
    "response, reference, expected",
    [
        ("\\boxed{\\frac{1}{2^{99}}}", "\\frac{1}{2^{98}}", 0.0),  # math-verify alone says equal (chop=True)
        ("\\boxed{2^{-98}}", "\\frac{1}{2^{98}}", 1.0),
        ("\\boxed{4.6 \\times 10^{-25}}", "4.6 \\times 10^{-24}", 0.0),
        ("\\boxed{4.6e-24}", "4.6 \\times 10^{-24}", 1.0),
        ("\\boxed{0.333333}", "\\frac{1}{3}", 1.0),  # math-verify's 6-decimal rounding is kept
        ("\\boxed{12_6}", "12_5", 0.0),  # math-verify alone drops the base
        ("\\boxed{12}", "12_5", 1.0),
        ("\\boxed{A5_{11}}", "\\text{A5}_{11}", 1.0),
        ("\\boxed{2^{100} - 3}", "2^{100} - 2", 0.0),  # no relative tolerance for huge exact numbers
        ("\\boxed{1/2 + 3*4}", "12.6", 0.0),
        ("\\boxed{\\sqrt{2}\\cdot\\sqrt{2}}", "2", 1.0),
    ],
)
def test_tiny_magnitudes_and_bases(response, reference, expected):
    assert score(response, reference) == expected


# ------------------------------------------------------------------------------------------- bounded time
_TOWER = "10^{10^{100}}"
_BIG_DIGITS = "7" * 100_000


@pytest.fixture(scope="module")
def warm_scorer():
    """Loads math-verify / SymPy / the LaTeX grammar once (seconds on a busy machine), outside the timings."""
    score("\\boxed{\\sqrt{2}}", "2^{1/2}")


@pytest.mark.parametrize(
    "response, reference, expected",
    [
        # power towers and huge exponents: SymPy would build the exact integer in one uninterruptible C call
        ("\\boxed{9^{9^{9^{9}}}}", "1", 0.0),
        ("\\boxed{10^{10^{10^{10}}}}", "5", 0.0),
        ("\\boxed{2^{2^{2^{2^{2^{2}}}}}}", "1", 0.0),
        ("\\boxed{2^{1000000000}}", "1", 0.0),
        ("\\boxed{e^{e^{e^{100}}}}", "1", 0.0),
        ("\\boxed{\\sin(10^{10^{5}})}", "0", 0.0),
        ("\\boxed{1e100000}", "1", 0.0),
        # factorials, binomials, products of big numbers
        ("\\boxed{99999!}", "1", 0.0),
        ("\\boxed{(10^{6})!}", "(10^{6})!+1", 0.0),
        ("\\boxed{\\binom{10^{9}}{10^{5}}}", "1", 0.0),
        ("\\boxed{\\prod_{k=1}^{10^{6}} k}", "1", 0.0),
        # long digit strings, deep nesting (the parser is super-linear in nesting depth), huge expansions
        ("\\boxed{" + _BIG_DIGITS + "}", "1", 0.0),
        ("\\boxed{" + "7" * 999 + "}", "7" * 998 + "8", 0.0),
        ("\\boxed{" + "(" * 30 + "1" + ")" * 30 + "}", "1", 0.0),
        ("\\boxed{" + "{" * 30 + "1" + "}" * 30 + "}", "2", 0.0),
        ("\\boxed{" + "[" * 400 + "1" + "]" * 400 + "}", "1", 0.0),
        ("\\boxed{(a+b+c+d+e)^{12}}", "1", 0.0),
        ("\\boxed{(a+b)(c+d)(e+f)(g+h)(i+j)(k+l)(m+n)(o+p)(q+r)(s+t)}", "1", 0.0),
        # beyond the size bounds, equality is structural: the same written value, never an evaluated one
        (f"\\boxed{{{_TOWER}}}", _TOWER, 1.0),
        ("\\boxed{{10}^{10^{100}}}", _TOWER, 1.0),
        ("\\boxed{10^{ 10^{100} }}", _TOWER, 1.0),
        ("\\boxed{(10^{10})^{10^{99}}}", _TOWER, 0.0),  # equal in value, but deciding it means evaluating
        (f"\\boxed{{{_TOWER} + 1}}", _TOWER, 0.0),
        ("\\boxed{9^{9^{9}}}", "9^{387420489}", 0.0),
        ("\\boxed{9^{9^{9^{9}}}}", "9^{9^{9^{9}}}", 1.0),
        # inside the bounds, big numbers are still evaluated exactly
        ("\\boxed{2^{10}\\cdot 2^{990}}", "2^{1000}", 1.0),
        ("\\boxed{\\frac{100!}{99!}}", "100", 1.0),
        ("\\boxed{7000!}", "7000!+1", 0.0),
    ],
)
def test_adversarial_answers_are_decided_quickly(warm_scorer, response, reference, expected):
    """Direct calls (no RewardPool) on hostile answers return within seconds, decided without evaluating huge
    numbers (each took from 12 s to far beyond 120 s before the size bounds)."""
    t0 = time.perf_counter()
    assert score(response, reference) == expected
    assert time.perf_counter() - t0 < 10.0


def test_magnitude_bounds():
    from stare_jax.rewards import _sympy_budget as budget
    from stare_jax.rewards.math import _mv_parse

    def bits(latex):
        return budget.magnitude_bits(_mv_parse(latex)[0])

    assert 200 <= bits("2^{100}") <= 202
    assert bits("100!") < 1000 and bits("\\frac{2^{100}}{3^{50}}") < 320
    assert bits("9^{9^{9}}") == float("inf") and bits("99999!") == float("inf")
    assert bits("\\sum_{k=1}^{10} k^2") < 100 and bits("\\prod_{k=1}^{10^{9}} k") == float("inf")
    assert budget.expanded_terms(_mv_parse("(x+1)^{100}")[0]) == 101
    assert budget.expanded_terms(_mv_parse("(a+b+c)^{2}(x+y)")[0]) == 12
    assert budget.nesting_depth("\\frac{(1+[2])}{3}") == 3 and budget.nesting_depth("1)(") == 1


def test_benchmark_answers_are_within_the_size_bounds(shared_data_dir):
    """The bounds refuse nothing a benchmark asks for (every 7th answer of each eval benchmark)."""
    from stare_jax.rewards import _sympy_budget as budget
    from stare_jax.rewards.math import _mv_parse

    outside = []
    for name in ["aime24", "aime25", "amc23", "math500", "minerva", "olympiadbench"]:
        for row in load_benchmark(shared_data_dir / "math" / f"{name}.jsonl")[::7]:
            for alt in row["answers"]:
                norm = normalize_answer(alt)
                if budget.nesting_depth(norm) > budget.MAX_NESTING:
                    outside.append((name, alt))
                    continue
                if not all(budget.within_budget(x) for x in _mv_parse(norm)):
                    outside.append((name, alt))
    assert not outside, outside[:10]


_SLOW_INTEGRAL = "\\boxed{\\int e^{x^2}\\sin(x^3) dx}"  # passes the size bounds; SymPy's integrator runs on


def test_symbolic_check_stops_at_the_deadline_in_any_thread(warm_scorer, caplog):
    """What the size bounds cannot see (symbolic integration) is pure-Python work, cut off by the deadline, in
    the main thread and in worker threads alike; scoring works normally afterwards."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    t0 = time.perf_counter()
    with caplog.at_level("WARNING", logger="stare_jax.rewards.math"):
        assert score(_SLOW_INTEGRAL, "1", timeout_s=0.5) == 0.0
    assert time.perf_counter() - t0 < 10.0
    assert "stopped after 0.5 s" in caplog.text
    assert not is_equivalent("\\int e^{x^2}\\sin(x^3) dx", "1", timeout_s=0.5)
    with ThreadPoolExecutor(2) as ex:
        t0 = time.perf_counter()
        got = list(ex.map(lambda r: score(r, "1", timeout_s=0.5), [_SLOW_INTEGRAL, _SLOW_INTEGRAL]))
        assert got == [0.0, 0.0] and time.perf_counter() - t0 < 10.0
        assert list(ex.map(score, ["\\boxed{\\sqrt{18}}", "\\boxed{(1,2)}"], ["3\\sqrt{2}", "(2,1)"])) == [1.0, 0.0]
    assert score("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{1}{2}\\sqrt{3}") == 1.0
    deadline = time.perf_counter() + 10.0  # the overrunning helpers were stopped, not left integrating
    while any(t.name.startswith("stare_jax-timed-call") for t in threading.enumerate()):
        assert time.perf_counter() < deadline, [t.name for t in threading.enumerate()]
        time.sleep(0.05)


def test_call_with_timeout_returns_on_time_and_stops_the_overrunning_helper():
    import threading

    from stare_jax.rewards._deadline import DeadlineExceeded, call_with_timeout

    stopped = threading.Event()

    def spin():  # code of this package (stoppable) that swallows ordinary exceptions, like library code does
        try:
            while True:
                try:
                    sum(range(1000))
                except Exception:  # noqa: BLE001
                    pass
        except BaseException:
            stopped.set()
            raise

    t0 = time.perf_counter()
    with pytest.raises(DeadlineExceeded):
        call_with_timeout(spin, 0.2, stoppable=(__file__,))
    assert time.perf_counter() - t0 < 5.0
    assert stopped.wait(5.0)  # and the helper was stopped, although it swallows ordinary exceptions
    assert call_with_timeout(lambda: 3, 1.0) == 3 and call_with_timeout(lambda: 4, None) == 4
    with pytest.raises(ZeroDivisionError):
        call_with_timeout(lambda: 1 / 0, 1.0)
    for _ in range(100):  # finished in time: nothing is ever raised afterwards in any thread
        assert call_with_timeout(lambda: sum(range(100)), 5.0) == 4950
    with pytest.raises(ValueError, match="timeout_s"):
        call_with_timeout(lambda: 0, 0.0)
