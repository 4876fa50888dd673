"""From correctness to rewards: the reward modes and DAPO's overlong penalty, for one answer or a whole batch."""

from __future__ import annotations

import numpy as np

__all__ = ["overlong_penalty", "reward_from_correct", "rollout_rewards"]


def reward_from_correct(correct, mode: str = "binary"):
    """Map 1/0 correctness (scalar or array) to rewards: 'binary' -> 1/0 (the STARE paper),
    'signed' -> +1/-1 (DAPO).  Returns a float for a scalar, a float64 array otherwise."""
    if mode not in ("binary", "signed"):
        raise ValueError(f"reward_from_correct: mode must be 'binary' or 'signed', got {mode!r}")
    c = np.asarray(correct, dtype=np.float64)
    if not np.all(np.isfinite(c)):
        raise ValueError("reward_from_correct: correctness must be finite")
    r = np.where(c > 0.5, 1.0, 0.0 if mode == "binary" else -1.0)
    return float(r) if r.ndim == 0 else r


def overlong_penalty(length_tokens, max_length: int, buffer_length: int, penalty_factor: float = 1.0):
    """DAPO soft overlong punishment, added to the reward; lengths in tokens (scalar or array).

    0 for L <= max_length - buffer_length; linear from 0 down to -penalty_factor across the buffer;
    -penalty_factor beyond max_length.  Pure NumPy, so it works on a whole batch of lengths at once.
    """
    if max_length <= 0 or buffer_length <= 0 or buffer_length > max_length:
        raise ValueError(
            f"overlong_penalty: need 0 < buffer_length <= max_length, got max_length={max_length}, "
            f"buffer_length={buffer_length}"
        )
    if penalty_factor < 0:
        raise ValueError(f"overlong_penalty: penalty_factor must be >= 0, got {penalty_factor}")
    L = np.asarray(length_tokens, dtype=np.float64)
    if np.any(L < 0):
        raise ValueError("overlong_penalty: negative length_tokens")
    expected = max_length - buffer_length
    pen = np.clip((expected - L) / buffer_length, -1.0, 0.0) * penalty_factor
    return float(pen) if pen.ndim == 0 else pen


def rollout_rewards(
    correct_PxG,
    lengths_PxG,
    *,
    mode: str = "binary",
    max_length: int = 0,
    overlong_buffer: int = 0,
    overlong_penalty_factor: float = 1.0,
) -> np.ndarray:
    """float32 rewards of a batch of scored responses (any shape): reward_from_correct in `mode`, plus DAPO's
    overlong_penalty of each response length when overlong_buffer > 0 (max_length: the generation limit)."""
    r = np.asarray(reward_from_correct(correct_PxG, mode), np.float32)
    if overlong_buffer > 0:
        pen = overlong_penalty(lengths_PxG, max_length, overlong_buffer, overlong_penalty_factor)
        r = r + np.asarray(pen, np.float32)
    return r
