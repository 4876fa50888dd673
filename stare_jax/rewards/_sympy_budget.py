"""Static size bounds on answers before SymPy evaluates them: what keeps `rewards.math.score` fast on any input.

Where the time goes on hostile answers (measured, see tests/unit/rewards/test_math.py):
- latex2sympy (via math-verify's `parse`) builds SymPy trees *unevaluated*: parsing `9^{9^{9^{9}}}` takes
  milliseconds.  The explosion comes later, when math-verify's `verify` (doit / simplify / evalf) or our exact
  checks evaluate the tree: SymPy (no gmpy2 here) computes 9^(9^9) as an exact ~370-million-digit integer in
  one uninterruptible C call, then tries 9 to that power.  `2^{10^9}` alone takes ~12 s.
- ANTLR's adaptive prediction in the LaTeX parser is super-linear in bracket nesting depth: 20 nested
  parentheses take seconds to parse, 40 minutes.

So three bounds, all decided on the input, before any evaluation (deterministic: a reward never depends on
machine load):
- `nesting_depth(latex)` <= MAX_NESTING before parsing (real answers nest at most 4 deep: measured over every
  answer of ../shared/data/math and tests/data/reward_cases.jsonl);
- `magnitude_bits(expr)` over the unevaluated tree: an upper bound on log2 of the largest exact number that
  evaluating it may build (a power's bits are base bits x exponent, a factorial's n log2 n, ...).  A tree whose
  bound exceeds MAX_BITS at any node, or MAX_TOTAL_BITS summed over its nodes, is never evaluated;
- `expanded_terms(expr)` <= MAX_TERMS: the number of monomials of the symbolic parts once multiplied out
  ((a+b+c+d+e)^{12} has 1820, and math-verify's simplify spends seconds per hundred: 210 terms take ~2 s).

The bounds are deliberately conservative (an over-estimate refuses a few huge-but-computable answers; no real
benchmark answer comes near them).  What they cannot bound (symbolic integration, simplify on large symbolic
expressions) is pure-Python work, which the caller's deadline (`_deadline.Deadline`) interrupts.
"""

from __future__ import annotations

import math

__all__ = [
    "MAX_BITS",
    "MAX_NESTING",
    "MAX_TERMS",
    "MAX_TOTAL_BITS",
    "expanded_terms",
    "magnitude_bits",
    "nesting_depth",
    "within_budget",
]

# Largest exact number (in bits; ~30,000 decimal digits) any node may build: big-integer arithmetic at this size
# takes milliseconds.  2^{2024}, 100!, 10^{1000} are far inside; 9^{9^{9}}, 99999!, 2^{10^{9}} are outside.
MAX_BITS = 100_000
# Sum over all nodes of a tree: bounds the total work of many large nodes (e.g. 7001! + 7002! + ...).
MAX_TOTAL_BITS = 1_000_000
# Bracket nesting ({, (, [ and their \left/\right forms, counted together) allowed into the LaTeX parser.
MAX_NESTING = 8
# Monomials of a symbolic expression multiplied out: (x+1)^{100} (101) and (a+b+c+d+e)^4 (70) are allowed.
MAX_TERMS = 128

_LOG2_E = 1.0 / math.log(2.0)
_INF = math.inf


def nesting_depth(latex: str) -> int:
    """Deepest nesting of (, [, { in a LaTeX string (escaped \\{ \\} count too: they are brackets for the parser).
    Linear; unbalanced closers are ignored."""
    depth = best = 0
    for ch in latex:
        if ch in "([{":
            depth += 1
            if depth > best:
                best = depth
        elif ch in ")]}":
            depth = max(0, depth - 1)
    return best


class _OverBudget(Exception):
    pass


def _count_bound(bits: float) -> float:
    """Upper bound on |x| for a number with log2 |x| <= bits (inf past what a float holds)."""
    return _INF if bits > 1000 else 2.0**bits


