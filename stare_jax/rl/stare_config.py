"""StareConfig: every STARE option, defined once. It is both the run config's `rl.stare` section (stare_jax/config.py
embeds it; its loader reads the Literal types and the range metadata below for errors that name the dotted key and
the file) and the static config of the jitted train step. No jax here: the run config imports it.

Reconciled from the two classes that existed before (decisions):
- enabled defaults to False (plain GRPO(-ds) until asked for; the run config's default and the authors' code's).
- target_entropy >= 0: H_tgt = 0 is allowed (the batch gate then never opens, which is how the authors' GRPO-ds
  script disables STARE while keeping its code path).
- micro_batch_size: the sequences per selection group of scope micro_batch; None in a run config means "the run's
  rl.micro_batch_size" (train.train_step_config fills it in), so the authors' per-GPU-micro-batch ranking is the
  default grouping; the selection raises if scope micro_batch reaches it with None.
- Validation happens once per construction, from these field declarations (__post_init__); the run-config loader
  checks the same declarations first only to name the key and file in its message.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import typing
from typing import Literal

VARIANTS = ("O1", "O2", "O3", "O4", "C1", "C2", "C3", "C4")
GATES = ("batch", "sample", "token", "none")
RULES = ("quantile", "exact_top_k")
SCOPES = ("batch", "micro_batch")
SELECT_IMPLS = ("bisect", "jnp_quantile")
ADAPTIVE_TIMINGS = ("same_step", "next_step")
SET_NAMES = ("pos_high", "pos_low", "neg_high", "neg_low")

# variant -> (sets that get W, sets that get M)  (STARE-semantics.md, "Variants")
VARIANT_SETS = {
    "O1": (("pos_high",), ()),
    "O2": ((), ("pos_low",)),
    "O3": (("neg_low",), ()),
    "O4": ((), ("neg_high",)),
    "C1": (("pos_high", "neg_low"), ()),
    "C2": (("pos_high",), ("neg_high",)),
    "C3": (("neg_low",), ("pos_low",)),
    "C4": ((), ("pos_low", "neg_high")),
}


def _opt(default, doc: str = "", *, lo=None, hi=None, lo_open=False, hi_open=False):
    """A field with the run-config loader's metadata schema (stare_jax/config.py `_f`): doc and accepted range."""
    meta: dict = {"doc": doc}
    if lo is not None or hi is not None:
        meta.update(range=(lo, hi, lo_open, hi_open), nonzero=False)
    return dataclasses.field(default=default, metadata=meta)


@dataclasses.dataclass(frozen=True)
class StareConfig:
    """STARE token reweighting and its closed-loop entropy gate (STARE-semantics.md); defaults are the paper's."""

    enabled: bool = _opt(False, "False = plain GRPO(-ds): omega == 1 everywhere")
    variant: Literal["O1", "O2", "O3", "O4", "C1", "C2", "C3", "C4"] = _opt("O1")
    top_p: float = _opt(0.1, "P: fraction of candidate tokens selected", lo=0.0, hi=1.0, lo_open=True)
    w: float = _opt(1.1, "amplification weight W >= 1", lo=1.0)
    m: float = _opt(0.9, "attenuation weight M in (0, 1]", lo=0.0, hi=1.0, lo_open=True)
    gate: Literal["batch", "sample", "token", "none"] = _opt("batch")
    target_entropy: float = _opt(0.3, "H_tgt; 0 = the batch gate never opens", lo=0.0)
    rule: Literal["quantile", "exact_top_k"] = _opt("quantile")
    scope: Literal["batch", "micro_batch"] = _opt("batch")
    micro_batch_size: int | None = _opt(None, "scope micro_batch: sequences per selection group; null = the run's "
                                              "rl.micro_batch_size", lo=1)
    select_impl: Literal["bisect", "jnp_quantile"] = _opt(
        "bisect", "how the quantile rule's thresholds are found: bisection on the float bits (masked counts, "
                  "no sort) or jnp.nanquantile (a sort); exact_top_k always bisects")
    adaptive: bool = _opt(False)
    alpha: float = _opt(0.01, lo=0.0)
    w_max: float = _opt(1.5, lo=1.0)
    m_min: float = _opt(0.5, lo=0.0, hi=1.0, lo_open=True)
    adaptive_timing: Literal["same_step", "next_step"] = _opt("same_step")
    theory_diagnostics: bool = _opt(False, "Phi, s*, Lambda, Gamma, W* in the trainer pass (slower)")

    def __post_init__(self):
        for f, tp in _fields(type(self)):
            _check(f, tp, getattr(self, f.name))


@functools.cache
def _fields(cls):
    hints = typing.get_type_hints(cls)
    return tuple((f, hints[f.name]) for f in dataclasses.fields(cls))


def _check(f: dataclasses.Field, tp, value) -> None:
    """ValueError naming the option, its value and what is accepted."""
    name = f.name
    if typing.get_origin(tp) is Literal:
        if value not in typing.get_args(tp):
            raise ValueError(f"STARE option {name}={value!r} is not supported; accepted values: "
                             f"{list(typing.get_args(tp))}")
        return
    if value is None and type(None) in typing.get_args(tp):
        return
    kind = tp if tp in (bool, int, float) else next(a for a in typing.get_args(tp) if a is not type(None))
    ok = (isinstance(value, bool) if kind is bool else
          isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool))
    if not ok:
        raise ValueError(f"STARE option {name}={value!r} has the wrong type; expected {kind.__name__}")
    if kind is float and not math.isfinite(value):
        raise ValueError(f"STARE option {name}={value!r} must be a finite number")
    if "range" in f.metadata:
        lo, hi, lo_open, hi_open = f.metadata["range"]
        if (lo is not None and (value < lo or (lo_open and value == lo))) or (
                hi is not None and (value > hi or (hi_open and value == hi))):
            accepted = f"{'(' if lo_open else '['}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}" \
                       f"{')' if hi_open else ']'}"
            doc = f" ({f.metadata['doc']})" if f.metadata.get("doc") else ""
            raise ValueError(f"STARE option {name}={value!r} is out of range; accepted: {accepted}{doc}")
