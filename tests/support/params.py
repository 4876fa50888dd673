"""Parametrize helpers: run one representative of a heavy test matrix by default, the rest with --runslow.

Each case of a heavy matrix compiles programs of its own on XLA:CPU (most of the default suite's time), while the
cases mostly run the same code with other settings: the default suite keeps the first `keep` cases and marks the
others `slow` (opt-in with --runslow or STARE_JAX_RUN_SLOW=1, tests/conftest.py), so the full matrix runs when asked.
"""

from collections.abc import Iterable

import pytest

_PARAM = type(pytest.param(None))  # pytest's ParameterSet (not public API)


def representative(params: Iterable, keep: int = 1) -> list:
    """`params` as a parametrize list, every value after the first `keep` marked slow.

    A tuple is one case of several argnames (as parametrize reads it; wrap a single argname's tuple value in
    pytest.param first). A value that is already a `pytest.param` keeps its id and marks and gains the slow mark;
    `ids=` given to parametrize still names the cases (a pytest.param without an id takes its id from `ids=`).
    """
    out = []
    for i, value in enumerate(params):
        if i < keep:
            out.append(value)
        elif isinstance(value, _PARAM):
            out.append(pytest.param(*value.values, marks=[*value.marks, pytest.mark.slow], id=value.id))
        elif isinstance(value, tuple):
            out.append(pytest.param(*value, marks=pytest.mark.slow))
        else:
            out.append(pytest.param(value, marks=pytest.mark.slow))
    return out
