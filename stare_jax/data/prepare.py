"""Public math datasets from the Hugging Face hub as the project's jsonl files (`stare-jax data prepare`).

Every output row is {"id": str, "problem": str, "answer": str, "source": str, ...optional metadata}: the schema
stare_jax.eval.benchmarks.load_benchmark and stare_jax.data.prompts.read_rows accept, written under the file
names the benchmark protocol (eval.benchmarks.DEFAULT_PROTOCOL) and the configs expect (DATASETS below).

The datasets (the hub ids the public RL recipes, verl's examples/data_preprocess and TRL/open-r1, read), and how
each converter finds the answer:
  gsm8k          openai/gsm8k (main, test): the text after the last '####' of `answer`, commas removed.
  math_train     DigitalLearningGmbH/MATH-lighteval (train, the 7,500 MATH training problems): the content of the
                 last \\boxed{...} (or \\fbox{...}, `\\boxed 5`) of `solution`, braces balanced (nested
                 \\frac{1}{2} kept whole, escaped \\{ \\} skipped); `level` from "Level 5", `subject` from `type`.
  math500        HuggingFaceH4/MATH-500 (test): its `answer` column (the last \\boxed{} of `solution` where that
                 is empty); id = `unique_id`, `level`, `subject`.
  aime24         HuggingFaceH4/aime_2024 (train = the 30 problems of AIME 2024 I+II): `answer`.
  aime25         math-ai/aime25 (test): `answer`.
  amc23          math-ai/amc23 (test): `answer` (integer-valued floats written as integers).
  minerva        math-ai/minervamath (test): `answer`.
  olympiadbench  math-ai/olympiadbench (test, the 675 English text-only math problems): `final_answer`, a list,
                 joined with ", "; `context` (where set) before `question`; id "olympiadbench-<id>", `subfield`.
  dapo_math_17k  BytedTsinghua-SIA/DAPO-Math-17k (train): answer = reward_model.ground_truth; problem = the user
                 turn of `prompt` without DAPO's instruction boilerplate ("Solve the following math problem step
                 by step. The last line of your response should be of the form Answer: ..." before it and
                 "Remember to put your answer on its own line after "Answer:"." after it: our prompt template adds
                 its own instruction); id = extra_info.index. Repeats of a problem (the hub file holds copies)
                 are dropped and counted.
A row without an answer (or a problem) is skipped and counted by reason; a repeated id is skipped as well;
`stare-jax data prepare` prints the counts. Numbers are written as strings ("18", not 18.0).

Download: huggingface_hub alone (list the dataset repo's files, hf_hub_download the parquet/jsonl files the
registry names; hub cache, resumed downloads, HF_TOKEN / HF_ENDPOINT as usual), parquet read with pyarrow (a
core dependency) in record batches, jsonl line by line. Not `datasets`: it is a much larger install (pandas,
its own Arrow cache and builder machinery) for what is here one or two files per dataset, and huggingface_hub
already comes with transformers. It is the optional `data` extra (`pip install 'stare-jax[data]'`); without it
the download says so in one line. Converting a local copy (`--from-local`: a file in the hub's format, or a
folder laid out like the hub repo) needs no extra and no network.

Output files are written atomically (a temporary file in the same folder, then a rename).
"""

from __future__ import annotations

import collections
import dataclasses
import difflib
import fnmatch
import json
import os
import pathlib
import re
from typing import Any, Callable, Iterable, Iterator, Mapping

import pyarrow.parquet as pq

from stare_jax.data.boxed import last_boxed
from stare_jax.data.jsonl import DataError, iter_jsonl_objects

try:  # the optional 'data' extra: only download() needs it (a lazy-loading package, ~30 ms to import)
    import huggingface_hub as _hub
    from huggingface_hub.errors import HfHubHTTPError
    from huggingface_hub.utils import logging as _hub_logging

    # what a failed hub call raises: OSError (HfHubHTTPError, LocalEntryNotFoundError, OfflineModeIsEnabled) and
    # the HTTP client's base error that HfHubHTTPError extends (a refused connection while listing the files)
    _HUB_ERRORS: tuple[type[BaseException], ...] = (
        OSError,
        *(b for b in HfHubHTTPError.__bases__ if issubclass(b, BaseException)),
    )
