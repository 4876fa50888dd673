"""Benchmark files, the default evaluation protocol and the metrics reported per benchmark.

A benchmark is a JSON-lines file of {"id": str, "problem": str, "answer": str, ...optional metadata}.
Metrics over a [P problems, N samples] matrix of 0/1 correctness:
- avg@N: mean accuracy over the N samples of each problem, averaged over problems (the paper's metric);
- pass@k: the unbiased estimator of Chen et al. 2021 (Codex), 1 - C(n-c, k) / C(n, k), averaged over problems;
- mean response length (tokens).
"""

from __future__ import annotations

import copy
import json
import math
import pathlib
from collections.abc import Mapping, Sequence

import numpy as np

from stare_jax.data.jsonl import iter_jsonl_objects
from stare_jax.data.prepare import prepare_command
from stare_jax.rewards.math import reference_alternatives

__all__ = [
    "DEFAULT_PROTOCOL",
    "REQUIRED_FIELDS",
    "avg_at_n",
    "benchmark_metrics",
    "format_results_json",
    "format_results_markdown",
    "load_benchmark",
    "pass_at_k",
    "pass_at_k_per_problem",
    "protocol_for",
]

REQUIRED_FIELDS = ("id", "problem", "answer")

# The paper's evaluation protocol (temperature 0.7, top-p 0.95; avg@32 on the small competition sets,
# avg@4 on the larger ones).  `file` is relative to the math data folder (e.g. data/math, where
# `stare-jax data prepare NAME` writes it; the names are those of stare_jax.data.prepare.DATASETS).
DEFAULT_PROTOCOL: dict[str, dict] = {
    "aime24": {"file": "aime24.jsonl", "n": 32, "temperature": 0.7, "top_p": 0.95},
    "aime25": {"file": "aime25.jsonl", "n": 32, "temperature": 0.7, "top_p": 0.95},
    "amc23": {"file": "amc23.jsonl", "n": 32, "temperature": 0.7, "top_p": 0.95},
    "math500": {"file": "math500.jsonl", "n": 4, "temperature": 0.7, "top_p": 0.95},
    "minerva": {"file": "minerva.jsonl", "n": 4, "temperature": 0.7, "top_p": 0.95},
    "olympiadbench": {"file": "olympiadbench.jsonl", "n": 4, "temperature": 0.7, "top_p": 0.95},
    "gsm8k": {"file": "gsm8k_test.jsonl", "n": 4, "temperature": 0.7, "top_p": 0.95},
}


def protocol_for(name: str) -> dict:
    """A copy of the default protocol entry for a benchmark (ValueError naming the known ones otherwise)."""
    if name not in DEFAULT_PROTOCOL:
        raise ValueError(f"protocol_for: unknown benchmark {name!r}; known: {sorted(DEFAULT_PROTOCOL)}")
    return copy.deepcopy(DEFAULT_PROTOCOL[name])


