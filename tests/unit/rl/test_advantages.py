"""GRPO advantages and DAPO dynamic sampling vs independent NumPy re-derivations."""

import numpy as np
import pytest

from stare_jax.rl.advantages import (
    DynamicSamplingAccumulator,
    DynamicSamplingError,
    dynamic_sampling_keep_mask,
    grpo_advantages,
    outcome_advantages,
)


def _np_grpo(r, norm_by_std=True, eps=1e-6):
    out = np.zeros_like(r, dtype=np.float64)
    for i, row in enumerate(r.astype(np.float64)):
        if len(row) == 1:
            mean, std = 0.0, 1.0
        else:
            mean = row.sum() / len(row)
            std = np.sqrt(((row - mean) ** 2).sum() / (len(row) - 1))
        out[i] = (row - mean) / (std + eps) if norm_by_std else row - mean
    return out


@pytest.mark.parametrize("group", [1, 2, 8])
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_advantages_match_numpy(group, norm_by_std):
    rng = np.random.default_rng(group)
    r = rng.integers(0, 2, size=(5, group)).astype(np.float32)
    r[0] = 1.0  # all-equal group -> zero advantages
    if group > 1:
        r[1] = rng.normal(size=group)
    got = np.asarray(grpo_advantages(r, norm_by_std=norm_by_std))
    np.testing.assert_allclose(got, _np_grpo(r, norm_by_std), rtol=1e-5, atol=1e-6)
    if group > 1:
        np.testing.assert_allclose(got[0], 0.0, atol=0)


def test_grpo_group_of_one_is_reward():
    got = np.asarray(grpo_advantages(np.array([[1.0], [0.0]], np.float32)))
    np.testing.assert_allclose(got[:, 0], [1.0 / (1 + 1e-6), 0.0], rtol=1e-6)


def test_grpo_rejects_bad_shape():
    with pytest.raises(ValueError, match="rewards_PxG"):
        grpo_advantages(np.zeros(4))


def test_keep_mask():
    acc = np.array([[1, 1, 1, 1], [0, 0, 0, 0], [0, 1, 0, 0], [1, 1, 0, 1]], np.float32)
    np.testing.assert_array_equal(np.asarray(dynamic_sampling_keep_mask(acc)), [False, False, True, True])
    np.testing.assert_array_equal(np.asarray(dynamic_sampling_keep_mask(np.array([[1.0], [0.0]]))), [True, True])
    ref = np.array([np.std(a.astype(np.float64)) > 0 for a in acc])
    np.testing.assert_array_equal(np.asarray(dynamic_sampling_keep_mask(acc)), ref)


def _gen_batch(rng, p, g, start):
    acc = rng.integers(0, 2, size=(p, g)).astype(np.float32)
    return {"acc": acc, "prompt_id": np.arange(start, start + p), "tokens": rng.integers(0, 9, size=(p, g, 3))}


def test_accumulator_concatenates_and_truncates():
    rng = np.random.default_rng(0)
    acc = DynamicSamplingAccumulator(train_batch_size=7, max_num_gen_batches=10)
    kept_ids, start = [], 0
    while True:
        b = _gen_batch(rng, 4, 3, start)
        start += 4
        keep = np.asarray(dynamic_sampling_keep_mask(b["acc"]))
        kept_ids += list(b["prompt_id"][keep])
        if acc.add(b, keep):
            break
    out = acc.result()
    np.testing.assert_array_equal(out["prompt_id"], kept_ids[:7])
    assert out["acc"].shape == (7, 3) and out["tokens"].shape == (7, 3, 3)
    assert all(np.std(a) > 0 for a in out["acc"])


def test_accumulator_limit_error_names_limit_and_kept():
    acc = DynamicSamplingAccumulator(train_batch_size=5, max_num_gen_batches=2)
    b = {"acc": np.array([[1, 0], [1, 1], [0, 0]], np.float32)}
    keep = np.asarray(dynamic_sampling_keep_mask(b["acc"]))
    assert not acc.add(b, keep)
    with pytest.raises(DynamicSamplingError, match=r"max_num_gen_batches=2.*only 2 prompts were kept"):
        acc.add(b, keep)
    with pytest.raises(ValueError, match="train_batch_size"):
        acc.result()


def test_accumulator_rejects_mismatched_leading_axis():
    acc = DynamicSamplingAccumulator(train_batch_size=2)
    with pytest.raises(ValueError, match="leading prompt axis"):
        acc.add({"x": np.zeros((3, 2))}, np.ones(4, bool))


def test_outcome_advantages_of_each_estimator():
    """rl.advantage.estimator: grpo = grpo_advantages of the shaped rewards (Dr.GRPO: no std); w_reinforce = lambda for
    a correct response, -1 for a wrong one, whatever the rewards (Zhu et al. 2025)."""
    rewards = np.array([[1.0, 0.0, 0.0, 1.0], [0.5, 0.0, 1.0, 1.0]], np.float32)
    correct = (rewards == 1.0).astype(np.float32)
    g = np.asarray(outcome_advantages(rewards, correct))
    np.testing.assert_allclose(
        g, (rewards - rewards.mean(1, keepdims=True)) / (rewards.std(1, ddof=1, keepdims=True) + 1e-6), rtol=1e-6
    )
    dr = np.asarray(outcome_advantages(rewards, correct, norm_by_std=False))
    np.testing.assert_allclose(dr, rewards - rewards.mean(1, keepdims=True), rtol=1e-6)
    w = np.asarray(outcome_advantages(rewards, correct, estimator="w_reinforce", w_reinforce_lambda=0.1))
    np.testing.assert_allclose(w, np.where(correct > 0, 0.1, -1.0))
    with pytest.raises(ValueError, match="advantage estimator 'ppo' unknown"):
        outcome_advantages(rewards, correct, estimator="ppo")