except ImportError:
    _hub = None  # type: ignore[assignment]
    _hub_logging = None  # type: ignore[assignment]
    _HUB_ERRORS = (OSError,)

__all__ = [
    "DATASETS",
    "Dataset",
    "PrepareError",
    "PrepareResult",
    "SkipRow",
    "convert_rows",
    "dataset",
    "download",
    "gsm8k_answer",
    "local_files",
    "prepare",
    "prepare_command",
    "read_hub_rows",
    "resolve_names",
    "write_jsonl",
]


class PrepareError(ValueError):
    """A dataset that cannot be prepared: unknown name, missing package, failed download, unreadable or
    unconvertible file (the message names the fix)."""


class SkipRow(Exception):
    """Raised by a converter for a hub row that has no usable problem or answer; the message is the reason."""


# ----------------------------------------------------------------------------------------------------------
# Answer extraction
# ----------------------------------------------------------------------------------------------------------
def gsm8k_answer(text: str) -> str | None:
    """GSM8K's final answer: the text after the last '####' of the solution, commas removed (None without one)."""
    if "####" not in text:
        return None
    answer = text.rsplit("####", 1)[1].strip().replace(",", "")
    return answer or None


def _answer_text(value: Any) -> str:
    """A reference answer as a string: integer-valued floats as integers, lists joined with ", "."""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    if isinstance(value, (list, tuple)):
        return ", ".join(a for a in (_answer_text(v) for v in value) if a)
    return "" if value is None else str(value).strip()


def _field(row: Mapping[str, Any], *names: str) -> Any:
    """The first of `names` that row has (not None)."""
    for name in names:
        if row.get(name) is not None:
            return row[name]
    return None


def _problem(row: Mapping[str, Any], *names: str) -> str:
    text = _field(row, *names)
    if not isinstance(text, str) or not text.strip():
        raise SkipRow(f"no {names[0]!r}")
    return text.strip()


def _answer(value: Any, reason: str) -> str:
    text = _answer_text(value)
    if not text:
        raise SkipRow(reason)
    return text


