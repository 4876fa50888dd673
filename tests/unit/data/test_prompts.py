"""Prompt data: readers (jsonl/parquet) with file:line errors, prompt formatting, grain streams (shuffle per epoch,
per-process sharding, exact resume from the checkpointed iterator state)."""

import json

import pytest

from stare_jax.data.prompts import (
    PAPER_INSTRUCTION,
    DataError,
    PromptStream,
    format_prompt,
    read_rows,
)


def _jsonl(tmp_path, rows, name="d.jsonl"):
    p = tmp_path / name
    p.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return p


def test_reads_real_benchmark_files(shared_data_dir):
    rows = read_rows(shared_data_dir / "math" / "gsm8k_test.jsonl")
    assert len(rows) == 1319 and rows[0].answer == "18" and rows[0].where.endswith("gsm8k_test.jsonl:1")
    train = read_rows(shared_data_dir / "math" / "math_train.jsonl")
    assert len(train) == 7470 and all(r.problem and r.answer for r in train)


def test_missing_field_and_bad_json_name_file_and_line(tmp_path):
    p = _jsonl(tmp_path, [{"problem": "1+1?", "answer": "2"}, {"problem": "no answer"}])
    with pytest.raises(DataError, match=rf"{p}:2: row has no 'answer' field"):
        read_rows(p)
    p = _jsonl(tmp_path, [{"problem": "1+1?", "answer": "2"}, "", '{"problem": "x", "answer": '], "bad.jsonl")
    with pytest.raises(DataError, match=rf"{p}:3: invalid JSON"):
        read_rows(p)
    with pytest.raises(DataError, match="not found"):
        read_rows(tmp_path / "missing.jsonl")
    with pytest.raises(DataError, match="unsupported data file type"):
        read_rows(_jsonl(tmp_path, [{"problem": "a", "answer": "b"}], "d.csv"))
    with pytest.raises(DataError, match="'problem' must be a non-empty string"):
        read_rows(_jsonl(tmp_path, [{"problem": " ", "answer": "b"}], "e.jsonl"))


def test_custom_fields_and_numeric_answers(tmp_path):
    p = _jsonl(tmp_path, [{"question": "q1", "final": 3.0}, {"question": "q2", "final": 2.5}])
    rows = read_rows(p, prompt_field="question", answer_field="final")
    assert [r.answer for r in rows] == ["3", "2.5"]


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    p = tmp_path / "d.parquet"
    pq.write_table(pa.table({"problem": ["a", "b"], "answer": ["1", None]}), p)
    with pytest.raises(DataError, match=rf"{p}:row 1: row has no 'answer' field"):
        read_rows(p)
    pq.write_table(pa.table({"problem": ["a", "b"], "answer": ["1", "2"]}), p)
    assert [r.problem for r in read_rows(p)] == ["a", "b"]


def test_format_prompt():
    assert format_prompt("What is 2+2?") == "What is 2+2?\n" + PAPER_INSTRUCTION
    assert "\\boxed{}" in PAPER_INSTRUCTION
    assert format_prompt("q", "raw") == "q"

    class Tok:
        def apply_chat_template(self, messages, add_generation_prompt):
            assert add_generation_prompt
            return f"<user>{messages[0]['content']}</user><assistant>"

    assert format_prompt("q", "chat", Tok()) == f"<user>q\n{PAPER_INSTRUCTION}</user><assistant>"
    with pytest.raises(ValueError, match="accepted"):
        format_prompt("q", "fancy")


def _rows(n):
    from stare_jax.data.prompts import PromptRow

    return [PromptRow(id=str(i), problem=f"p{i}", answer=str(i), where=f"x:{i}") for i in range(n)]


def test_stream_epochs_are_permutations_and_reshuffled():
    rows = _rows(12)
    s = PromptStream(rows, 4, seed=7)
    epochs = [[r.id for _ in range(3) for r in next(s)] for _ in range(2)]
    assert all(sorted(e, key=int) == [str(i) for i in range(12)] for e in epochs)
    assert epochs[0] != epochs[1] and epochs[0] != [str(i) for i in range(12)]
    assert [r.id for r in next(PromptStream(rows, 4, shuffle=False))] == ["0", "1", "2", "3"]


def test_stream_too_few_rows_names_the_counts():
    with pytest.raises(DataError, match="the data has 3 rows but a batch needs 4"):
        PromptStream(_rows(3), 4)


def test_stream_resume_is_exact():
    rows = _rows(10)
    a = PromptStream(rows, 3, seed=3)
    for _ in range(4):
        next(a)
    state = a.state()
    expected = [[r.id for r in next(a)] for _ in range(5)]
    b = PromptStream(rows, 3, seed=3)
    b.restore(json.loads(json.dumps(state)))
    assert [[r.id for r in next(b)] for _ in range(5)] == expected
