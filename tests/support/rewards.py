"""Test-only score functions for RewardPool workers (must be importable by name in the worker processes).

`misbehaving_score` does what the response tells it to, so tests can make a worker sleep, hang with its
alarm blocked, raise, allocate memory or die, deterministically; anything else is scored by the real scorer.
"""

import os
import signal
import time

from stare_jax.rewards.math import score


def misbehaving_score(response: str, reference) -> float:
    if response.startswith("mark_then_sleep:"):  # tell the test (by a file) that the item is in flight
        _, seconds, path = response.split(":", 2)
        open(path, "w").close()
        time.sleep(float(seconds))
        return 1.0
    if response.startswith("sleep:"):
        time.sleep(float(response.split(":")[1]))
        return 1.0
    if response.startswith("hang:"):  # ignore the in-worker alarm: only the parent's SIGKILL can stop this
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(float(response.split(":")[1]))
        return 1.0
    if response == "raise":
        raise ValueError("scorer bug")
    if response.startswith("alloc:"):
        block = bytearray(int(response.split(":")[1]) * 1024 * 1024)
        return float(len(block) > 0)
    if response == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    return score(response, reference)
