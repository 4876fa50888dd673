"""The train step with the sampler's log-probs (rl.rollout_correction): the mismatch diagnostics, IS weights in the
loss, rejection in the loss mask and STARE's surprisal from the sampler, each checked against the pure functions
(themselves checked against verl's torch code in test_rollout_correction.py / test_policy_losses.py) on the step's
own log-probs; identical sampler and trainer log-probs change nothing; packed == padded; bad input."""

import dataclasses

import numpy as np
import pytest

from stare_jax.config.packing import PackingConfig
from stare_jax.config.rollout_correction import RolloutCorrectionConfig
from stare_jax.models import init_model
from stare_jax.rl.losses import compute_policy_loss
from stare_jax.rl.packing import host_layout
from stare_jax.rl.rollout_correction import is_weights, offpolicy_metrics, rejection_mask
from stare_jax.rl.stare import StareConfig, init_stare_state, token_weights
from stare_jax.rl.step import (
    ROLLOUT_LOGPROBS_KEY,
    OptimizerConfig,
    TrainStepConfig,
    batch_keys,
    init_train_state,
    make_train_step,
)
from support.params import representative
from support.rl import TINY_STEP_MODEL, random_train_batch

MODEL = TINY_STEP_MODEL
B, L = 16, 20
STARE_ON = StareConfig(enabled=True, variant="C2", w=1.5, m=0.5, top_p=0.2, target_entropy=50.0)
BASE = TrainStepConfig(optimizer=OptimizerConfig(lr=1e-3), logprob_chunk_size=8, debug_outputs=True, stare=STARE_ON)
KEEP = RolloutCorrectionConfig(rollout_log_probs=True)


@pytest.fixture(scope="module")
def setup():
    """The batch, the model, and the trainer's own old log-probs [B, L-1] with the loss mask (a step without
    rollout log-probs, debug outputs on)."""
    batch = random_train_batch(MODEL.vocab_size, B, L, 0)
    graphdef, ts = init_train_state(init_model(MODEL, seed=0), BASE)
    _, _, met = make_train_step(graphdef, BASE, donate=False)(ts, batch, init_stare_state(STARE_ON))
    return batch, graphdef, ts, met


def _with_rollout(batch, old_BxT, lm_BxT, noise_BxT):
    """The batch plus rollout_logprobs_BxT = the trainer's old log-probs + noise on the loss tokens, aligned with
    input_ids (column t + 1 of the batch is index t of the step's arrays)."""
    roll = np.zeros(batch["input_ids_BxT"].shape, np.float32)
    roll[:, 1:] = np.where(lm_BxT > 0, old_BxT + noise_BxT, 0.0)
    return dict(batch, **{ROLLOUT_LOGPROBS_KEY: roll})


def _surprisal_noise(old_BxT, scale=0.3):
    """A mismatch concentrated on the most surprising 30% of the tokens (as bf16 rounding is largest in the
    low-probability tail): log-ratio noise of std 0.05 everywhere plus `scale` on those."""
    rng = np.random.default_rng(3)
    surprisal = -old_BxT
    tail = surprisal > np.quantile(surprisal[old_BxT != 0], 0.7)
    return (rng.standard_normal(old_BxT.shape) * (0.05 + scale * tail)).astype(np.float32)


def _step(graphdef, ts, cfg, batch):
    return make_train_step(graphdef, cfg, donate=False)(ts, batch, init_stare_state(cfg.stare))[2]


def test_identical_log_probs_change_nothing(setup):
    batch, graphdef, ts, base = setup
    old, lm = np.asarray(base["debug/old_logprobs"]), np.asarray(base["debug/loss_mask"])
    cfg = dataclasses.replace(
        BASE,
        rollout_correction=dataclasses.replace(
            KEEP, rollout_is="token", rollout_rs="token_k1,seq_max_k3", rollout_rs_threshold="2.0,0.5"
        ),
    )
    met = _step(graphdef, ts, cfg, _with_rollout(batch, old, lm, np.zeros_like(old)))
    for k in ("kl", "k3_kl", "chi2_token", "chi2_seq", "max_abs_log_ratio", "rollout_rs_masked_fraction"):
        assert abs(float(met[f"rollout_corr/{k}"])) < 1e-6, k
    np.testing.assert_allclose(float(met["rollout_corr/rollout_is_mean"]), 1.0, atol=1e-6)
    np.testing.assert_allclose(float(met["loss"]), float(base["loss"]), rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(met["debug/omega"]), np.asarray(base["debug/omega"]))
    assert float(met["response_tokens"]) == float(base["response_tokens"])


