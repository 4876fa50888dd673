"""Prompt data: read {problem, answer} rows from jsonl/parquet, format prompts, and stream shuffled,
checkpointable batches with grain.

The grain pipeline yields batches of *row indices* (int32 arrays) rather than strings: index batches stack
cheaply, the iterator state is a tiny dict (`{"next_index": n}`) that goes into the run checkpoint, and the
caller looks the rows up in the list this module returned.

Multi-process runs: every process walks the same GLOBAL index stream (same seed, same order) and so knows the
whole generation batch of each step; the work on it is split by the devices and processes downstream (the
sampler shards the batch over every process's devices, each process scores its own share of the responses, see
training/collect.py). The global order makes a run's batches, and so its results, independent of the number of
processes, and the iterator state identical on every process: a checkpoint written by 1 x 8 devices resumes on
2 x 4 and vice versa.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Iterator, Sequence

import grain
import numpy as np
import pyarrow.parquet as pq
from etils import epath

from stare_jax.data.jsonl import DataError, iter_jsonl_objects
from stare_jax.data.prepare import prepare_command

PAPER_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."


@dataclasses.dataclass(frozen=True)
class PromptRow:
    """One training or evaluation problem. `where` is 'file:line' (or 'file:row N' for parquet)."""

    id: str
    problem: str
    answer: str
    where: str


def _row_from_mapping(obj, where: str, prompt_field: str, answer_field: str, index: int) -> PromptRow:
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected a JSON object per row, got {type(obj).__name__}")
    for name in (prompt_field, answer_field):
        if name not in obj or obj[name] is None:
            raise DataError(
                f"{where}: row has no '{name}' field (fields present: {', '.join(map(str, obj)) or 'none'})"
            )
    problem, answer = obj[prompt_field], obj[answer_field]
    if not isinstance(problem, str) or not problem.strip():
        raise DataError(f"{where}: '{prompt_field}' must be a non-empty string, got {problem!r:.80}")
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise DataError(f"{where}: '{answer_field}' must be a string or number, got {type(answer).__name__}")
    if isinstance(answer, float) and answer.is_integer():
        answer = int(answer)
    return PromptRow(id=str(obj.get("id", index)), problem=problem, answer=str(answer), where=where)


def read_rows(
    path: str | pathlib.Path, *, prompt_field: str = "problem", answer_field: str = "answer"
) -> list[PromptRow]:
    """Read every row of a .jsonl or .parquet file (local, or gs://... on multi-host runs); any bad row raises
    DataError naming the file and line."""
    file = epath.Path(path)
    if not file.is_file():
        command = None if "://" in str(path) else prepare_command(path)
        raise DataError(f"data file not found: {file}" + (f" (download it with `{command}`)" if command else ""))
    rows: list[PromptRow] = []
    if file.suffix == ".parquet":
        try:
            with file.open("rb") as f:
                records = pq.read_table(f).to_pylist()
        except Exception as e:  # noqa: BLE001 - pyarrow raises many types for bad files
            raise DataError(f"{file}: not a readable parquet file: {e}") from None
        for i, obj in enumerate(records):
            rows.append(_row_from_mapping(obj, f"{file}:row {i}", prompt_field, answer_field, i))
    elif file.suffix in (".jsonl", ".json"):
        for lineno, obj in iter_jsonl_objects(file):
            rows.append(_row_from_mapping(obj, f"{file}:{lineno}", prompt_field, answer_field, len(rows)))
    else:
        raise DataError(f"{file}: unsupported data file type '{file.suffix}' (accepted: .jsonl, .parquet)")
    if not rows:
        raise DataError(f"{file}: no rows")
    return rows


def format_prompt(problem: str, template: str = "paper", tokenizer=None, tools: Sequence[dict] | None = None) -> str:
    """The text fed to the sampler: 'paper' (question + the paper's instruction), 'chat' (that, as a user turn in
    the tokenizer's chat template, with the generation prompt) or 'raw' (the question alone). tools: JSON schemas
    the chat template lists for the model (Qwen2.5's template writes them into its hermes tool-use system prompt;
    a template without tool support ignores them)."""
    if template == "raw":
        return problem
    text = f"{problem}\n{PAPER_INSTRUCTION}"
    if template == "paper":
        return text
    if template == "chat":
        if tokenizer is None:
            raise ValueError("prompt_template 'chat' needs a tokenizer with a chat template")
        extra = {"tools": list(tools)} if tools else {}
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, **extra)
    raise ValueError(f"unknown prompt_template {template!r}; accepted: 'paper', 'chat', 'raw'")


def index_batches(num_rows: int, batch_size: int, *, seed: int = 0, shuffle: bool = True) -> grain.IterDataset:
    """An endless grain dataset of int32 row-index batches: a full permutation of the rows per epoch (reshuffled
    every epoch), batch_size indices per batch; the same on every process."""
    if num_rows < batch_size:
        raise DataError(f"the data has {num_rows} rows but a batch needs {batch_size}")
    ds = grain.MapDataset.source(np.arange(num_rows, dtype=np.int32))
    if shuffle:
        ds = ds.seed(seed).shuffle()
    ds = ds.repeat(None)
    return ds.batch(batch_size, drop_remainder=True).to_iter_dataset()


class PromptStream:
    """Checkpointable iterator over global batches of PromptRow (the same on every process).

    `state()` returns a JSON-able dict to store in the run checkpoint; `restore(state)` continues exactly there.
    """

    def __init__(self, rows: Sequence[PromptRow], batch_size: int, *, seed: int = 0, shuffle: bool = True):
        self.rows = list(rows)
        self._iter = iter(index_batches(len(self.rows), batch_size, seed=seed, shuffle=shuffle))

    def __iter__(self) -> Iterator[list[PromptRow]]:
        return self

    def __next__(self) -> list[PromptRow]:
        return [self.rows[int(i)] for i in next(self._iter)]

    def state(self) -> dict:
        return dict(self._iter.get_state())

    def restore(self, state: dict) -> None:
        self._iter.set_state(dict(state))
