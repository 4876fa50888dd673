"""The rollout engine in a REAL multi-process run: 2 local processes x 4 CPU devices (jax.distributed, gloo) give
the same tokens as 1 process x 8 devices, through the replicated host scheduler (every process runs it on the same
host data; program inputs placed with distributed.global_from_host, decode results read back with
distributed.fetch_global) and the process-0 sandbox (tools.rollout.run_on_process0).

The processes run tests/system/_multihost_engine_worker.py (its docstring says what each writes): Engine.generate greedy
and temperature 1 with long-tailed lengths and Engine.generate_arrays on a data 2 x tensor 4 mesh, then
tool_rollouts with the local sandbox on a data 2 x fsdp 2 x tensor 2 mesh. Tokens, lengths, finish reasons,
masks and call statuses must be exactly equal; log-probs to 1e-5 (cross-process collectives may sum in another
order than in-process ones)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from support.multihost import REPO, Launch

WORKER = REPO / "tests" / "system" / "_multihost_engine_worker.py"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """1 x 8 and 2 x 4 launched together; {"ref": [process 0's result], "mp": [process 0's, process 1's]}."""
    import sys

    d = tmp_path_factory.mktemp("multihost_engine")
    t0 = time.time()
    ref = Launch("engine_1x8", d, 1, [sys.executable, str(WORKER), "--out", str(d / "ref")])
    mp = Launch("engine_2x4", d, 2, [sys.executable, str(WORKER), "--out", str(d / "mp")])
    ref.wait()
    mp.wait()
    print(f"engine launches took {time.time() - t0:.1f} s")
    load = lambda run, n: [json.loads((d / run / f"result_{i}.json").read_text()) for i in range(n)]  # noqa: E731
    return {"ref": load("ref", 1), "mp": load("mp", 2)}


def _same_generate(got: dict, want: dict) -> float:
    assert got["tokens"] == want["tokens"]
    assert got["lengths"] == want["lengths"] and got["finish"] == want["finish"]
    assert got["prefix_prefills"] == want["prefix_prefills"]
    a, b = (np.concatenate([np.asarray(x, np.float64) for x in r["logprobs"]]) for r in (got, want))
    np.testing.assert_allclose(a, b, atol=1e-5)
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def test_engine_generate_two_processes_equal_one_process(runs):
    (ref,), mp = runs["ref"], runs["mp"]
    assert [r["processes"] for r in mp] == [2, 2] and ref["processes"] == 1
    worst = 0.0
    for name in ("greedy", "t1"):
        lengths = ref[name]["lengths"]
        assert len(set(lengths)) >= 3 and max(lengths) == 16 and min(lengths) < 16  # long-tailed
        assert {"eos", "length"} <= set(ref[name]["finish"])
        for got in mp:  # each process holds the full result, equal to the single-process engine's
            worst = max(worst, _same_generate(got[name], ref[name]))
    for got in mp:
        assert got["arrays"] == ref["arrays"]
    # generate_arrays (the RL loop's call) draws what generate draws
    assert ref["arrays"]["lengths"] == ref["t1"]["lengths"]
    assert [t[:n] for t, n in zip(ref["arrays"]["tokens"], ref["arrays"]["lengths"])] == ref["t1"]["tokens"]
    print(f"max |log-prob 2x4 - 1x8| {worst:.3g}")


def test_tool_rollouts_two_processes_equal_one_process(runs):
    (ref,), mp = runs["ref"], runs["mp"]
    want = ref["tools"]
    statuses = [r["statuses"] for r in want["rows"]]
    assert statuses == [["ok"]] * 2 + [["invalid_json"]] * 2 + [["unknown_tool"]] * 2 + [["ok"]] * 2 + [[]] * 2
    assert "42" in want["texts"][0] and "45" in want["texts"][6]
    assert want["pool_calls"] == 4 and want["pages_free"]
    for got in mp:
        assert got["tools"]["rows"] == want["rows"] and got["tools"]["texts"] == want["texts"]
        assert got["tools"]["pages_free"]
    # the code ran on process 0 only; process 1 got the results by broadcast
    assert [got["tools"]["pool_calls"] for got in mp] == [4, 0]
