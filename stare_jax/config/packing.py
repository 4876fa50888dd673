"""PackingConfig: the run config's `rl.packing` section and the train step's static choice of batch layout. No jax
here: the run config imports it. The layout itself is stare_jax.rl.packing."""

from __future__ import annotations

import dataclasses

from stare_jax.config.options import option, validate_fields


@dataclasses.dataclass(frozen=True)
class PackingConfig:
    """Sequence packing of the train batch: each response with its prompt placed whole into rows of `row_tokens`
    tokens (first-fit-decreasing), sequences told apart by segment ids (attention stays within a sequence, RoPE
    positions restart at each). The loss, STARE's selection and every metric are those of the padded layout."""

    enabled: bool = option(
        False, "pack the train batch into rows of row_tokens tokens (off: one padded row per sequence)"
    )
    row_tokens: int = option(
        0,
        "tokens per packed row; 0 = the padded row length (prompt bucket + "
        "sampling.max_new_tokens). Every sequence (prompt + response) must fit one row",
        lo=0,
    )

    def __post_init__(self):
        validate_fields(self, "rl.packing")