def _level(value: Any) -> int | None:
    """MATH's level: 3, 3.0 or "Level 3" -> 3; anything else (e.g. "Level ?") -> None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    m = re.fullmatch(r"\s*(?:Level\s*)?(\d+)\s*", str(value or ""))
    return int(m.group(1)) if m else None


# ----------------------------------------------------------------------------------------------------------
# Converters: one hub row (and its 0-based position) -> our row, or SkipRow
# ----------------------------------------------------------------------------------------------------------
Row = dict[str, Any]
Converter = Callable[[Mapping[str, Any], int], Row]


def _row(id_: Any, problem: str, answer: str, source: str, **meta: Any) -> Row:
    out: Row = {"id": str(id_), "problem": problem, "answer": answer, "source": source}
    out.update({k: v for k, v in meta.items() if v is not None and v != ""})
    return out


def convert_gsm8k(row: Mapping[str, Any], index: int) -> Row:
    solution = _field(row, "answer")
    answer = gsm8k_answer(solution) if isinstance(solution, str) else None
    if answer is None:
        raise SkipRow("no '####' answer in 'answer'")
    return _row(f"gsm8k-{index}", _problem(row, "question"), answer, "GSM8K test")


def convert_math_train(row: Mapping[str, Any], index: int) -> Row:
    answer = _answer_text(_field(row, "answer")) or last_boxed(str(_field(row, "solution") or ""))
    if not answer:
        raise SkipRow("no \\boxed{} in 'solution'")
    subject = _field(row, "type", "subject")
    level = _level(_field(row, "level"))
    return _row(f"math-train-{index}", _problem(row, "problem"), answer, "MATH train", subject=subject, level=level)


def convert_math500(row: Mapping[str, Any], index: int) -> Row:
    answer = _answer_text(_field(row, "answer")) or last_boxed(str(_field(row, "solution") or ""))
    if not answer:
        raise SkipRow("no 'answer' (nor \\boxed{} in 'solution')")
    return _row(
        _field(row, "unique_id") or f"math500-{index}",
        _problem(row, "problem"),
        answer,
        "MATH-500",
        subject=_field(row, "subject"),
        level=_level(_field(row, "level")),
    )


def _competition(prefix: str, source: str) -> Converter:
    """AIME / AMC / Minerva rows: a problem (or question) and an answer column; id <prefix>-<position>."""

    def convert(row: Mapping[str, Any], index: int) -> Row:
        problem = _problem(row, "problem", "question")
        return _row(f"{prefix}-{index}", problem, _answer(_field(row, "answer"), "no 'answer'"), source)

    convert.__name__ = f"convert_{prefix}"
    return convert


def convert_olympiadbench(row: Mapping[str, Any], index: int) -> Row:
    question = _problem(row, "question", "problem")
    context = _field(row, "context")
    problem = f"{context.strip()}\n\n{question}" if isinstance(context, str) and context.strip() else question
    answer = _answer(_field(row, "final_answer", "answer"), "no 'final_answer'")
    id_ = _field(row, "id")
    return _row(
        f"olympiadbench-{index if id_ is None else id_}",
        problem,
        answer,
        "OlympiadBench",
        subfield=_field(row, "subfield"),
    )


_DAPO_PREFIX = re.compile(
    r"\A\s*Solve the following math problem step by step\..*?where \$Answer is the answer to the problem\.\s*", re.S
)
_DAPO_SUFFIX = re.compile(r"\s*Remember to put your answer on its own line after \"Answer:\"\.?\s*\Z")


def dapo_problem(content: str) -> str:
    """A DAPO-Math-17k prompt without its instruction boilerplate (text without it is returned stripped)."""
    return _DAPO_SUFFIX.sub("", _DAPO_PREFIX.sub("", content)).strip()


def convert_dapo(row: Mapping[str, Any], index: int) -> Row:
    turns = row.get("prompt")
    content = None
    if isinstance(turns, str):
        content = turns
    elif isinstance(turns, (list, tuple)):
        user = [t.get("content") for t in turns if isinstance(t, Mapping) and t.get("role", "user") == "user"]
        content = user[-1] if user else None
    problem = dapo_problem(content) if isinstance(content, str) else ""
    if not problem:
        raise SkipRow("no user turn in 'prompt'")
    reward = row.get("reward_model")
    answer = _answer(
        reward.get("ground_truth") if isinstance(reward, Mapping) else None, "no reward_model.ground_truth"
    )
    extra = row.get("extra_info")
    id_ = extra.get("index") if isinstance(extra, Mapping) else None
    return _row(f"dapo-{index}" if id_ is None else id_, problem, answer, "DAPO-Math-17k")


# ----------------------------------------------------------------------------------------------------------
# The registry
# ----------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Dataset:
    """One preparable dataset: its hub repo and split, the repo's data files (glob patterns, tried in order: the
    first that matches any file is used, all its matches read), the converter and the output file name."""

    name: str
    repo: str
    split: str
    files: tuple[str, ...]
    convert: Converter
    out_file: str
    dedupe_problems: bool = False  # drop rows whose problem text an earlier row had (counted as repeats)


DATASETS: dict[str, Dataset] = {
    d.name: d
    for d in (
        Dataset("gsm8k", "openai/gsm8k", "main/test", ("main/test-*.parquet",), convert_gsm8k, "gsm8k_test.jsonl"),
        Dataset(
            "math_train",
            "DigitalLearningGmbH/MATH-lighteval",
            "train",
            ("data/train-*.parquet",),
            convert_math_train,
            "math_train.jsonl",
        ),
        Dataset(
            "math500",
            "HuggingFaceH4/MATH-500",
            "test",
            ("test.jsonl", "data/test-*.parquet"),
            convert_math500,
            "math500.jsonl",
        ),
        Dataset(
            "aime24",
            "HuggingFaceH4/aime_2024",
            "train",
            ("data/train-*.parquet",),
            _competition("aime24", "AIME 2024"),
            "aime24.jsonl",
        ),
        Dataset(
            "aime25",
            "math-ai/aime25",
            "test",
            ("test.jsonl", "test-*.parquet", "data/test-*.parquet"),
            _competition("aime25", "AIME 2025"),
            "aime25.jsonl",
        ),
        Dataset(
            "amc23",
            "math-ai/amc23",
            "test",
            ("test.jsonl", "test-*.parquet", "data/test-*.parquet"),
            _competition("amc23", "AMC 2023"),
            "amc23.jsonl",
        ),
        Dataset(
            "minerva",
            "math-ai/minervamath",
            "test",
            ("test.jsonl", "test-*.parquet", "data/test-*.parquet"),
            _competition("minerva", "Minerva Math"),
            "minerva.jsonl",
        ),
        Dataset(
            "olympiadbench",
            "math-ai/olympiadbench",
            "test",
            ("test.jsonl", "test-*.parquet", "data/test-*.parquet"),
            convert_olympiadbench,
            "olympiadbench.jsonl",
        ),
        Dataset(
            "dapo_math_17k",
            "BytedTsinghua-SIA/DAPO-Math-17k",
            "train",
            ("data/*.parquet",),
            convert_dapo,
            "dapo_math_17k.jsonl",
            dedupe_problems=True,
        ),
    )
}


def dataset(name: str) -> Dataset:
    """The registered dataset `name` (PrepareError with a did-you-mean and the known names otherwise)."""
    if name in DATASETS:
        return DATASETS[name]
    close = difflib.get_close_matches(name, list(DATASETS), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise PrepareError(f"unknown dataset {name!r}{hint}; known: {', '.join(DATASETS)}, or all")


def resolve_names(names: Iterable[str]) -> list[str]:
    """The dataset names of a command line: 'all' is every registered one; order kept, repeats dropped."""
    out: list[str] = []
    for name in names:
        for n in DATASETS if name == "all" else [dataset(name).name]:
            if n not in out:
                out.append(n)
    if not out:
        raise PrepareError(f"no dataset named; give one or more of {', '.join(DATASETS)}, or all")
    return out


def prepare_command(path: str | os.PathLike[str]) -> str | None:
    """`stare-jax data prepare NAME --out DIR` for a missing file whose name a registered dataset writes, else
    None (used by the 'file not found' errors of the benchmark and training data readers)."""
    p = pathlib.PurePath(os.fspath(path))
    names = [d.name for d in DATASETS.values() if d.out_file == p.name]
    if not names:
        return None
    return f"stare-jax data prepare {names[0]} --out {p.parent}"


# ----------------------------------------------------------------------------------------------------------
# Reading hub files, converting, writing
# ----------------------------------------------------------------------------------------------------------
def read_hub_rows(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """The rows of a dataset file as the hub stores it: .parquet (pyarrow, in record batches) or .jsonl / .json
    (one JSON object per line; PrepareError naming the file and line for anything else)."""
    path = pathlib.Path(path)
    if path.suffix == ".parquet":
        try:
            for batch in pq.ParquetFile(path).iter_batches(batch_size=8192):
                yield from batch.to_pylist()
        except (OSError, ValueError) as e:  # pyarrow's ArrowInvalid is a ValueError, ArrowIOError an OSError
            raise PrepareError(f"{path}: not a readable parquet file ({e})") from None
    elif path.suffix in (".jsonl", ".json"):
        try:
            yield from (row for _, row in iter_jsonl_objects(path))
        except DataError as e:  # the same message, as this command's error
            raise PrepareError(str(e)) from None
    else:
        raise PrepareError(f"{path}: unsupported file type {path.suffix!r} (the hub's .parquet or .jsonl)")


@dataclasses.dataclass
class PrepareResult:
    """What one dataset's preparation did: the rows kept, the skipped rows by reason, the repeats dropped."""

    name: str
    rows: list[Row]
    skipped: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)
    repeats: int = 0
    path: pathlib.Path | None = None

    def skipped_text(self) -> str:
        """'skipped N rows that could not be converted (n reason, ...)' and 'dropped N repeated problems', or ''."""
        parts = []
        if self.skipped:
            reasons = ", ".join(f"{n} {why}" for why, n in self.skipped.most_common())
            parts.append(f"skipped {sum(self.skipped.values())} rows that could not be converted ({reasons})")
        if self.repeats:
            parts.append(f"dropped {self.repeats} repeated problems")
        return "; ".join(parts)

    def summary(self) -> str:
        """One line: rows written and where, then skipped_text."""
        text = f"{self.name}: wrote {len(self.rows)} rows" + (f" to {self.path}" if self.path else "")
        skipped = self.skipped_text()
        return f"{text}; {skipped}" if skipped else text


