"""RewardFn: the verifier a run or an evaluation scores decoded responses with, chosen by task name."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from stare_jax.rewards.math import reference_alternatives
from stare_jax.rewards.pool import RewardPool
from stare_jax.tasks import get_task

__all__ = ["RewardFn"]


@dataclasses.dataclass
class RewardFn:
    """Scores decoded responses against reference answers: toy tasks (stare_jax.tasks) in-process, a pure string
    check; "math" in a sandboxed worker pool (model output is untrusted), started on first use. Returns
    correctness in {0, 1} and the pool's stats (n_* counters; empty for toy tasks)."""

    task: str
    num_workers: int = 2
    timeout_s: float = 10.0
    _pool: RewardPool | None = None

    def __call__(self, texts: Sequence[str], answers: Sequence[str]) -> tuple[np.ndarray, dict]:
        if self.task != "math":
            score = get_task(self.task).score
            return np.asarray([score(t, a) for t, a in zip(texts, answers)], np.float32), {}
        if self._pool is None:
            self._pool = RewardPool(num_workers=self.num_workers, timeout_s=self.timeout_s)
        # a reference listing several acceptable forms (e.g. Minerva's joined lists) is scored against each
        refs = [reference_alternatives(a) for a in answers]
        scores, stats = self._pool.score_batch(list(texts), refs)
        return np.asarray(scores, np.float32), dict(stats)

    def close(self):
        if self._pool is not None:
            self._pool.close()
            self._pool = None