def load_benchmark(path: str | pathlib.Path) -> list[dict]:
    """Rows of a benchmark jsonl file.  Each row keeps its fields and gains "answers": the list of acceptable
    reference forms (see rewards.math.reference_alternatives; a one-element list for ordinary answers).

    Raises ValueError naming the file and 1-based line number for bad JSON, a non-object line, a missing or
    non-string required field, or a duplicate id; FileNotFoundError for a missing file.  Blank lines are
    skipped.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        command = prepare_command(path)
        raise FileNotFoundError(
            f"load_benchmark: no such file: {path}" + (f" (download it with `{command}`)" if command else "")
        )
    rows: list[dict] = []
    seen: dict[str, int] = {}
    for lineno, row in iter_jsonl_objects(path):
        for field in REQUIRED_FIELDS:
            if field not in row:
                raise ValueError(f"{path}:{lineno}: missing field {field!r} (have {sorted(row)})")
            if not isinstance(row[field], str):
                raise ValueError(f"{path}:{lineno}: field {field!r} must be a string, got {type(row[field]).__name__}")
        if row["id"] in seen:
            raise ValueError(f"{path}:{lineno}: duplicate id {row['id']!r} (first on line {seen[row['id']]})")
        seen[row["id"]] = lineno
        row["answers"] = reference_alternatives(row["answer"])
        rows.append(row)
    if not rows:
        raise ValueError(f"load_benchmark: {path} has no rows")
    return rows


def _as_correct_PxN(correct_PxN) -> np.ndarray:
    c = np.asarray(correct_PxN, dtype=np.float64)
    if c.ndim != 2 or c.shape[0] == 0 or c.shape[1] == 0:
        raise ValueError(f"correct_PxN must be a non-empty [problems, samples] matrix, got shape {c.shape}")
    if not np.all((c == 0.0) | (c == 1.0)):
        raise ValueError("correct_PxN must contain only 0/1 (or False/True)")
    return c


def avg_at_n(correct_PxN) -> float:
    """avg@N: per-problem mean accuracy over its N samples, averaged over the P problems."""
    c = _as_correct_PxN(correct_PxN)
    return float(c.mean(axis=1).mean())


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with n samples of which c are correct: 1 - C(n-c, k) / C(n, k),
    computed as 1 - prod_{i=n-c+1}^{n} (1 - k/i) (numerically stable, as in the Codex paper)."""
    if not (0 <= c <= n) or not (1 <= k <= n):
        raise ValueError(f"pass_at_k: need 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def pass_at_k_per_problem(correct_PxN, k: int) -> np.ndarray:
    """[P] pass@k of each problem (all problems need the same number of samples N >= k)."""
    c = _as_correct_PxN(correct_PxN)
    n = c.shape[1]
    return np.array([pass_at_k(n, int(row.sum()), k) for row in c])


def benchmark_metrics(correct_PxN, lengths_PxN=None, ks: Sequence[int] = (1,)) -> dict:
    """Metrics of one benchmark: n_problems, n_samples, avg@N, pass@k for each k <= N, mean_response_len."""
    c = _as_correct_PxN(correct_PxN)
    P, N = c.shape
    out: dict = {"n_problems": int(P), "n_samples": int(N), f"avg@{N}": avg_at_n(c)}
    for k in ks:
        if k > N:
            raise ValueError(f"benchmark_metrics: pass@{k} needs at least {k} samples per problem, have {N}")
        out[f"pass@{k}"] = float(pass_at_k_per_problem(c, k).mean())
    if lengths_PxN is not None:
        L = np.asarray(lengths_PxN, dtype=np.float64)
        if L.shape != c.shape:
            raise ValueError(f"benchmark_metrics: lengths_PxN shape {L.shape} != correct_PxN shape {c.shape}")
        if not np.all(np.isfinite(L)) or np.any(L < 0):
            raise ValueError("benchmark_metrics: lengths_PxN must be finite and >= 0")
        out["mean_response_len"] = float(L.mean())
    return out


def format_results_json(results: Mapping[str, Mapping]) -> str:
    """Per-benchmark results {benchmark: metrics} as indented, key-sorted JSON."""
    return json.dumps({k: dict(v) for k, v in results.items()}, indent=2, sort_keys=True)


def _fmt(v) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.4f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def format_results_markdown(results: Mapping[str, Mapping]) -> str:
    """Per-benchmark results as a markdown table: one row per benchmark, one column per metric (union of the
    metric names, in first-seen order; '-' where a benchmark lacks one)."""
    if not results:
        raise ValueError("format_results_markdown: no results")
    cols: list[str] = []
    for metrics in results.values():
        for key in metrics:
            if key not in cols:
                cols.append(key)
    lines = ["| benchmark | " + " | ".join(cols) + " |", "| --- |" + " --- |" * len(cols)]
    for name, metrics in results.items():
        lines.append(f"| {name} | " + " | ".join(_fmt(metrics[c]) if c in metrics else "-" for c in cols) + " |")
    return "\n".join(lines) + "\n"
