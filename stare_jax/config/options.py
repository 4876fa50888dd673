"""Declared options: one field declaration (type annotation + `option(...)` metadata) per setting, and the one
checker that validates a value against it.

Every config section - the run config's sections in stare_jax/config/loader.py and the sections the jitted step embeds
(StareConfig, OptimizerConfig) - declares its fields with `option`. The run-config loader checks values against
those declarations with the dotted key and the file they came from; a frozen section validates itself on
construction (`validate_fields`) with the same checker, so a section built in code (tests, benchmarks) is held to
the same rules. No imports from the rest of the package: every layer may use this module.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import math
import types
import typing
from typing import Any, Literal


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type or out of range."""


def option(
    default, doc: str = "", *, lo=None, hi=None, lo_open: bool = False, hi_open: bool = False, nonzero: bool = False
):
    """A dataclass field with its documentation and accepted numeric range [lo, hi] (open ends where asked)."""
    meta: dict = {"doc": doc}
    if lo is not None or hi is not None or nonzero:
        meta.update(range=(lo, hi, lo_open, hi_open), nonzero=nonzero)
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=functools.partial(copy.deepcopy, default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def describe(tp) -> str:
    """What an annotation accepts, in words."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(describe(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def coerce(value: Any, tp, key: str, where: str) -> Any:
    """Check `value` against the annotation `tp`; return it (ints accepted for floats, returned as float).
    ConfigError names `where` (file, override or class) and the dotted `key`."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        alts = [a for a in typing.get_args(tp) if a is not type(None)]
        if value is not None and len(alts) == 1:  # Optional[X]: X's own message (choices, closest match)
            return coerce(value, alts[0], key, where)
        for alt in typing.get_args(tp):
            try:
                return coerce(value, alt, key, where)
            except ConfigError:
                pass
        raise ConfigError(f"{where}: '{key}' = {value!r} has the wrong type; expected {describe(tp)}")
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            close = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"{where}: '{key}' = {value!r} is not accepted; accepted values: "
                f"{', '.join(repr(c) for c in choices)}{hint}"
            )
        return value
    if tp is type(None):
        if value is not None:
            raise ConfigError(f"{where}: '{key}' = {value!r}; expected null")
        return None
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: '{key}' = {value!r} has the wrong type; expected a boolean (true/false)")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: '{key}' = {value!r} has the wrong type; expected an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: '{key}' = {value!r} has the wrong type; expected a number")
        if not math.isfinite(float(value)):
            raise ConfigError(f"{where}: '{key}' = {value!r} must be a finite number")
        return float(value)
    if tp in (str, dict, list):
        if not isinstance(value, tp):
            what = {str: "a string", dict: "a mapping", list: "a list"}[tp]
            raise ConfigError(f"{where}: '{key}' = {value!r} has the wrong type; expected {what}")
        return tp(value)
    raise TypeError(f"option annotation {tp!r} for {key} is not supported")


def check_range(value, meta, key: str, where: str) -> None:
    """ConfigError when `value` is outside the field's declared range (None, and a string choice of an `int |
    Literal[...]` field, are always in range)."""
    if "range" not in meta or value is None or isinstance(value, str):
        return
    lo, hi, lo_open, hi_open = meta["range"]
    if meta.get("nonzero") and value == 0:
        raise ConfigError(f"{where}: '{key}' = 0 is not accepted; use a positive size or -1 (all remaining devices)")
    if (lo is not None and (value < lo or (lo_open and value == lo))) or (
        hi is not None and (value > hi or (hi_open and value == hi))
    ):
        accepted = (
            f"{'(' if lo_open else '['}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}"
            f"{')' if hi_open else ']'}"
        )
        doc = f" ({meta['doc']})" if meta.get("doc") else ""
        raise ConfigError(f"{where}: '{key}' = {value!r} is out of range; accepted: {accepted}{doc}")


_TYPED_FIELDS: dict[type, tuple[tuple[dataclasses.Field, Any], ...]] = {}


def typed_fields(cls: type) -> tuple[tuple[dataclasses.Field, Any], ...]:
    """(field, resolved annotation) of a dataclass, cached (annotations are strings under `from __future__`)."""
    if cls not in _TYPED_FIELDS:
        hints = typing.get_type_hints(cls)
        _TYPED_FIELDS[cls] = tuple((f, hints[f.name]) for f in dataclasses.fields(cls))
    return _TYPED_FIELDS[cls]


def validate_fields(obj, where: str | None = None) -> None:
    """Check every non-dataclass field of `obj` against its declaration (type, choices, range); nested sections
    validate themselves. ConfigError (a ValueError) names the class and the field."""
    where = where or type(obj).__name__
    for f, tp in typed_fields(type(obj)):
        if dataclasses.is_dataclass(tp):
            continue
        value = getattr(obj, f.name)
        coerce(value, tp, f.name, where)
        check_range(value, f.metadata, f.name, where)
