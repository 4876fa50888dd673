"""benchmarks/harness.py: interleaving, statistics, ratios, the busy flag and the JSON record (tiny callables)."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "benchmarks"))
import harness  # noqa: E402


def test_interleave_alternates_sides_after_warmup():
    calls = []
    runs, loads = harness.interleave(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, repeats=3, warmup=2
    )
    assert calls == ["a", "a", "b", "b"] + ["a", "b"] * 3
    assert [len(r["times_s"]) for r in runs.values()] == [3, 3]
    assert len(loads) == 3 and all(len(la) == 3 for la in loads)


def test_summarize_and_ratios():
    assert harness.summarize([3.0, 1.0, 2.0]) == {"min_s": 1.0, "median_s": 2.0, "max_s": 3.0}
    runs = {"fast": {"times_s": [1.0, 2.0, 1.0]}, "ref": {"times_s": [2.0, 2.0, 4.0]}}
    r = harness.ratios(runs, "ref")
    assert set(r) == {"fast"}
    assert r["fast"]["ratio_of_medians"] == pytest.approx(2.0)
    assert r["fast"]["median_of_pair_ratios"] == pytest.approx(2.0)  # per round 2, 1, 4
    assert (r["fast"]["pair_ratio_min"], r["fast"]["pair_ratio_max"]) == (1.0, 4.0)


def test_is_busy():
    assert harness.is_busy([[2.5, 0, 0]], cores=2)
    assert not harness.is_busy([[2.0, 9, 9], [1.0, 9, 9]], cores=2)


def test_compare_record_is_json_ready(capsys, monkeypatch):
    monkeypatch.setattr(harness, "load_average", lambda: [0.5, 0.5, 0.5])
    res = harness.compare(
        {"x": lambda: sum(range(1000)), "y": lambda: sum(range(2000))},
        repeats=4,
        label="tiny",
        units=1000,
        unit_name="items",
    )
    assert res["reference"] == "y" and res["repeats"] == 4 and res["busy"] is False
    assert set(res["sides"]) == {"x", "y"} and set(res["ratios"]) == {"x"}
    for s in res["sides"].values():
        assert s["min_s"] <= s["median_s"] <= s["max_s"] and len(s["times_s"]) == 4
        assert s["items_per_s"] > 0
    for key in ("loadavg_before", "loadavg_after", "loadavg_peak_1m", "cpu_count", "cpus_usable", "threads"):
        assert key in res
    assert "env" in res["threads"]
    harness.emit({"benchmark": "t", "comparisons": [res]}, as_json=True)
    out, err = capsys.readouterr()
    rec = json.loads(out)
    assert rec["comparisons"][0]["label"] == "tiny" and "machine" in rec
    assert "[tiny]" in err and "ratio x / y" in err


def test_compare_warns_when_busy(capsys, monkeypatch):
    monkeypatch.setattr(harness, "load_average", lambda: [99.0, 99.0, 99.0])
    res = harness.compare({"a": lambda: None, "b": lambda: None}, repeats=1, label="loaded")
    assert res["busy"] is True
    assert "WARNING [loaded]" in capsys.readouterr().err


def test_compare_rejects_one_side():
    with pytest.raises(ValueError):
        harness.compare({"a": lambda: None}, repeats=1)


def test_thread_settings_report_imported_frameworks():
    import jax  # noqa: F401  (imported by conftest anyway)

    t = harness.thread_settings()
    assert t["jax"]["backend"] == "cpu" and t["jax"]["devices"] >= 1
