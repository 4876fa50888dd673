"""The digit-sum toy task: exact counts (brute force), uniform answer sampling, verifier, row generation."""

import collections
import itertools
import random

import pytest

from stare_jax.tasks import digit_sum as ds


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_counts_match_brute_force(k):
    brute = collections.Counter(sum(t) for t in itertools.product(range(10), repeat=k))
    for s in range(-1, 9 * k + 2):
        assert ds.count_strings(k, s) == brute.get(s, 0)


def test_sampled_answers_are_valid_and_uniform():
    rng = random.Random(0)
    k, s = 2, 9  # the 10 strings 09, 18, ..., 90
    draws = collections.Counter(ds.sample_answer(k, s, rng) for _ in range(5000))
    assert set(draws) == {f"{d}{9 - d}" for d in range(10)}
    assert max(draws.values()) / min(draws.values()) < 1.35
    for _ in range(200):
        k, s = rng.randint(1, 6), rng.randint(0, 20)
        if ds.count_strings(k, s):
            assert ds.score(ds.sample_answer(k, s, rng), ds.spec(k, s)) == 1.0
    with pytest.raises(ValueError, match="no 2-digit string sums to 19"):
        ds.sample_answer(2, 19, rng)


@pytest.mark.parametrize(
    "response, answer, expected",
    [
        ("9350", "4:17", 1.0),
        (" 9350 ", "4:17", 1.0),
        ("0000", "4:0", 1.0),
        ("935", "4:17", 0.0),
        ("93500", "4:17", 0.0),
        ("9351", "4:17", 0.0),
        ("93a0", "4:17", 0.0),
        ("", "4:17", 0.0),
        ("9 350", "4:17", 0.0),
        ("__import__('os')", "4:17", 0.0),
    ],
)
def test_score(response, answer, expected):
    assert ds.score(response, answer) == expected


def test_bad_spec():
    with pytest.raises(ValueError, match="'K:S'"):
        ds.score("1", "17")
    with pytest.raises(ValueError, match="0 <= S <= 9k"):
        ds.parse_spec("2:19")


def test_make_rows_deterministic_and_solvable():
    a, b = ds.make_rows(50, seed=3), ds.make_rows(50, seed=3)
    assert a == b and a != ds.make_rows(50, seed=4)
    for row in a:
        k, s = ds.parse_spec(row["answer"])
        assert row["problem"] == ds.prompt_text(k, s) and ds.count_strings(k, s) >= 10 and 3 <= k <= 6
