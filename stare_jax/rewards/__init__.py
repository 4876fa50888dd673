"""stare_jax.rewards: verifiable math rewards.

- `extract_answer`, `normalize_answer`, `is_equivalent`, `score`: answer extraction + equivalence (math.py),
  bounded in time on any input when called directly (size bounds before SymPy evaluates, then `timeout_s`).
- `reward_from_correct` (1/0 paper, +1/-1 DAPO) and `overlong_penalty` (DAPO soft length penalty, in tokens).
- `RewardPool`: sandboxed scoring in worker processes (timeout, memory limit, crash recovery) (pool.py).
Importing this package does not import JAX; workers import only these modules and math-verify/SymPy.
"""

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
from stare_jax.rewards.pool import RewardPool

__all__ = [
    "MAX_ANSWER_CHARS",
    "RewardPool",
    "extract_answer",
    "is_equivalent",
    "normalize_answer",
    "overlong_penalty",
    "reference_alternatives",
    "reward_from_correct",
    "score",
]