class _Walker:
    """One bound computation: `bits(expr)` per node, with running per-node and total checks."""

    def __init__(self, max_bits: float, max_total_bits: float):
        self.max_bits = max_bits
        self.max_total_bits = max_total_bits
        self.total = 0.0

    def bits(self, e, env: dict) -> float:
        b = self._bits(e, env)
        if not b <= self.max_bits:  # also catches nan
            raise _OverBudget
        self.total += b
        if self.total > self.max_total_bits:
            raise _OverBudget
        return b

    def _abs_bound(self, e, env) -> float:
        """Upper bound on |e| itself (exact for rational literals), for exponents, factorial arguments, counts."""
        import sympy

        if isinstance(e, sympy.Rational):
            if max(int(e.p).bit_length(), int(e.q).bit_length()) > 1000:
                return _INF
            return abs(float(e))
        return _count_bound(self.bits(e, env))

    def _bits(self, e, env: dict) -> float:  # noqa: C901 - one case per SymPy node family
        import sympy
        from sympy.concrete.expr_with_limits import ExprWithLimits
        from sympy.functions.elementary.hyperbolic import HyperbolicFunction
        from sympy.matrices import MatrixBase

        if isinstance(e, MatrixBase):  # matrices (mutable ones are not Basic): entries, + log2 of the size
            n = max(1, e.rows * e.cols)
            return max((self.bits(x, env) for x in e), default=1.0) + math.log2(n) + 1.0
        if not isinstance(e, sympy.Basic):
            return 1.0  # strings and other leaves math-verify returns beside the SymPy object
        if isinstance(e, sympy.Integer):
            return float(max(1, int(e.p).bit_length()))
        if isinstance(e, sympy.Rational):
            return float(max(int(e.p).bit_length(), int(e.q).bit_length()))
        if isinstance(e, sympy.Float):
            _sign, _man, exp, bc = e._mpf_  # mantissa bits and binary exponent
            return float(max(1, bc) + abs(exp))
        if isinstance(e, sympy.Symbol) and e in env:
            return env[e]  # a summation / product / integration variable: as large as its limits
        if not e.args:
            return 2.0  # symbols, pi, E, I, oo, nan, zoo, ...
        if isinstance(e, ExprWithLimits):
            return self._with_limits(e, env)
        if isinstance(e, sympy.Derivative):
            order = sum(self._abs_bound(n, env) for _v, n in e.variable_count)
            if order > 1000:
                raise _OverBudget
            return self.bits(e.expr, env) * max(1.0, order)
        if isinstance(e, (sympy.Add, sympy.MatAdd)):
            return max(self.bits(a, env) for a in e.args) + math.log2(len(e.args)) + 1.0
        if isinstance(e, (sympy.Mul, sympy.MatMul)):
            return sum(self.bits(a, env) for a in e.args) + math.log2(len(e.args))
        if isinstance(e, (sympy.Pow, sympy.MatPow)):
            base, expo = e.args
            b = self.bits(base, env)
            m = self._abs_bound(expo, env)
            if isinstance(base, sympy.Integer) and int(base.p) in (-1, 0, 1):
                return 1.0  # SymPy reduces 1^n, 0^n, (-1)^n without building anything
            return b * max(1.0, m) + 1.0
        if isinstance(e, (sympy.exp, HyperbolicFunction)):  # exp(x) has ~1.44 |x| bits; evalf needs them
            return _LOG2_E * max(1.0, self._abs_bound(e.args[0], env)) + 1.0
        if isinstance(e, (sympy.factorial, sympy.factorial2, sympy.subfactorial, sympy.gamma)):
            n = max(2.0, self._abs_bound(e.args[0], env))
            return n * math.log2(n) + 1.0
        if isinstance(e, (sympy.RisingFactorial, sympy.FallingFactorial)):
            x, k = e.args
            kb = max(1.0, self._abs_bound(k, env))
            return kb * (self.bits(x, env) + math.log2(kb + 1.0)) + 1.0
        if isinstance(e, sympy.binomial):
            n, k = e.args
            nb = self._abs_bound(n, env)
            if isinstance(k, sympy.Integer) and isinstance(n, sympy.Integer) and nb < _INF:
                kk = min(abs(int(k.p)), abs(int(n.p) - int(k.p)))
                return kk * math.log2(nb + 2.0) + 1.0
            return max(1.0, nb) + 1.0
        if not isinstance(e, sympy.Expr):
            # tuples, sets, intervals, relations, logic: their parts are compared, not combined
            return max(self.bits(a, env) for a in e.args)
        # any other function of numbers (Mod, gcd, lcm, Max, floor, trig, log, Abs, ...): at most the sum
        return sum(self.bits(a, env) for a in e.args) + 1.0

    def _with_limits(self, e, env: dict) -> float:
        """Sum / Product / Integral: each variable is bounded by its limits; a Sum adds log2(count) bits to its
        term, a Product multiplies them by the count (the count being at most the limits' magnitude, doubled)."""
        import sympy

        inner = dict(env)
        count = 1.0
        for lim in e.limits:
            var, bounds = lim[0], lim[1:]
            vb = max((self.bits(b, env) for b in bounds), default=2.0)
            inner[var] = vb
            count *= 2.0 * _count_bound(vb) if bounds else 1.0
        term = self.bits(e.function, inner)
        if isinstance(e, sympy.Product):
            return term * count + 1.0
        return term + math.log2(count) + 1.0 if count < _INF else _INF


