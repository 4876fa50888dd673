"""OptimizerConfig: the optimizer options, defined once. It is both the run config's `optimizer` section
(stare_jax/config/loader.py embeds it) and the optimizer part of the jitted step's static TrainStepConfig. No jax here:
the run config imports it.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from stare_jax.config.options import option, validate_fields

SCHEDULES = ("constant", "linear", "cosine")


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """optax AdamW with global-norm clipping; defaults are the paper's (lr 1e-6, constant schedule, no warm-up)."""

    lr: float = option(1e-6, "peak learning rate", lo=0.0, lo_open=True)
    b1: float = option(0.9, lo=0.0, hi=1.0, hi_open=True)
    b2: float = option(0.999, lo=0.0, hi=1.0, hi_open=True)
    eps: float = option(1e-8, lo=0.0, lo_open=True)
    weight_decay: float = option(0.01, lo=0.0)
    grad_clip: float = option(1.0, "global-norm clip; 0 = off", lo=0.0)
    schedule: Literal["constant", "linear", "cosine"] = option(
        "constant",
        "constant (a linear warm-up first when warmup_steps > 0), linear (warm-up only, then constant) "
        "or cosine (warm-up, then cosine decay to 0 over total_steps)",
    )
    warmup_steps: int = option(
        0, "linear warm-up length in optimizer updates (rl.mini_batches x rl.ppo_epochs per RL step)", lo=0
    )
    total_steps: int | None = option(
        None,
        "cosine decay length in optimizer steps; null = the run's total_steps x rl.mini_batches x rl.ppo_epochs",
        lo=1,
    )

    def __post_init__(self):
        validate_fields(self, "optimizer")
