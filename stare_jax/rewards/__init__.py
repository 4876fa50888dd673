"""stare_jax.rewards: verifiable math rewards.

- `extract_answer`, `normalize_answer`, `is_equivalent`, `score`: answer extraction + equivalence (math.py),
  bounded in time on any input when called directly (size bounds before SymPy evaluates, then `timeout_s`).
- `reward_from_correct` (1/0 paper, +1/-1 DAPO), `overlong_penalty` (DAPO soft length penalty, in tokens) and
  `rollout_rewards` (both, for a batch of scored responses, float32) (shaping.py).
- `RewardPool`: sandboxed scoring in worker processes (timeout, memory limit, crash recovery) (pool.py).
- `RewardFn`: the verifier of a run's task: an in-process string check the caller passes (a toy task's) or math
  in a RewardPool (reward_fn.py).
Importing this package does not import JAX; workers import only these modules and math-verify/SymPy.
"""

from stare_jax.rewards.math import (
    DEFAULT_TIMEOUT_S,
    MAX_ANSWER_CHARS,
    extract_answer,
    is_equivalent,
    normalize_answer,
    reference_alternatives,
    score,
)
from stare_jax.rewards.pool import RewardPool
from stare_jax.rewards.reward_fn import RewardFn
from stare_jax.rewards.shaping import overlong_penalty, reward_from_correct, rollout_rewards

__all__ = [
    "DEFAULT_TIMEOUT_S",
    "MAX_ANSWER_CHARS",
    "RewardFn",
    "RewardPool",
    "extract_answer",
    "is_equivalent",
    "normalize_answer",
    "overlong_penalty",
    "reference_alternatives",
    "reward_from_correct",
    "rollout_rewards",
    "score",
]
