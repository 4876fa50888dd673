"""JSON-lines files: the project's one reader (local paths and object-store URLs through etils.epath) and DataError,
the error of a missing, unreadable or malformed data file (the message names the file and line). Light on purpose:
`stare-jax data` and the prompt pipeline both read through it."""

from __future__ import annotations

import json
import pathlib
from typing import Any, Iterator

from etils import epath

__all__ = ["DataError", "iter_jsonl_objects", "iter_jsonl_values"]


class DataError(ValueError):
    """A data file is missing, unreadable or has a malformed row (the message names file and line)."""


def iter_jsonl_values(path: str | pathlib.Path) -> Iterator[tuple[int, Any]]:
    """(1-based line number, value) for every non-blank line of a JSON-lines file; DataError naming the file and
    line for invalid JSON. The one jsonl reader of the project. Local paths and object-store URLs (gs://..., via
    etils.epath) both work."""
    file = epath.Path(path)
    with file.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{file}:{lineno}: invalid JSON ({e.msg} at column {e.colno})") from None
            yield lineno, value


def iter_jsonl_objects(path: str | pathlib.Path) -> Iterator[tuple[int, dict]]:
    """iter_jsonl_values where every line must be a JSON object (DataError naming the file and line otherwise)."""
    for lineno, obj in iter_jsonl_values(path):
        if not isinstance(obj, dict):
            raise DataError(f"{epath.Path(path)}:{lineno}: expected a JSON object, got {type(obj).__name__}")
        yield lineno, obj
