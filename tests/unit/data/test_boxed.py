"""stare_jax.data.boxed: the last well-formed \\boxed / \\fbox argument, the rule shared by the math judge and the
dataset converters."""

from stare_jax.data.boxed import last_boxed


def test_last_boxed():
    assert last_boxed("first \\boxed{1} then \\boxed{\\frac{1}{2}}.") == "\\frac{1}{2}"
    assert last_boxed("\\boxed{\\frac{\\sqrt{2}}{2}}") == "\\frac{\\sqrt{2}}{2}"
    assert last_boxed("$\\boxed{\\{1, 2\\}}$") == "\\{1, 2\\}"  # escaped braces do not count
    assert last_boxed("\\fbox{x+1}") == "x+1"
    assert last_boxed("so $\\boxed 5$.") == "5"
    assert last_boxed("\\boxed{ 12 }") == "12"
    assert last_boxed("no box") is None
    assert last_boxed("\\boxed{\\frac{1}{2}") is None  # unbalanced
    assert last_boxed("\\boxed{}") is None
    assert last_boxed("\\boxedfoo{3}") is None
    # a malformed last box: the one before it (the judge's rule: up to MAX_BOX_TRIES candidates)
    assert last_boxed("\\boxed{7} and then \\boxed{") == "7"
