"""stare_jax.data.prepare: every registered dataset's converter on a small file in that hub dataset's own format
(its columns, jsonl or parquet as the hub stores it, at the path the hub repo has), read back with the project's
readers; the answer extraction (GSM8K '####', the last balanced \\boxed{}, DAPO's ground truth and prompt); skipped
and repeated rows counted; the registry's names and errors; the download through a stand-in for huggingface_hub.
No network."""

import json
import types

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from stare_jax.data import prepare as prep
from stare_jax.data.prepare import (
    DATASETS,
    PrepareError,
    dapo_problem,
    dataset,
    gsm8k_answer,
    prepare,
    prepare_command,
    resolve_names,
    write_jsonl,
)
from stare_jax.data.prompts import DataError, read_rows
from stare_jax.eval.benchmarks import DEFAULT_PROTOCOL, load_benchmark

DAPO_PROMPT = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{}\n\n"
    'Remember to put your answer on its own line after "Answer:".'
)


def _olympiad(id_, question, final_answer, **extra):
    row = {
        "id": id_,
        "question": question,
        "solution": ["..."],
        "final_answer": final_answer,
        "context": None,
        "image_1": None,
        "modality": "Text-only",
        "difficulty": "Competition",
        "is_multiple_answer": len(final_answer or []) > 1,
        "unit": None,
        "answer_type": "Numerical",
        "error": None,
        "question_type": "Open-ended",
        "subfield": "Combinatorics",
        "subject": "Math",
        "language": "English",
    }
    return {**row, **extra}