def convert_rows(spec: Dataset, rows: Iterable[Mapping[str, Any]]) -> PrepareResult:
    """The rows of one dataset converted by its converter: rows it rejects are counted by reason, a repeated id
    is skipped (counted), a repeated problem dropped where the dataset repeats its problems."""
    result = PrepareResult(spec.name, [])
    ids: set[str] = set()
    problems: set[str] = set()
    for index, hub_row in enumerate(rows):
        try:
            row = spec.convert(hub_row, index)
        except SkipRow as e:
            result.skipped[str(e)] += 1
            continue
        if spec.dedupe_problems:
            if row["problem"] in problems:
                result.repeats += 1
                continue
            problems.add(row["problem"])
        if row["id"] in ids:
            result.skipped["repeated id"] += 1
            continue
        ids.add(row["id"])
        result.rows.append(row)
    return result


def write_jsonl(path: str | os.PathLike[str], rows: Iterable[Mapping[str, Any]]) -> pathlib.Path:
    """Write rows as JSON lines to path atomically (a temporary file beside it, then a rename); the folder is
    created. Returns the path."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with tmp.open("w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _matching(patterns: tuple[str, ...], files: Iterable[str]) -> list[str]:
    """The files of the first pattern that matches any (sorted), else []."""
    files = list(files)
    for pattern in patterns:
        hits = sorted(f for f in files if fnmatch.fnmatchcase(f, pattern))
        if hits:
            return hits
    return []


def local_files(spec: Dataset, path: str | os.PathLike[str]) -> list[pathlib.Path]:
    """The data files of a local copy: path itself when it is a file, else the files of a folder laid out like
    the hub repo (e.g. `hf download --repo-type dataset REPO --local-dir DIR`) that match the registry's patterns."""
    path = pathlib.Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise PrepareError(f"--from-local {path}: no such file or folder")
    listing = [p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()]
    found = _matching(spec.files, listing)
    if not found:
        raise PrepareError(
            f"--from-local {path}: no file matching {' or '.join(spec.files)} in it (the layout of {spec.repo}); "
            f"give the data file itself"
        )
    return [path / f for f in found]


