"""RewardFn: the verifier a run or an evaluation scores decoded responses with."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import numpy as np

from stare_jax.rewards.math import reference_alternatives
from stare_jax.rewards.pool import RewardPool

__all__ = ["RewardFn"]


@dataclasses.dataclass
class RewardFn:
    """Scores decoded responses against reference answers. With `score` (a toy task's pure string check, e.g.
    stare_jax.tasks.get_task(name).score: the caller picks it, so this package knows no task) in-process; without,
    math answers in a sandboxed worker pool (model output is untrusted), started on first use. Returns correctness
    in {0, 1} and the pool's stats (n_* counters; empty for an in-process check)."""

    score: Callable[[str, str], float] | None = None
    num_workers: int = 2
    timeout_s: float = 10.0
    _pool: RewardPool | None = None

    @property
    def is_math(self) -> bool:
        """True when answers go to the math verifier pool (whose counters are summed across processes)."""
        return self.score is None

    def __call__(self, texts: Sequence[str], answers: Sequence[str]) -> tuple[np.ndarray, dict]:
        if self.score is not None:
            return np.asarray([self.score(t, a) for t, a in zip(texts, answers)], np.float32), {}
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
