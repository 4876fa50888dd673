"""RewardPool: same scores as in-process scoring, and survival of hostile outputs, hangs, crashes, errors and
memory blow-ups (each scores 0, is counted, and the pool keeps working)."""

import json
import os
import pathlib
import signal
import threading
import time

import pytest

from stare_jax.rewards.math import score
from stare_jax.rewards.pool import RewardPool
from support.rewards import misbehaving_score

TIMEOUT_S = 3.0
GRACE_S = 1.0
CASES = pathlib.Path(__file__).resolve().parents[2] / "data" / "reward_cases.jsonl"


@pytest.fixture(scope="module")
def pool():
    with RewardPool(num_workers=2, timeout_s=TIMEOUT_S, memory_mb=1024, kill_grace_s=GRACE_S) as p:
        yield p


@pytest.fixture(scope="module")
def test_pool():
    """A pool whose workers run tests/support/rewards.misbehaving_score (sleep/hang/raise/alloc/die)."""
    with RewardPool(num_workers=2, timeout_s=1.5, memory_mb=512, kill_grace_s=2.0, score_fn=misbehaving_score) as p:
        yield p


def _normal_check(p):
    scores, stats = p.score_batch(["\\boxed{\\frac{1}{2}}", "\\boxed{3}", "\\boxed{4}"], ["0.5", "3", "5"])
    assert scores == [1.0, 1.0, 0.0]
    assert stats["n_ok"] == 3 and stats["n_correct"] == 2


def test_pool_matches_in_process_scoring(pool):
    with CASES.open() as f:
        cases = [json.loads(line) for line in f][::8]
    responses = [c["response"] for c in cases]
    references = [c["reference"] for c in cases]
    scores, stats = pool.score_batch(responses, references)
    assert scores == [score(r, ref) for r, ref in zip(responses, references)]
    assert scores == [float(c["verdict"]) for c in cases]
    assert stats["n_items"] == len(cases) == stats["n_ok"]
    assert stats["n_timeout"] == stats["n_crash"] == stats["n_error"] == 0


def test_pool_accepts_lists_of_alternatives(pool):
    scores, _ = pool.score_batch(["\\boxed{-1/3}", "\\boxed{1/3}"], [["-\\frac{1}{3}", "-1/3"]] * 2)
    assert scores == [1.0, 0.0]


def test_pool_empty_batch_and_bad_input(pool):
    scores, stats = pool.score_batch([], [])
    assert scores == [] and stats["n_items"] == 0
    with pytest.raises(ValueError, match="2 responses but 1 references"):
        pool.score_batch(["a", "b"], ["1"])
    with pytest.raises(ValueError, match=r"responses\[1\]"):
        pool.score_batch(["a", None], ["1", "2"])


@pytest.mark.parametrize(
    "name, response",
    [
        ("1MB", "The answer is " + "9" * 1_000_000),
        ("1MB_boxed", "\\boxed{" + "1+" * 500_000 + "1}"),
        ("nested_braces", "\\boxed{" + "{" * 10_000 + "1" + "}" * 10_000 + "}"),
        ("power_tower", "\\boxed{9^{9^{9^{9}}}}"),
        ("dunder_import", "\\boxed{__import__('os').system('touch {marker}')}"),
        ("import_os", "import os\nos.system('touch {marker}')\n\\boxed{import os; os.system('touch {marker}')}"),
    ],
)
def test_adversarial_outputs_score_zero_within_timeout(pool, tmp_path, name, response):
    marker = tmp_path / "pwned"
    response = response.replace("{marker}", str(marker))
    scores, stats = pool.score_batch([response], ["1"])
    assert scores == [0.0]
    assert stats["wall_s"] < TIMEOUT_S + GRACE_S + 2.0
    assert stats["n_crash"] == 0
    assert not marker.exists()
    _normal_check(pool)  # the pool survives and still scores correctly


def test_hung_worker_is_interrupted_and_counted(test_pool):
    scores, stats = test_pool.score_batch(["sleep:30", "\\boxed{2}"], ["1", "2"])
    assert scores == [0.0, 1.0]
    assert stats["n_timeout"] == 1 and stats["n_restarts"] == 0  # the in-worker alarm caught it
    assert stats["wall_s"] < 1.5 + 2.0 + 2.0


def test_worker_ignoring_its_alarm_is_killed_and_replaced(test_pool):
    test_pool.wait_ready()
    pids_before = set(test_pool.worker_pids())
    # Items 2, 4, 6 are queued behind the hanging item 0 on the same worker: they are re-dispatched.
    responses = ["hang:30"] + [f"\\boxed{{{k}}}" for k in range(1, 8)]
    scores, stats = test_pool.score_batch(responses, ["1"] + [str(k) for k in range(1, 8)])
    assert scores == [0.0] + [1.0] * 7
    assert stats["n_timeout"] == 1 and stats["n_restarts"] == 1 and stats["timeout_idx"] == [0]
    assert len(set(test_pool.worker_pids()) - pids_before) == 1
    _normal_check(test_pool)