def download(spec: Dataset) -> list[pathlib.Path]:
    """The dataset's data files downloaded from the hub (through the hub cache): the repo's files matching the
    registry's patterns. PrepareError naming the extra to install, or the failure and the offline way out."""
    if _hub is None:
        raise PrepareError(
            "downloading from the Hugging Face hub needs huggingface_hub: pip install 'stare-jax[data]' "
            "(or convert a local copy with --from-local)"
        ) from None
    # the hub client's own retry and request warnings would bury the one line that says what failed
    _hub_logging.set_verbosity_error()
    try:
        listing = _hub.list_repo_files(spec.repo, repo_type="dataset")
        found = _matching(spec.files, listing)
        if not found:
            raise PrepareError(
                f"{spec.repo} on the hub has no file matching {' or '.join(spec.files)} (its layout changed?): "
                f"download its {spec.split} data file yourself and pass it with --from-local"
            )
        paths = []
        for filename in found:
            local = _hub.hf_hub_download(spec.repo, filename, repo_type="dataset")
            paths.append(pathlib.Path(local if isinstance(local, str) else str(local)))
        return paths
    except _HUB_ERRORS as e:
        reason = " ".join(str(e).split())[:300] or type(e).__name__
        raise PrepareError(
            f"could not download {spec.repo} from the Hugging Face hub ({reason}); check the network "
            f"(HF_ENDPOINT, HF_TOKEN, HF_HUB_OFFLINE), or convert a local copy with --from-local"
        ) from None


def prepare(
    name: str,
    out_dir: str | os.PathLike[str],
    *,
    from_local: str | os.PathLike[str] | None = None,
) -> PrepareResult:
    """Download (or, with from_local, read a local copy of) dataset `name`, convert it and write
    out_dir/<its output file>. PrepareError when nothing converts (no file is written then)."""
    spec = dataset(name)
    files = local_files(spec, from_local) if from_local is not None else download(spec)
    result = convert_rows(spec, (row for f in files for row in read_hub_rows(f)))
    if not result.rows:
        raise PrepareError(
            f"{name}: no row of {', '.join(map(str, files))} could be converted "
            f"({result.skipped_text() or 'no rows'}); is it {spec.repo}'s {spec.split} split?"
        )
    result.path = write_jsonl(pathlib.Path(out_dir) / spec.out_file, result.rows)
    return result
