"""EngineConfig: the rollout engine's options, defined once. It is the run config's `sampling.engine` section
(stare_jax/config/loader.py embeds it) and the engine's own config (stare_jax/sampling/engine/). No jax here."""

from __future__ import annotations

import dataclasses
from typing import Literal

from stare_jax.config.options import ConfigError, option, validate_fields

MIN_PREFILL_WIDTH = 32  # smallest tokens per row of a prefill call (buckets: powers of two up to prefill_chunk)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Continuous batching over a paged KV cache (stare_jax.sampling.engine)."""

    enabled: bool | Literal["auto"] = option(
        "auto",
        "generate with the rollout engine (continuous batching, paged KV cache, one prefill per prompt) "
        "instead of the static sampler (same samples): true, false, or auto = the engine wherever it runs "
        "(any mesh, one process or several; a mesh split over data/fsdp axes gives each data shard its own "
        "slots and pages) "
        "and pays (max_new_tokens >= "
        "auto_min_new_tokens), the static sampler elsewhere",
    )
    auto_min_new_tokens: int = option(
        128,
        "with enabled=auto, the shortest response budget (sampling.max_new_tokens) that uses the engine: "
        "for a few tokens per response there is no tail to refill and the static sampler's single program "
        "is faster (the CPU toy's 8 tokens: ~1.4-2.5x)",
        lo=1,
    )
    max_slots: int | Literal["auto"] = option(
        64,
        "decode slots: rows decoded together per step (the decode batch; split over the mesh's data shards), or "
        "auto = the most whose sampling phase fits in 90% of the accelerator's HBM by `stare-jax plan`'s estimate, "
        "at most one per response of a generation batch (on a host that reports no HBM figure, e.g. the CPU: one "
        "per response); `stare-jax plan` prints the number",
        lo=1,
    )
    page_size: int = option(16, "tokens per KV page (the unit of allocation and of prefix sharing)", lo=1)
    num_pages: int = option(
        0,
        "pages in the pool (split over the mesh's data shards; page 0 of each reserved); 0 = "
        "auto (max_slots x the longest request's pages + prefix staging: never preempts); "
        "fewer bound memory, and rows are then preempted and recomputed when the pool runs "
        "out",
        lo=0,
    )
    decode_chunk: int = option(16, "decode steps (K) per jitted decode program between host scheduling rounds", lo=1)
    prefill_chunk: int = option(256, "prompt tokens per row written per round (chunked prefill)", lo=1)
    share_prefix: bool = option(True, "the G samples of a prompt share its prefix pages (one prefill per prompt)")
    attention: Literal["auto", "gather", "pallas"] = option(
        "auto",
        "decode attention over the page pool: gather (pure JAX: gather the live pages, the model's attention "
        "kernel; every platform), pallas (jax's TPU Pallas paged-attention kernel reading the pages in "
        "place; Pallas interpret mode off TPU, slow; it reads k/v as bfloat16), or auto = pallas on a TPU "
        "when head_dim % 128 == 0 and the KV cache is bfloat16 (sampling.kv_cache_dtype), gather "
        "elsewhere. Prefill always gathers",
    )

    def __post_init__(self):
        validate_fields(self, "sampling.engine")
        if self.num_pages == 1:
            raise ConfigError(
                "sampling.engine: 'num_pages' = 1 is not accepted: 0 (auto) or >= 2 (page 0 is the trash page)"
            )

    def pool_pages(self, longest_tokens: int) -> int:
        """Pages of the pool for requests of up to `longest_tokens` tokens (prompt + new tokens): num_pages, or in
        auto mode one request's pages + a prefix staging page for every slot and one more prompt, + the trash
        page (so the auto pool never preempts)."""
        if self.max_slots == "auto":
            raise ValueError(
                "sampling.engine.max_slots=auto must be resolved to a number first "
                "(stare_jax.planning.estimate.resolve_max_slots)"
            )
        one = -(-int(longest_tokens) // self.page_size) + 1
        return self.num_pages if self.num_pages else (self.max_slots + 1) * one + 1

    def prefill_width(self, longest_chunk: int) -> int:
        """Tokens per row of a prefill call whose longest chunk left to write is `longest_chunk`: its power-of-two
        bucket, at least MIN_PREFILL_WIDTH, at most prefill_chunk. A few widths (log2(prefill_chunk /
        MIN_PREFILL_WIDTH) + 1 programs), and no call pads its rows to more than twice its longest chunk: prompts
        of 33-64 tokens must not pay for prefill_chunk columns (a fixed 256 made a 64-prompt prefill 4x the static
        sampler's)."""
        return min(self.prefill_chunk, 1 << (max(int(longest_chunk), MIN_PREFILL_WIDTH) - 1).bit_length())