@pytest.mark.parametrize("level", representative(["token", "sequence"]))
def test_is_weights_and_rejection_act_as_the_pure_functions_say(setup, level):
    batch, graphdef, ts, base = setup
    old, lm = np.asarray(base["debug/old_logprobs"]), np.asarray(base["debug/loss_mask"])
    noise = _surprisal_noise(old)
    rc = dataclasses.replace(
        KEEP, rollout_is=level, rollout_is_threshold=1.5, rollout_rs="token_k1", rollout_rs_threshold=1.3
    )
    met = _step(graphdef, ts, dataclasses.replace(BASE, rollout_correction=rc), _with_rollout(batch, old, lm, noise))
    roll = np.where(lm > 0, old + noise, 0.0)
    w, _ = is_weights(old - roll, lm, level=level, threshold=1.5)
    keep, rs = rejection_mask(old - roll, lm, rc.rejection_options)
    keep = np.asarray(keep)
    assert 0.05 < float(rs["rollout_rs_masked_fraction"]) < 0.9  # the test rejects some tokens, not all
    np.testing.assert_allclose(float(met["rollout_corr/rollout_rs_masked_fraction"]), rs["rollout_rs_masked_fraction"])
    assert float(met["response_tokens"]) == keep.sum()  # rejected tokens left the loss mask
    # the selection ranks the kept tokens only; one on-policy update: log-probs = old, ratio 1
    adv = np.asarray(batch["advantages_B"])
    omega = np.asarray(token_weights(old, adv, keep, variant="C2", w=1.5, m=0.5, top_p=0.2, gate_on=True))
    np.testing.assert_array_equal(np.asarray(met["debug/omega"]), omega)
    want, _ = compute_policy_loss(
        "stare",
        old,
        old,
        adv,
        keep,
        omega_BxT=omega,
        rollout_is_weights=np.asarray(w),
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=10.0,
    )
    np.testing.assert_allclose(float(met["loss"]), float(want), rtol=2e-5, atol=1e-7)
    unweighted, _ = compute_policy_loss(
        "stare", old, old, adv, keep, omega_BxT=omega, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=10.0
    )
    assert abs(float(want) - float(unweighted)) > 1e-3  # the IS weights act


def test_diagnostics_split_by_stare_high_surprisal_set(setup):
    batch, graphdef, ts, base = setup
    old, lm = np.asarray(base["debug/old_logprobs"]), np.asarray(base["debug/loss_mask"])
    noise = _surprisal_noise(old)
    met = _step(graphdef, ts, dataclasses.replace(BASE, rollout_correction=KEEP), _with_rollout(batch, old, lm, noise))
    roll = np.where(lm > 0, old + noise, 0.0)
    adv = np.asarray(batch["advantages_B"])
    high = np.asarray(token_weights(old, adv, lm, variant="C2", w=2.0, m=0.5, top_p=0.2, gate_on=True)) != 1.0
    want = offpolicy_metrics(old, roll, lm, subsets={"high_surprisal": high, "rest": ~high})
    for k in ("kl", "k3_kl", "chi2_token", "chi2_seq", "max_abs_log_ratio", "high_surprisal_k3_kl", "rest_k3_kl"):
        np.testing.assert_allclose(float(met[f"rollout_corr/{k}"]), float(want[k]), rtol=1e-5, atol=1e-8, err_msg=k)
    np.testing.assert_allclose(float(met["rollout_corr/high_surprisal_frac"]), (high & (lm > 0)).sum() / lm.sum())
    # this mismatch grows with surprisal: the selected tokens carry more of it than the rest
    assert float(met["rollout_corr/high_surprisal_k3_kl"]) > 2 * float(met["rollout_corr/rest_k3_kl"])
    assert "rollout_corr/rollout_is_mean" not in met  # diagnostics only: no correction configured
    np.testing.assert_allclose(float(met["loss"]), float(base["loss"]), rtol=1e-6)


def test_surprisal_from_the_sampler_ranks_its_log_probs(setup):
    batch, graphdef, ts, base = setup
    old, lm = np.asarray(base["debug/old_logprobs"]), np.asarray(base["debug/loss_mask"])
    noise = _surprisal_noise(old, scale=1.0)
    cfg = dataclasses.replace(
        BASE, stare=dataclasses.replace(STARE_ON, surprisal_source="rollout"), rollout_correction=KEEP
    )
    met = _step(graphdef, ts, cfg, _with_rollout(batch, old, lm, noise))
    adv = np.asarray(batch["advantages_B"])
    roll = np.where(lm > 0, old + noise, 0.0)
    want = np.asarray(token_weights(roll, adv, lm, variant="C2", w=1.5, m=0.5, top_p=0.2, gate_on=True))
    np.testing.assert_array_equal(np.asarray(met["debug/omega"]), want)
    assert (want != np.asarray(base["debug/omega"])).any()  # the two sources select differently here


def test_packed_equals_padded(setup):
    batch, graphdef, ts, base = setup
    old, lm = np.asarray(base["debug/old_logprobs"]), np.asarray(base["debug/loss_mask"])
    full = _with_rollout(batch, old, lm, _surprisal_noise(old))
    rc = dataclasses.replace(KEEP, rollout_is="token", rollout_rs="seq_mean_k3", rollout_rs_threshold=0.05)
    padded = _step(graphdef, ts, dataclasses.replace(BASE, rollout_correction=rc), full)
    packed_cfg = dataclasses.replace(
        BASE, rollout_correction=rc, packing=PackingConfig(enabled=True, row_tokens=2 * L), micro_batch_tokens=4 * L
    )
    packed = _step(graphdef, ts, packed_cfg, host_layout(full, packed_cfg, 1))
    for k in [k for k in padded if k.startswith("rollout_corr/")] + ["loss", "response_tokens"]:
        np.testing.assert_allclose(float(packed[k]), float(padded[k]), rtol=2e-5, atol=1e-6, err_msg=k)


def test_bad_input(setup):
    batch, graphdef, ts, _ = setup
    cfg = dataclasses.replace(BASE, rollout_correction=KEEP)
    assert ROLLOUT_LOGPROBS_KEY in batch_keys(cfg) and ROLLOUT_LOGPROBS_KEY not in batch_keys(BASE)
    with pytest.raises(ValueError, match="rollout_logprobs_BxT"):
        _step(graphdef, ts, cfg, batch)
    with pytest.raises(ValueError, match="surprisal_source"):
        dataclasses.replace(BASE, stare=dataclasses.replace(STARE_ON, surprisal_source="rollout"))
