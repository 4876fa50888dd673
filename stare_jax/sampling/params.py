"""SamplingParams: how tokens are drawn, defined once and carried whole from the training loop, the evaluation
runner and the tool rollouts down to the static Sampler and the rollout engine.

The options used to travel as a keyword dict, then as keyword arguments through several calls, then as an
anonymous tuple read back by position; one frozen value replaces all three. It holds what decides the draws
(temperature, top-p, top-k, the stop ids and the seed), not how many are drawn (max_new_tokens and num_samples
are per call, and a multi-turn rollout changes them turn by turn). It validates itself on construction, and
`program_inputs` turns it into the traced scalars both samplers' programs take after the key, so the two build
them the same way. No jax here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np

MIN_EOS_BUCKET = 8  # EOS ids are passed as a fixed-size array padded with -1 to a power of two >= this, so their
# number recompiles only when it crosses a bucket


class ProgramInputs(NamedTuple):
    """The host values of a sampling program's draw options (every one a traced input: no recompile per value)."""

    greedy: np.ndarray  # bool: temperature 0
    temperature: np.ndarray  # float32, 1.0 when greedy
    top_k: np.ndarray  # int32, at most the vocabulary
    top_p: np.ndarray  # float32
    eos_E: np.ndarray  # int32 stop ids, padded with -1 (eos_array)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """The draw options of one sampling call.

    temperature: 0 = greedy. top_p: nucleus mass in (0, 1], 1 = off. top_k: 0 = off. eos_ids: the ids that end a
    turn (None = the model config's eos_token_id, () = never stop early; an int or any iterable of ints is
    stored as a tuple). seed: with the prompt index, sample index and response position, keys every draw.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    eos_ids: Sequence[int] | None = None  # stored as a tuple (hashable, compared by value)
    seed: int = 0

    def __post_init__(self) -> None:
        eos: Any = self.eos_ids
        if eos is not None:
            eos = (int(eos),) if isinstance(eos, (int, np.integer)) else tuple(int(e) for e in eos)
            object.__setattr__(self, "eos_ids", eos)
        check_draw_options(self.temperature, self.top_p, self.top_k)

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with the given fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

    def program_inputs(self, model_config: Any) -> ProgramInputs:
        """The traced draw inputs of a sampling program for a model (its ModelConfig: vocab_size, eos_token_id)."""
        t = self.temperature
        return ProgramInputs(
            np.asarray(t == 0, np.bool_),
            np.asarray(t if t > 0 else 1.0, np.float32),
            np.asarray(min(int(self.top_k), int(model_config.vocab_size)), np.int32),
            np.asarray(self.top_p, np.float32),
            eos_array(self.eos_ids, model_config),
        )


def check_draw_options(temperature: Any, top_p: Any, top_k: Any) -> None:
    """ValueError naming the first draw option out of range."""
    if (
        not isinstance(temperature, (int, float, np.floating, np.integer))
        or not np.isfinite(temperature)
        or temperature < 0
    ):
        raise ValueError(f"temperature must be a finite float >= 0 (0 = greedy), got {temperature!r}")
    if not isinstance(top_p, (int, float, np.floating, np.integer)) or not (0.0 < float(top_p) <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 = off), got {top_k!r}")


def check_counts(max_new_tokens: Any, num_samples: Any) -> None:
    """ValueError unless max_new_tokens and num_samples are positive ints (the per-call sizes of a draw)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if isinstance(num_samples, bool) or not isinstance(num_samples, (int, np.integer)) or num_samples <= 0:
        raise ValueError(f"num_samples must be a positive int, got {num_samples!r}")


def eos_array(eos_ids: Iterable[int] | int | None, cfg: Any) -> np.ndarray:
    """EOS ids as an int32 array padded with -1 to a power-of-two bucket >= MIN_EOS_BUCKET (None -> the model
    config's eos_token_id); any number of stop ids (e.g. a chat template's end-of-turn tokens) is accepted."""
    if eos_ids is None:
        eos_ids = getattr(cfg, "eos_token_id", None)
    if eos_ids is None:
        eos_ids = []
    elif isinstance(eos_ids, (int, np.integer)):
        eos_ids = [int(eos_ids)]
    ids = sorted({int(e) for e in eos_ids})
    vocab = int(cfg.vocab_size)
    for e in ids:
        if not 0 <= e < vocab:
            raise ValueError(f"eos id {e} is outside the vocabulary [0, {vocab})")
    bucket = max(MIN_EOS_BUCKET, 1 << (len(ids) - 1).bit_length()) if ids else MIN_EOS_BUCKET
    return np.array(ids + [-1] * (bucket - len(ids)), np.int32)
