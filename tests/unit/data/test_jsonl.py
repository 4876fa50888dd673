"""stare_jax.data.jsonl: the one JSON-lines reader (blank lines skipped, 1-based line numbers) and its errors naming
the file and line."""

import pytest

from stare_jax.data.jsonl import DataError, iter_jsonl_objects, iter_jsonl_values


def test_values_objects_and_errors_name_file_and_line(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"a": 1}\n\n[2]\n')
    assert list(iter_jsonl_values(p)) == [(1, {"a": 1}), (3, [2])]
    with pytest.raises(DataError, match=r"d\.jsonl:3: expected a JSON object, got list"):
        list(iter_jsonl_objects(p))
    p.write_text('{"a": 1}\n{"a": \n')
    with pytest.raises(DataError, match=r"d\.jsonl:2: invalid JSON \(Expecting value at column"):
        list(iter_jsonl_values(p))
