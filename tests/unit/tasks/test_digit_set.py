"""The digit-set toy task: verifier, uniform valid answers, spec parsing, rows; and the toy's held-out split."""

import collections
import random

import pytest

from stare_jax.tasks import digit_set as ds
from stare_jax.toy import assets as toy


@pytest.mark.parametrize(
    "response, answer, expected",
    [
        ("5282", "4:258", 1.0),
        (" 5282\n", "4:258", 1.0),
        ("528", "4:258", 0.0),
        ("52822", "4:258", 0.0),
        ("5283", "4:258", 0.0),
        ("52 82", "4:258", 0.0),
        ("", "4:258", 0.0),
        ("abcd", "4:258", 0.0),
        ("0000", "4:0", 1.0),
    ],
)
def test_score(response, answer, expected):
    assert ds.score(response, answer) == expected


def test_bad_spec():
    for bad in ["4", "x:123", "4:", "4:1a", "4:112", "0:12"]:
        with pytest.raises(ValueError, match="spec"):
            ds.parse_spec(bad)


def test_sampled_answers_valid_and_uniform():
    rng = random.Random(0)
    counts = collections.Counter(ds.sample_answer(2, "37", rng) for _ in range(4000))
    assert set(counts) == {"33", "37", "73", "77"} and max(counts.values()) / min(counts.values()) < 1.2
    assert all(ds.score(ds.sample_answer(5, "019", rng), "5:019") == 1.0 for _ in range(100))


def test_rows_and_specs():
    assert len(ds.all_specs((3, 5), 3)) == 3 * 120
    rows = ds.make_rows(20, seed=1)
    assert rows == ds.make_rows(20, seed=1)
    for r in rows:
        k, digits = ds.parse_spec(r["answer"])
        assert r["problem"] == ds.prompt_text(k, digits)


@pytest.mark.parametrize("task", ["digit_set", "digit_sum"])
def test_toy_split_holds_out_prompt_specs(task):
    cfg = toy.ToyAssetConfig(task=task, num_train=500, num_eval=100)
    train, held = toy.make_splits(cfg)
    assert len(train) == 500 and len(held) == 100
    assert not {r["problem"] for r in train} & {r["problem"] for r in held}
    rng = random.Random(0)
    sp = toy.TASKS[task].parse_spec(train[0]["answer"])
    noisy = [toy.noisy_answer(cfg, sp, rng) for _ in range(300)]
    acc = sum(toy.TASKS[task].score(a, train[0]["answer"]) for a in noisy) / 300
    assert 0.05 < acc < 0.95  # the warm-start data is deliberately imperfect
