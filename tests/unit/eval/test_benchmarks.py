"""Benchmark loading (errors name file and line), avg@N, unbiased pass@k vs brute-force enumeration, result
formatting and the default protocol table."""

import itertools
import json

import numpy as np
import pytest

from stare_jax.eval.benchmarks import (
    DEFAULT_PROTOCOL,
    avg_at_n,
    benchmark_metrics,
    format_results_json,
    format_results_markdown,
    load_benchmark,
    pass_at_k,
    pass_at_k_per_problem,
    protocol_for,
)


# ------------------------------------------------------------------------------------------- loading
def test_load_real_benchmarks(shared_data_dir):
    expected = {
        "aime24": 30,
        "aime25": 30,
        "amc23": 40,
        "math500": 500,
        "minerva": 272,
        "olympiadbench": 675,
        "gsm8k": 1319,
    }
    for name, n in expected.items():
        rows = load_benchmark(shared_data_dir / "math" / DEFAULT_PROTOCOL[name]["file"])
        assert len(rows) == n
        assert all(isinstance(r["answers"], list) and r["answers"] for r in rows)
    minerva = load_benchmark(shared_data_dir / "math" / "minerva.jsonl")
    assert sum(len(r["answers"]) > 1 for r in minerva) > 50  # Minerva lists acceptable alternatives


def _write(tmp_path, lines):
    p = tmp_path / "bench.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return p


def test_load_benchmark_ok_and_blank_lines(tmp_path):
    p = _write(
        tmp_path,
        [
            json.dumps({"id": "a", "problem": "1+1?", "answer": "2", "level": 1}),
            "",
            json.dumps({"id": "b", "problem": "2+2?", "answer": "4"}),
        ],
    )
    rows = load_benchmark(p)
    assert [r["id"] for r in rows] == ["a", "b"] and rows[0]["level"] == 1 and rows[1]["answers"] == ["4"]


@pytest.mark.parametrize(
    "bad_line, match",
    [
        ('{"id": "b", "problem": "x"', r"bench\.jsonl:2: invalid JSON"),
        ('{"id": "b", "problem": "x"}', r"bench\.jsonl:2: missing field 'answer'"),
        ('{"problem": "x", "answer": "1"}', r"bench\.jsonl:2: missing field 'id'"),
        ('{"id": "b", "problem": "x", "answer": 3}', r"bench\.jsonl:2: field 'answer' must be a string"),
        ("[1, 2]", r"bench\.jsonl:2: expected a JSON object"),
        ('{"id": "a", "problem": "x", "answer": "1"}', r"bench\.jsonl:2: duplicate id 'a' \(first on line 1\)"),
    ],
)
def test_load_benchmark_errors_name_file_and_line(tmp_path, bad_line, match):
    p = _write(tmp_path, [json.dumps({"id": "a", "problem": "p", "answer": "1"}), bad_line])
    with pytest.raises(ValueError, match=match):
        load_benchmark(p)


def test_load_benchmark_missing_or_empty_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        load_benchmark(tmp_path / "nope.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="no rows"):
        load_benchmark(tmp_path / "empty.jsonl")


# ------------------------------------------------------------------------------------------- metrics
def _pass_at_k_brute(correct_N: np.ndarray, k: int) -> float:
    """Fraction of all k-subsets of the N samples that contain at least one correct sample."""
    subsets = np.array(list(itertools.combinations(range(len(correct_N)), k)))
    return float(correct_N[subsets].max(axis=1).mean())


def test_pass_at_k_matches_brute_force_enumeration():
    rng = np.random.default_rng(0)
    for n in range(1, 11):
        for c in range(0, n + 1):
            correct = np.zeros(n)
            correct[rng.choice(n, size=c, replace=False)] = 1.0
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(_pass_at_k_brute(correct, k), abs=1e-12), (n, c, k)


def test_pass_at_k_edge_cases_and_errors():
    assert pass_at_k(32, 0, 8) == 0.0 and pass_at_k(32, 32, 1) == 1.0 and pass_at_k(32, 25, 8) == 1.0
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)
    for n, c, k in [(4, 5, 1), (4, 1, 0), (4, 1, 5), (4, -1, 1)]:
        with pytest.raises(ValueError, match="pass_at_k"):
            pass_at_k(n, c, k)


def test_avg_at_n_and_benchmark_metrics():
    correct = np.array([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
    assert avg_at_n(correct) == pytest.approx((0.5 + 0.0 + 1.0) / 3)
    lengths = np.array([[10, 20, 30, 40], [5, 5, 5, 5], [1, 2, 3, 4]])
    m = benchmark_metrics(correct, lengths, ks=(1, 2, 4))
    assert m["n_problems"] == 3 and m["n_samples"] == 4
    assert m["avg@4"] == pytest.approx(0.5) and m["pass@1"] == pytest.approx(0.5)
    want_p2 = np.mean([_pass_at_k_brute(row.astype(float), 2) for row in correct])
    assert m["pass@2"] == pytest.approx(want_p2)
    assert m["pass@4"] == pytest.approx(2 / 3)
    assert m["mean_response_len"] == pytest.approx(lengths.mean())
    np.testing.assert_allclose(pass_at_k_per_problem(correct, 4), [1.0, 0.0, 1.0])
    with pytest.raises(ValueError, match="pass@8"):
        benchmark_metrics(correct, ks=(8,))
    with pytest.raises(ValueError, match="shape"):
        benchmark_metrics(correct, lengths[:, :2])
    with pytest.raises(ValueError, match="0/1"):
        avg_at_n([[0.5]])
    with pytest.raises(ValueError, match="non-empty"):
        avg_at_n(np.zeros((0, 4)))


def test_formatters():
    results = {
        "aime24": benchmark_metrics(np.ones((2, 32)), np.full((2, 32), 1234.0), ks=(1, 8)),
        "math500": benchmark_metrics(np.array([[1, 0, 1, 1]]), ks=(1,)),
    }
    md = format_results_markdown(results)
    lines = md.strip().split("\n")
    assert lines[0].startswith("| benchmark | n_problems | n_samples | avg@32 | pass@1 | pass@8 | mean_response_len")
    assert lines[1].startswith("| --- |")
    assert lines[2].startswith("| aime24 | 2 | 32 | 1.0000 | 1.0000 | 1.0000 | 1234.0 |")
    assert "| math500 | 1 | 4 | - | 0.7500 | - | - | 0.7500 |" in md  # avg@4 is its own column
    assert json.loads(format_results_json(results)) == results
    with pytest.raises(ValueError):
        format_results_markdown({})


def test_default_protocol():
    assert {k: v["n"] for k, v in DEFAULT_PROTOCOL.items()} == {
        "aime24": 32,
        "aime25": 32,
        "amc23": 32,
        "math500": 4,
        "minerva": 4,
        "olympiadbench": 4,
        "gsm8k": 4,
    }
    assert all(v["temperature"] == 0.7 and v["top_p"] == 0.95 for v in DEFAULT_PROTOCOL.values())
    p = protocol_for("aime24")
    p["n"] = 1
    assert DEFAULT_PROTOCOL["aime24"]["n"] == 32
    with pytest.raises(ValueError, match="unknown benchmark 'aime26'"):
        protocol_for("aime26")