def _dapo(problem, truth, index):
    return {
        "data_source": "math_dapo",
        "prompt": [{"content": DAPO_PROMPT.format(problem), "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": truth, "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": index},
    }


# name -> (path in the hub repo, hub rows, expected (id, problem, answer) of the rows written, skipped, repeats)
HUB = {
    "gsm8k": (
        "main/test-00000-of-00001.parquet",
        [
            {"question": "Janet has 1,200 eggs and buys 34 more. How many?", "answer": "1200+34=1234\n#### 1,234"},
            {"question": "A robe takes 2 bolts and half that. Total?", "answer": "2+1=3 #### 3"},
            {"question": "No final answer here?", "answer": "some reasoning without the marker"},
            {"question": "Negative?", "answer": "#### -5"},
        ],
        [
            ("gsm8k-0", "Janet has 1,200 eggs and buys 34 more. How many?", "1234"),
            ("gsm8k-1", "A robe takes 2 bolts and half that. Total?", "3"),
            ("gsm8k-3", "Negative?", "-5"),
        ],
        1,
        0,
    ),
    "math_train": (
        "data/train-00000-of-00001.parquet",
        [
            {
                "problem": "Compute $\\frac{2}{4}$.",
                "level": "Level 2",
                "type": "Prealgebra",
                "solution": "We have $\\boxed{3}$ at first, but really $\\frac24=\\boxed{\\frac{1}{2}}$.",
            },
            {
                "problem": "Which set?",
                "level": "Level ?",
                "type": "Algebra",
                "solution": "The set is $\\boxed{\\{1,2\\}}$.",
            },
            {"problem": "No box.", "level": "Level 1", "type": "Algebra", "solution": "The answer is 4."},
            {"problem": "Bare box.", "level": "Level 5", "type": "Geometry", "solution": "So $\\boxed 7$."},
        ],
        [
            ("math-train-0", "Compute $\\frac{2}{4}$.", "\\frac{1}{2}"),
            ("math-train-1", "Which set?", "\\{1,2\\}"),
            ("math-train-3", "Bare box.", "7"),
        ],
        1,
        0,
    ),
    "math500": (
        "test.jsonl",
        [
            {
                "problem": "Convert $(0,3)$ to polar coordinates.",
                "solution": "... $\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}$",
                "answer": "\\left( 3, \\frac{\\pi}{2} \\right)",
                "subject": "Precalculus",
                "level": 2,
                "unique_id": "test/precalculus/807.json",
            },
            {
                "problem": "Only a solution.",
                "solution": "so $\\boxed{\\frac{\\sqrt{3}}{2}}$.",
                "answer": "",
                "subject": "Geometry",
                "level": 3,
                "unique_id": "test/geometry/1.json",
            },
        ],
        [
            (
                "test/precalculus/807.json",
                "Convert $(0,3)$ to polar coordinates.",
                "\\left( 3, \\frac{\\pi}{2} \\right)",
            ),
            ("test/geometry/1.json", "Only a solution.", "\\frac{\\sqrt{3}}{2}"),
        ],
        0,
        0,
    ),
    "aime24": (
        "data/train-00000-of-00001.parquet",
        [
            {"id": 60, "problem": "Aya walks.", "solution": "...", "answer": "204", "url": "u", "year": "2024"},
            {"id": 67, "problem": "Leading zero.", "solution": "...", "answer": "025", "url": "u", "year": "2024"},
            {"id": 68, "problem": "No answer.", "solution": "...", "answer": None, "url": "u", "year": "2024"},
        ],
        [("aime24-0", "Aya walks.", "204"), ("aime24-1", "Leading zero.", "025")],
        1,
        0,
    ),
    "aime25": (
        "test.jsonl",
        [
            {"problem": "Find the sum of all integer bases $b>9$.", "answer": "70", "id": "0"},
            {"problem": "Heptagon area.", "answer": 588, "id": "1"},
        ],
        [("aime25-0", "Find the sum of all integer bases $b>9$.", "70"), ("aime25-1", "Heptagon area.", "588")],
        0,
        0,
    ),
    "amc23": (
        "test.jsonl",
        [
            {"id": 0, "question": "Cities $A$ and $B$ are $45$ miles apart.", "answer": 27.0, "url": "u"},
            {"id": 1, "question": "Real numbers $x$ and $y$.", "answer": 36.0, "url": "u"},
            {"id": 2, "question": "A fraction?", "answer": 2.5, "url": "u"},
        ],
        [
            ("amc23-0", "Cities $A$ and $B$ are $45$ miles apart.", "27"),
            ("amc23-1", "Real numbers $x$ and $y$.", "36"),
            ("amc23-2", "A fraction?", "2.5"),
        ],
        0,
        0,
    ),
    "minerva": (
        "test.jsonl",
        [
            {"question": "Estimate the wavelength in Angstroms.", "answer": "9.6\n"},
            {"question": "Two forms.", "answer": "6630.65\n, 6630\n"},
            {"question": "   ", "answer": "1"},
        ],
        [("minerva-0", "Estimate the wavelength in Angstroms.", "9.6"), ("minerva-1", "Two forms.", "6630.65\n, 6630")],
        1,
        0,
    ),
    "olympiadbench": (
        "test.jsonl",
        [
            _olympiad(1606, "How many moves does Sergey need?", ["2"]),
            _olympiad(1610, "Find all pairs.", ["$(2,4)$", "$(4,2)$"]),
            _olympiad(1611, "Given the context, find $x$.", ["$3$"], context="Let $x+1=4$."),
            _olympiad(1612, "A proof with no final answer.", []),
        ],
        [
            ("olympiadbench-1606", "How many moves does Sergey need?", "2"),
            ("olympiadbench-1610", "Find all pairs.", "$(2,4)$, $(4,2)$"),
            ("olympiadbench-1611", "Let $x+1=4$.\n\nGiven the context, find $x$.", "$3$"),
        ],
        1,
        0,
    ),
    "dapo_math_17k": (
        "data/dapo-math-17k.parquet",
        [
            _dapo("In triangle $ABC$, find $k+m+n$.", "34", "9a9b6eb4-a1cb-49d1-8c1e-62eaf2f74079"),
            _dapo("How many primes are below 20?", "8", "b426d104-244d-4831-a2c4-cd756b61700a"),
            _dapo("In triangle $ABC$, find $k+m+n$.", "34", "9a9b6eb4-a1cb-49d1-8c1e-62eaf2f74079"),
            _dapo("How many primes are below 20?", "8", "b426d104-244d-4831-a2c4-cd756b61700a"),
            _dapo("A problem without a ground truth.", "", "c0ffee00-0000-0000-0000-000000000000"),
        ],
        [
            ("9a9b6eb4-a1cb-49d1-8c1e-62eaf2f74079", "In triangle $ABC$, find $k+m+n$.", "34"),
            ("b426d104-244d-4831-a2c4-cd756b61700a", "How many primes are below 20?", "8"),
        ],
        1,
        2,
    ),
}


def _write_hub_file(root, name):
    """The fixture of dataset `name` at its path under root (a folder laid out like the hub repo)."""
    relpath, rows, *_ = HUB[name]
    path = root / relpath
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_every_registered_dataset_has_a_hub_format_fixture():
    assert set(HUB) == set(DATASETS)


@pytest.mark.parametrize("name", list(DATASETS))
def test_converts_the_hub_format_to_our_schema(name, tmp_path):
    spec = DATASETS[name]
    hub_file = _write_hub_file(tmp_path / "hub", name)
    _, rows, expected, n_skipped, n_repeats = HUB[name]
    # the hub's parquet where the hub has parquet
    assert hub_file.suffix == (".parquet" if spec.files[0].endswith(".parquet") else ".jsonl")
    out = tmp_path / "out"
    for source in (tmp_path / "hub", hub_file):  # a folder laid out like the hub repo, or the file itself
        result = prepare(name, out, from_local=source)
        assert result.path == out / spec.out_file
        assert sum(result.skipped.values()) == n_skipped and result.repeats == n_repeats
        assert len(result.rows) == len(rows) - n_skipped - n_repeats
    written = [json.loads(line) for line in (out / spec.out_file).read_text().splitlines()]
    assert [(r["id"], r["problem"], r["answer"]) for r in written] == expected
    for r in written:
        assert list(r)[:4] == ["id", "problem", "answer", "source"] and all(isinstance(r[k], str) for k in list(r)[:4])
    # the project's readers accept the output: eval's benchmark loader and training's row reader
    assert [r.answer for r in read_rows(out / spec.out_file)] == [e[2] for e in expected]
    assert [r["answer"] for r in load_benchmark(out / spec.out_file)] == [e[2] for e in expected]
    assert not list(out.glob(".*tmp*"))  # the temporary file was renamed


def test_metadata_fields():
    """MATH keeps its level (an int) and subject, OlympiadBench its subfield, each row its source."""
    rows = {name: prep.convert_rows(DATASETS[name], HUB[name][1]).rows for name in ("math_train", "math500")}
    assert rows["math_train"][0] == {
        "id": "math-train-0",
        "problem": "Compute $\\frac{2}{4}$.",
        "answer": "\\frac{1}{2}",
        "source": "MATH train",
        "subject": "Prealgebra",
        "level": 2,
    }
    assert "level" not in rows["math_train"][1]  # "Level ?"
    assert rows["math500"][0]["level"] == 2 and rows["math500"][0]["source"] == "MATH-500"
    olymp = prep.convert_rows(DATASETS["olympiadbench"], HUB["olympiadbench"][1]).rows
    assert olymp[0]["subfield"] == "Combinatorics" and olymp[0]["source"] == "OlympiadBench"
    sources = {name: prep.convert_rows(DATASETS[name], HUB[name][1]).rows[0]["source"] for name in DATASETS}
    assert sources["gsm8k"] == "GSM8K test" and sources["aime24"] == "AIME 2024" and sources["amc23"] == "AMC 2023"


def test_skipped_rows_are_counted_by_reason():
    result = prep.convert_rows(DATASETS["gsm8k"], HUB["gsm8k"][1])
    assert dict(result.skipped) == {"no '####' answer in 'answer'": 1}
    assert "skipped 1 rows that could not be converted (1 no '####' answer in 'answer')" in result.summary()
    dapo = prep.convert_rows(DATASETS["dapo_math_17k"], HUB["dapo_math_17k"][1])
    assert dict(dapo.skipped) == {"no reward_model.ground_truth": 1} and dapo.repeats == 2
    assert "dropped 2 repeated problems" in dapo.summary()
    # a repeated id (not a repeated problem) is skipped and counted
    rows = [{"problem": "a", "answer": "1", "id": "x"}] * 2
    assert dict(prep.convert_rows(DATASETS["aime25"], rows).skipped) == {}  # aime25 ids are positions
    math500 = [{"problem": p, "answer": "1", "unique_id": "same"} for p in ("a", "b")]
    assert dict(prep.convert_rows(DATASETS["math500"], math500).skipped) == {"repeated id": 1}


def test_nothing_converted_is_an_error_and_writes_nothing(tmp_path):
    bad = tmp_path / "test.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    with pytest.raises(PrepareError, match=r"gsm8k: no row of .* could be converted \(skipped 1 rows"):
        prepare("gsm8k", tmp_path / "out", from_local=bad)
    assert not (tmp_path / "out" / "gsm8k_test.jsonl").exists()


def test_gsm8k_answer_and_dapo_problem():
    assert gsm8k_answer("work\n#### 1,234,567") == "1234567"
    assert gsm8k_answer("#### 3.5 ") == "3.5"
    assert gsm8k_answer("a #### b #### 7") == "7"
    assert gsm8k_answer("no marker") is None and gsm8k_answer("####  ") is None
    assert dapo_problem(DAPO_PROMPT.format("What is $1+1$?")) == "What is $1+1$?"
    assert dapo_problem("  A prompt in another form.  ") == "A prompt in another form."


def test_registry_names_and_errors():
    assert resolve_names(["all"]) == list(DATASETS)
    assert resolve_names(["math500", "gsm8k", "math500"]) == ["math500", "gsm8k"]
    with pytest.raises(PrepareError, match=r"unknown dataset 'math501' \(did you mean 'math500'\?\); known: gsm8k"):
        dataset("math501")
    with pytest.raises(PrepareError, match="unknown dataset 'zzz'; known"):
        resolve_names(["gsm8k", "zzz"])
    # the benchmark protocol's names and files are the registry's
    for name, proto in DEFAULT_PROTOCOL.items():
        assert DATASETS[name].out_file == proto["file"]
    assert DATASETS["math_train"].out_file == "math_train.jsonl"


def test_missing_file_errors_name_the_command(tmp_path):
    assert prepare_command("data/math/math500.jsonl") == "stare-jax data prepare math500 --out data/math"
    assert prepare_command("elsewhere/own.jsonl") is None
    missing = tmp_path / "data" / "math" / "gsm8k_test.jsonl"
    with pytest.raises(
        DataError, match=f"data file not found: .*`stare-jax data prepare gsm8k --out {missing.parent}`"
    ):
        read_rows(missing)
    with pytest.raises(FileNotFoundError, match="`stare-jax data prepare aime24 --out "):
        load_benchmark(tmp_path / "aime24.jsonl")


def test_local_copy_errors(tmp_path):
    with pytest.raises(PrepareError, match="--from-local .*nope: no such file or folder"):
        prepare("aime25", tmp_path / "out", from_local=tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(PrepareError, match="no file matching test.jsonl or"):
        prepare("aime25", tmp_path / "out", from_local=tmp_path / "empty")
    (tmp_path / "bad.jsonl").write_text('{"problem": "x", "answer": "1"}\n[1, 2]\n')
    with pytest.raises(PrepareError, match=r"bad.jsonl:2: expected a JSON object"):
        prepare("aime25", tmp_path / "out", from_local=tmp_path / "bad.jsonl")
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(PrepareError, match="not a readable parquet file"):
        prepare("aime24", tmp_path / "out", from_local=tmp_path / "bad.parquet")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(PrepareError, match="unsupported file type '.csv'"):
        prepare("aime24", tmp_path / "out", from_local=tmp_path / "x.csv")


def test_write_is_atomic(tmp_path):
    path = tmp_path / "sub" / "f.jsonl"
    write_jsonl(path, [{"id": "1"}])

    def failing():
        yield {"id": "2"}
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        write_jsonl(path, failing())
    assert path.read_text() == '{"id": "1"}\n' and [p.name for p in path.parent.iterdir()] == ["f.jsonl"]


def test_download_through_the_hub(tmp_path, monkeypatch):
    """download() lists the repo's files, fetches those of the first pattern that matches, and converts them; the
    hub's failures and a missing huggingface_hub are one-line PrepareErrors."""
    hub_root = tmp_path / "hub"
    _write_hub_file(hub_root, "aime25")
    calls = []

    def hf_hub_download(repo_id, filename, *, repo_type):
        calls.append((repo_id, filename, repo_type))
        return str(hub_root / filename)

    listing = ["README.md", ".gitattributes", "test.jsonl"]
    fake = types.SimpleNamespace(list_repo_files=lambda repo, repo_type: listing, hf_hub_download=hf_hub_download)
    monkeypatch.setattr(prep, "_hub", fake)
    result = prepare("aime25", tmp_path / "out")
    assert calls == [("math-ai/aime25", "test.jsonl", "dataset")]
    assert result.summary() == f"aime25: wrote 2 rows to {tmp_path / 'out' / 'aime25.jsonl'}"

    listing[:] = ["README.md"]
    with pytest.raises(PrepareError, match="math-ai/aime25 on the hub has no file matching .* --from-local"):
        prep.download(DATASETS["aime25"])

    def offline(repo, repo_type):
        raise ConnectionError("[Errno -2] Name or service not known")

    monkeypatch.setattr(fake, "list_repo_files", offline)
    with pytest.raises(
        PrepareError, match=r"could not download math-ai/aime25 .*Name or service not known.*--from-local"
    ):
        prep.download(DATASETS["aime25"])

    monkeypatch.setattr(prep, "_hub", None)
    with pytest.raises(PrepareError, match=r"needs huggingface_hub: pip install 'stare-jax\[data\]'"):
        prepare("aime25", tmp_path / "out")
