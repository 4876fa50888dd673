"""Build tests/data/reward_cases.jsonl: labelled (response, reference, verdict) cases for the math reward.

Every case starts from a real reference answer of the benchmark files in ../shared/data/math and either
rewrites it into an equivalent form (verdict 1: fractions <-> decimals, \\dfrac, spacing, \\left( \\right),
reordered sets, 3\\sqrt{2} <-> \\sqrt{18}, \\text{} wrappers, units, percentages, thousands separators, degrees,
'x =' prefixes, answer formats such as 'Final Answer:' and </think> tails) or into a near miss (verdict 0:
off by one, wrong sign, swapped tuple order, changed interval endpoint or open/closed end, inverted fraction,
conjugate, a wrong later \\boxed, an answer only inside the thinking block).  The labels follow from the
construction (mathematics), never from running the scorer.  Grading policy encoded here: percentages and
units are dropped (25\\% and 25 cm both match 25), a base subscript may be dropped (52 matches 52_8), and a
decimal rounded past the 6th decimal place matches (math-verify's float rounding); nothing else is lenient.

Deterministic: `python tests/data/make_reward_cases.py [DATA_DIR]` rewrites the file byte-identically.
"""

from __future__ import annotations

import json
import pathlib
import re
import sys
from fractions import Fraction

HERE = pathlib.Path(__file__).resolve().parent
DEFAULT_DATA = HERE.parents[2] / "shared" / "data" / "math"
OUT = HERE / "reward_cases.jsonl"

WRAPS_POS = [
    "The answer is therefore $\\boxed{{{a}}}$.",
    "Putting it together, the result is \\boxed{{{a}}}",
    "Final Answer: The final answer is ${a}$. I hope it is correct.",
    "<think>\nLet me compute. Maybe it is \\boxed{{0}}? No.\n</think>\nThe answer is \\boxed{{{a}}}.",
    "We get \\fbox{{{a}}} as the final result.",
]


def load(data_dir: pathlib.Path, name: str) -> list[dict]:
    with (data_dir / name).open() as f:
        return [json.loads(line) for line in f if line.strip()]


def exact_decimal(v: Fraction) -> str:
    """The exact decimal expansion of a fraction whose denominator has only the prime factors 2 and 5."""
    sign = "-" if v < 0 else ""
    v = abs(v)
    k = 0
    while (v * 10**k).denominator != 1:
        k += 1
    digits = str((v * 10**k).numerator).rjust(k + 1, "0")
    return sign + (digits[:-k] + "." + digits[-k:] if k else digits)


def wrap(ans: str, k: int) -> str:
    return WRAPS_POS[k % len(WRAPS_POS)].format(a=ans)