def test_large_items_are_not_queued_behind_busy_workers(pool):
    """Items bigger than the pipe budget go one at a time (a queued send could block the parent)."""
    responses = ["x" * 40_000 + f" \\boxed{{{k}}}" for k in range(6)]
    scores, stats = pool.score_batch(responses, [str(k) for k in range(6)])
    assert scores == [1.0] * 6 and stats["n_ok"] == 6


def test_worker_killed_mid_item_counts_as_crash_and_is_replaced(test_pool, tmp_path):
    test_pool.wait_ready()  # so items 0 and 1 go to different workers
    pids_before = test_pool.worker_pids()
    marks = [tmp_path / "a", tmp_path / "b"]

    def kill_when_both_busy():  # SIGKILL both workers from outside once each is inside its item
        deadline = time.monotonic() + 10.0
        while not all(m.exists() for m in marks) and time.monotonic() < deadline:
            time.sleep(0.01)
        for pid in pids_before:
            os.kill(pid, signal.SIGKILL)

    killer = threading.Thread(target=kill_when_both_busy)
    killer.start()
    responses = [f"mark_then_sleep:1.2:{marks[0]}", f"mark_then_sleep:1.2:{marks[1]}", "\\boxed{7}"]
    scores, stats = test_pool.score_batch(responses, ["1", "1", "7"])
    killer.join()
    assert scores == [0.0, 0.0, 1.0]
    assert stats["n_crash"] == 2 and stats["n_restarts"] == 2 and stats["crash_idx"] == [0, 1]
    assert set(test_pool.worker_pids()).isdisjoint(pids_before)
    _normal_check(test_pool)


def test_worker_dying_by_itself_counts_as_crash(test_pool):
    scores, stats = test_pool.score_batch(["die", "\\boxed{5}"], ["1", "5"])
    assert scores == [0.0, 1.0]
    assert stats["n_crash"] == 1


def test_worker_killed_while_idle_is_replaced_without_losing_items(test_pool):
    os.kill(test_pool.worker_pids()[0], signal.SIGKILL)
    time.sleep(0.2)
    scores, stats = test_pool.score_batch(["\\boxed{1}", "\\boxed{2}", "\\boxed{3}"], ["1", "2", "3"])
    assert scores == [1.0, 1.0, 1.0]
    assert stats["n_crash"] == 0 and stats["n_ok"] == 3


def test_errors_and_memory_blowups_score_zero_and_worker_survives(test_pool):
    pids_before = test_pool.worker_pids()
    scores, stats = test_pool.score_batch(["raise", "alloc:4096", "\\boxed{2}"], ["1", "1", "2"])
    assert scores == [0.0, 0.0, 1.0]
    assert stats["n_error"] == 2 and stats["n_restarts"] == 0 and stats["error_idx"] == [0, 1]
    assert test_pool.worker_pids() == pids_before


def test_close_stops_workers_and_rejects_use():
    p = RewardPool(num_workers=1, timeout_s=2.0, memory_mb=512)
    pid = p.worker_pids()[0]
    with p:
        assert p.score_batch(["\\boxed{1}"], ["1"])[0] == [1.0]
    with pytest.raises(RuntimeError, match="closed"):
        p.score_batch(["\\boxed{1}"], ["1"])
    assert not p._workers[0].proc.is_alive()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(num_workers=0), "num_workers"),
        (dict(timeout_s=0), "timeout_s"),
        (dict(memory_mb=10), "memory_mb"),
        (dict(start_method="fork"), "start_method"),
        (dict(prefetch=0), "prefetch"),
    ],
)
def test_bad_config_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        RewardPool(**kwargs)


def test_concurrent_callers_are_serialised(pool):
    from concurrent.futures import ThreadPoolExecutor

    def run(k):
        resp = [f"\\boxed{{{k * 100 + i}}}" for i in range(10)]
        refs = [str(k * 100 + i + (i % 2)) for i in range(10)]
        return pool.score_batch(resp, refs)[0]

    with ThreadPoolExecutor(2) as ex:
        results = list(ex.map(run, [1, 2]))
    assert results == [[1.0, 0.0] * 5] * 2


def test_spawn_start_method_works():
    with RewardPool(num_workers=1, timeout_s=5.0, memory_mb=1024, start_method="spawn") as p:
        scores, stats = p.score_batch(["\\boxed{\\sqrt{8}}", "\\boxed{3}"], ["2\\sqrt{2}", "4"])
    assert scores == [1.0, 0.0] and stats["n_ok"] == 2