def magnitude_bits(expr, max_bits: float = MAX_BITS, max_total_bits: float = MAX_TOTAL_BITS) -> float:
    """Upper bound on log2 of the largest exact number evaluating `expr` (a SymPy object, matrix or a leaf
    math-verify returns) may build; inf if it exceeds max_bits at any node or max_total_bits over all nodes.
    Looks at the tree only: evaluates nothing."""
    try:
        return _Walker(max_bits, max_total_bits).bits(expr, {})
    except (_OverBudget, RecursionError, OverflowError):
        return _INF


def expanded_terms(expr, max_terms: int = MAX_TERMS) -> float:
    """Upper bound on the number of monomials of `expr` multiplied out (sums add, products multiply, a sum to
    the n-th power has C(n+t-1, t-1) of them); parts without symbols count 1; inf past max_terms."""
    import sympy
    from sympy.matrices import MatrixBase

    def terms(e) -> float:
        if isinstance(e, MatrixBase):
            return max((terms(x) for x in e), default=1.0)
        if not isinstance(e, sympy.Basic) or not e.args or not e.free_symbols:
            return 1.0
        if isinstance(e, sympy.Add):
            t = sum(terms(a) for a in e.args)
        elif isinstance(e, sympy.Mul):
            t = math.prod(terms(a) for a in e.args)
        elif isinstance(e, sympy.Pow) and isinstance(e.exp, sympy.Integer) and e.exp > 1:
            t, n = terms(e.base), int(e.exp)
            if t > 1:
                t = _INF if n > max_terms else float(math.comb(n + int(t) - 1, int(t) - 1))
        elif not isinstance(e, sympy.Expr):  # tuples, sets, relations: parts compared one by one
            t = max(terms(a) for a in e.args)
        else:  # functions, roots, reciprocals: their arguments
            t = sum(terms(a) for a in e.args)
        if t > max_terms:
            raise _OverBudget
        return t

    try:
        return terms(expr)
    except (_OverBudget, RecursionError, OverflowError, ValueError):
        return _INF


def within_budget(expr) -> bool:
    """Whether SymPy can evaluate `expr` without building numbers or polynomials past the module's bounds."""
    return magnitude_bits(expr) <= MAX_BITS and expanded_terms(expr) <= MAX_TERMS