def main(data_dir: pathlib.Path) -> list[dict]:
    cases: list[dict] = []

    def add(kind: str, src: str, response: str, reference: str, verdict: int) -> None:
        cases.append(dict(kind=kind, source=src, response=response, reference=reference, verdict=verdict))

    aime = load(data_dir, "aime24.jsonl") + load(data_dir, "aime25.jsonl") + load(data_dir, "amc23.jsonl")
    math500 = load(data_dir, "math500.jsonl")
    gsm = load(data_dir, "gsm8k_test.jsonl")
    olymp = load(data_dir, "olympiadbench.jsonl")
    minerva = load(data_dir, "minerva.jsonl")

    # ---- integers (AIME/AMC): answer formats, leading zeros, off by one, wrong sign
    for j, r in enumerate(aime[:40]):
        a, n = r["answer"], int(r["answer"])
        add("int_format", r["id"], wrap(str(n), j), a, 1)
        if j % 4 == 0:
            add("int_leading_zero", r["id"], f"\\boxed{{{n:03d}}}", a, 1)
        if j % 4 == 1:
            add("int_x_prefix", r["id"], f"Thus \\boxed{{x = {n}}}.", a, 1)
        if j % 4 == 2:
            add("int_text_wrap", r["id"], f"\\boxed{{\\text{{{n}}}}}", a, 1)
        add("int_off_by_one", r["id"], wrap(str(n + 1 if j % 2 else n - 1), j), a, 0)
        if n != 0 and j % 2 == 0:
            add("int_wrong_sign", r["id"], f"\\boxed{{{-n}}}", a, 0)
        if j % 5 == 0:
            add("int_later_box_wrong", r["id"], f"First \\boxed{{{n}}}, but wait, actually \\boxed{{{n + 2}}}.", a, 0)
        if j % 5 == 1:
            add("int_only_in_think", r["id"], f"<think>so \\boxed{{{n}}}</think>\nI am not sure.", a, 0)

    # ---- GSM8K: thousands separators, dollars, units, percentages, decimals .0
    big = [r for r in gsm if re.fullmatch(r"\d{4,7}", r["answer"])][:20]
    for j, r in enumerate(big):
        n = int(r["answer"])
        add("thousands_sep", r["id"], f"\\boxed{{{n:,}}}", r["answer"], 1)
        if j % 2 == 0:
            add("thousands_latex", r["id"], "\\boxed{" + f"{n:,}".replace(",", "{,}") + "}", r["answer"], 1)
        add("thousands_off", r["id"], f"\\boxed{{{n + 1000:,}}}", r["answer"], 0)
    small = [r for r in gsm if re.fullmatch(r"[1-9]\d{0,2}", r["answer"])][:30]
    units = ["\\text{ dollars}", " dollars", "\\text{ cm}", " inches", "\\text{ minutes}", " hours"]
    for j, r in enumerate(small):
        n = int(r["answer"])
        if j % 3 == 0:
            add("dollars", r["id"], f"She makes \\boxed{{\\${n}}} every day.", r["answer"], 1)
        elif j % 3 == 1:
            add("units", r["id"], f"\\boxed{{{n}{units[j % len(units)]}}}", r["answer"], 1)
        else:
            add("percent", r["id"], f"\\boxed{{{n}\\%}}", r["answer"], 1)
        if j % 2 == 0:
            add("decimal_point_zero", r["id"], f"\\boxed{{{n}.0}}", r["answer"], 1)
        add("units_wrong_number", r["id"], f"\\boxed{{{n + 3}\\text{{ dollars}}}}", r["answer"], 0)

    # ---- fractions (MATH-500): a/b, \dfrac, \tfrac, decimals, inverted, numerator off by one
    fr = [r for r in math500 if re.fullmatch(r"-?\\[dt]?frac\{\d+\}\{\d+\}", r["answer"])]
    for j, r in enumerate(fr[:30]):
        m = re.fullmatch(r"(-?)\\[dt]?frac\{(\d+)\}\{(\d+)\}", r["answer"])
        sign, p, q = m.group(1), int(m.group(2)), int(m.group(3))
        add("frac_slash", r["id"], f"\\boxed{{{sign}{p}/{q}}}", r["answer"], 1)
        add("frac_dfrac", r["id"], f"\\boxed{{{sign}\\dfrac{{{p}}}{{{q}}}}}", r["answer"], 1)
        if j % 3 == 0:
            add("frac_tfrac_spaces", r["id"], f"\\boxed{{ {sign}\\tfrac{{ {p} }}{{ {q} }} }}", r["answer"], 1)
        val = Fraction(p, q) * (-1 if sign else 1)
        # terminating decimals only (denominator of the reduced fraction has only factors 2 and 5)
        den = Fraction(p, q).denominator
        while den % 2 == 0:
            den //= 2
        while den % 5 == 0:
            den //= 5
        if den == 1:
            add("frac_decimal", r["id"], f"\\boxed{{{exact_decimal(val)}}}", r["answer"], 1)
            if len(exact_decimal(val).partition(".")[2]) <= 6:  # past 6 decimals, rounding is accepted
                add("frac_decimal_truncated", r["id"], f"\\boxed{{{exact_decimal(val)[:-1]}}}", r["answer"], 0)
        if p != q:
            add("frac_inverted", r["id"], f"\\boxed{{{sign}\\frac{{{q}}}{{{p}}}}}", r["answer"], 0)
        add("frac_num_off", r["id"], f"\\boxed{{{sign}\\frac{{{p + 1}}}{{{q}}}}}", r["answer"], 0)
        if j % 2 == 0:
            flip = "" if sign else "-"
            add("frac_wrong_sign", r["id"], f"\\boxed{{{flip}\\frac{{{p}}}{{{q}}}}}", r["answer"], 0)

    # ---- radicals: k\sqrt{m} <-> \sqrt{k^2 m}
    rad = [r for r in math500 if re.fullmatch(r"(\d*)\\sqrt\{?(\d+)\}?", r["answer"])]
    for r in rad:
        m = re.fullmatch(r"(\d*)\\sqrt\{?(\d+)\}?", r["answer"])
        k, s = int(m.group(1) or 1), int(m.group(2))
        add("radical_merge", r["id"], f"\\boxed{{\\sqrt{{{k * k * s}}}}}", r["answer"], 1)
        add("radical_power", r["id"], f"\\boxed{{{k}\\cdot {s}^{{1/2}}}}", r["answer"], 1)
        add("radical_off", r["id"], f"\\boxed{{\\sqrt{{{k * k * s + 1}}}}}", r["answer"], 0)
        add("radical_drop_coeff", r["id"], f"\\boxed{{{k + 1}\\sqrt{{{s}}}}}", r["answer"], 0)

    # ---- tuples (MATH-500 points / ordered tuples): \left( \right), spaces; swapped order; one entry changed
    tup = [r for r in math500 if re.fullmatch(r"\((-?\d+)(,-?\d+)+\)", r["answer"].replace(" ", ""))]
    for r in tup:
        items = r["answer"].replace(" ", "")[1:-1].split(",")
        add("tuple_left_right", r["id"], "\\boxed{\\left( " + ", ".join(items) + " \\right)}", r["answer"], 1)
        if items[0] != items[1]:
            sw = [items[1], items[0]] + items[2:]
            add("tuple_swapped", r["id"], "\\boxed{(" + ",".join(sw) + ")}", r["answer"], 0)
        ch = [str(int(items[0]) + 1)] + items[1:]
        add("tuple_entry_off", r["id"], "\\boxed{(" + ", ".join(ch) + ")}", r["answer"], 0)
    polar = next(r for r in math500 if r["answer"] == "\\left( 3, \\frac{\\pi}{2} \\right)")
    add("tuple_pi", polar["id"], "\\boxed{(3, \\pi/2)}", polar["answer"], 1)
    add("tuple_pi_swapped", polar["id"], "\\boxed{\\left(\\frac{\\pi}{2}, 3\\right)}", polar["answer"], 0)

    # ---- lists of solutions: reordered (sets), one missing, one wrong
    for ans in ["1,-2", "3, 5, 7", "-2,1"]:
        r = next(x for x in math500 if x["answer"] == ans)
        items = [t.strip() for t in ans.split(",")]
        add("list_reordered", r["id"], "\\boxed{" + ", ".join(reversed(items)) + "}", ans, 1)
        add("list_as_set", r["id"], "\\boxed{\\{" + ", ".join(items) + "\\}}", ans, 1)
        add("list_missing", r["id"], "\\boxed{" + ", ".join(items[:-1]) + "}", ans, 0)
        add("list_wrong_item", r["id"], "\\boxed{" + ", ".join(items[:-1] + [str(int(items[-1]) + 1)]) + "}", ans, 0)
    tri = next(x for x in olymp if x["answer"] == "$(1,8,19), (2,7,13), (4,5,7)$")
    add("set_of_tuples_reordered", tri["id"], "\\boxed{(4,5,7), (1,8,19), (2,7,13)}", tri["answer"], 1)
    add("set_of_tuples_swapped", tri["id"], "\\boxed{(1,8,19), (2,7,13), (5,4,7)}", tri["answer"], 0)

    # ---- intervals: spacing/\left; endpoint open<->closed; endpoint changed
    for ans in [
        "(2,\\infty)",
        "(-\\infty, 0]",
        "(5,\\infty)",
        "(-\\infty, 2) \\cup (3, \\infty)",
        "(3,4]",
        "(0,9) \\cup (9,36)",
    ]:
        r = next(x for x in math500 if x["answer"] == ans)
        add(
            "interval_spacing",
            r["id"],
            "\\boxed{\\left" + ans.replace(" ", "")[0] + " " + ans.replace(" ", "")[1:-1] + " \\right" + ans[-1] + "}",
            ans,
            1,
        )
        if ans.endswith("]"):
            add("interval_open_closed", r["id"], "\\boxed{" + ans[:-1] + ")}", ans, 0)
        elif ans.startswith("(-\\infty"):  # [-oo is no different from (-oo: change the finite end instead
            add("interval_open_closed", r["id"], "\\boxed{" + ans.replace(")", "]", 1) + "}", ans, 0)
        else:
            add("interval_open_closed", r["id"], "\\boxed{[" + ans[1:] + "}", ans, 0)
        nums = re.findall(r"-?\d+", ans)
        add("interval_endpoint", r["id"], "\\boxed{" + ans.replace(nums[0], str(int(nums[0]) + 1), 1) + "}", ans, 0)

    # ---- complex numbers: reordered terms; conjugate
    for r in [x for x in math500 if re.fullmatch(r"-?\d+ ?[+-] ?\d+i", x["answer"])]:
        m = re.fullmatch(r"(-?\d+) ?([+-]) ?(\d+)i", r["answer"])
        a, op, b = m.groups()
        add(
            "complex_reordered",
            r["id"],
            f"\\boxed{{{op}{b}i + {a}}}".replace("+-", "-").replace("{+", "{"),
            r["answer"],
            1,
        )
        conj = "-" if op == "+" else "+"
        add("complex_conjugate", r["id"], f"\\boxed{{{a}{conj}{b}i}}", r["answer"], 0)

    # ---- degrees: with/without ^\circ; off by one
    for r in [x for x in math500 if re.fullmatch(r"\d+\^\\circ", x["answer"])]:
        n = int(r["answer"].split("^")[0])
        add("degrees_plain", r["id"], f"\\boxed{{{n}}}", r["answer"], 1)
        add("degrees_braced", r["id"], f"\\boxed{{{n}^{{\\circ}}}}", r["answer"], 1)
        add("degrees_off", r["id"], f"\\boxed{{{n + 1}^\\circ}}", r["answer"], 0)

    # ---- words / choices
    for ans, wrong in [
        ("\\text{Evelyn}", "Navin"),
        ("\\text{east}", "west"),
        ("\\text{even}", "odd"),
        ("\\text{ellipse}", "parabola"),
        ("\\text{Navin}", "Evelyn"),
        ("\\text{(C)}", "(D)"),
        ("\\text{(E)}", "(B)"),
        ("\\text{(B)}", "(A)"),
    ]:
        r = next(x for x in math500 if x["answer"] == ans)
        word = ans[len("\\text{") : -1]
        add("text_plain", r["id"], f"The answer is \\boxed{{{word}}}.", ans, 1)
        add("text_case", r["id"], f"\\boxed{{\\text{{{word.upper()}}}}}", ans, 1)
        add("text_wrong", r["id"], f"\\boxed{{\\text{{{wrong}}}}}", ans, 0)
    ev = next(x for x in math500 if x["answer"] == "\\text{Evelyn}")
    add("text_anagram", ev["id"], "\\boxed{Evenly}", ev["answer"], 0)

    # ---- expressions and matrices
    pq = next(x for x in math500 if x["answer"] == "p - q")
    add("expr_reordered", pq["id"], "\\boxed{-q + p}", pq["answer"], 1)
    add("expr_wrong", pq["id"], "\\boxed{q - p}", pq["answer"], 0)
    for r in [x for x in math500 if "pmatrix" in x["answer"]][:5]:
        compact = r["answer"].replace(" ", "")
        add("matrix_spacing", r["id"], f"\\boxed{{{compact}}}", r["answer"], 1)
        entries = re.findall(r"-?\d+", compact)
        wrong = compact.replace(entries[0], str(int(entries[0]) + 1), 1)
        add("matrix_entry_off", r["id"], f"\\boxed{{{wrong}}}", r["answer"], 0)
    x5 = next(x for x in math500 if x["answer"] == "x=5")
    add("equation_value", x5["id"], "\\boxed{5}", x5["answer"], 1)
    add("equation_wrong", x5["id"], "\\boxed{x=6}", x5["answer"], 0)

    # ---- OlympiadBench $...$ references, Minerva scientific notation and alternatives
    for r in [x for x in olymp if re.fullmatch(r"\$\\frac\{(\d+)\}\{(\d+)\}\$", x["answer"])][:6]:
        p, q = map(int, re.fullmatch(r"\$\\frac\{(\d+)\}\{(\d+)\}\$", r["answer"]).groups())
        add("olymp_frac_slash", r["id"], f"\\boxed{{{p}/{q}}}", r["answer"], 1)
        add("olymp_frac_off", r["id"], f"\\boxed{{{p}/{q + 1}}}", r["answer"], 0)
    for r in [x for x in minerva if re.fullmatch(r"\d+(\.\d+)? \\times 10\^\{?-?\d+\}?\n?", x["answer"])][:8]:
        m = re.fullmatch(r"(\d+(?:\.\d+)?) \\times 10\^\{?(-?\d+)\}?\n?", r["answer"])
        mant, ex = m.groups()
        add("sci_e_notation", r["id"], f"\\boxed{{{mant}e{ex}}}", r["answer"], 1)
        add("sci_wrong_exponent", r["id"], f"\\boxed{{{mant} \\times 10^{{{int(ex) + 1}}}}}", r["answer"], 0)
    for r in [x for x in minerva if re.fullmatch(r"\d+(\.\d+)? \\times 10\^\{-\d+\}\n?", x["answer"])][:6]:
        mant, ex = re.fullmatch(r"(\d+(?:\.\d+)?) \\times 10\^\{(-\d+)\}\n?", r["answer"]).groups()
        add("sci_tiny_e_notation", r["id"], f"\\boxed{{{mant}e{ex}}}", r["answer"], 1)
        add("sci_tiny_wrong_exponent", r["id"], f"\\boxed{{{mant} \\times 10^{{{int(ex) - 1}}}}}", r["answer"], 0)

    # ---- numbers written in a base (MATH-500): base dropped is accepted, a different base is not
    for r in [x for x in math500 if re.fullmatch(r"\d+_\{?\d+\}?", x["answer"])]:
        digits, base = re.fullmatch(r"(\d+)_\{?(\d+)\}?", r["answer"]).groups()
        add("base_braced", r["id"], f"\\boxed{{{digits}_{{{base}}}}}", r["answer"], 1)
        add("base_wrong", r["id"], f"\\boxed{{{digits}_{{{int(base) + 1}}}}}", r["answer"], 0)
    return cases


if __name__ == "__main__":
    data_dir = pathlib.Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_DATA
    cases = main(data_dir)
    with OUT.open("w") as f:
        for c in cases:
            f.write(json.dumps(c, sort_keys=True) + "\n")
    n_pos = sum(c["verdict"] for c in cases)
    print(f"wrote {len(cases)} cases ({n_pos} equivalent, {len(cases) - n_pos} near misses) to {OUT}")
