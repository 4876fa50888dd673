"""OffloadConfig: the run config's `rl.offload` section and the train step's static choice of where state lives
between updates. No jax here: the run config imports it."""

from __future__ import annotations

import dataclasses

from stare_jax.config.options import option, validate_fields


@dataclasses.dataclass(frozen=True)
class OffloadConfig:
    """Host offload of train state (jax memory kinds): sampling and training then never hold it in device memory
    beside their own largest buffers."""

    optimizer: bool = option(
        False,
        "keep the AdamW moments in host memory (memory kind pinned_host) between "
        "updates: each optimizer update moves them in and back out inside the step",
    )

    def __post_init__(self):
        validate_fields(self, "rl.offload")
