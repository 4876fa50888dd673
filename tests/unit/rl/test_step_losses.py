"""The jitted train step with the other policy losses (rl.policy_loss), the entropy bonus and the 80/20 token filter:
the step's loss == compute_policy_loss + entropy_bonus on a naive full-logits forward, composed with STARE's omega;
clip_cov / kl_cov in both scopes; 0 recompiles across steps; sharded (8 devices) == single device."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from stare_jax.config.policy_loss import PolicyLossConfig, TokenFilterConfig
from stare_jax.models import init_model
from stare_jax.models.sharding import make_mesh
from stare_jax.rl.loss_terms import entropy_bonus, high_entropy_mask
from stare_jax.rl.losses import compute_policy_loss
from stare_jax.rl.stare import StareConfig, init_stare_state, token_weights
from stare_jax.rl.step import (
    OptimizerConfig,
    TrainStepConfig,
    init_train_state,
    make_train_step,
    place_train_state,
    shift_batch,
)
from support.params import representative
from support.rl import TINY_STEP_MODEL, random_train_batch

MODEL = TINY_STEP_MODEL
B, L = 16, 20
STARE_ON = StareConfig(enabled=True, variant="O1", w=1.5, target_entropy=50.0)
BASE = TrainStepConfig(optimizer=OptimizerConfig(lr=1e-3), logprob_chunk_size=8, debug_outputs=True)


@pytest.fixture(scope="module")
def setup():
    batch = random_train_batch(MODEL.vocab_size, B, L, 0)
    graphdef, ts = init_train_state(init_model(MODEL, seed=0), BASE)
    return batch, graphdef, ts


def _naive_lp_ent(graphdef, ts, batch):
    ids, attn, tgt, lm, adv = shift_batch(batch)
    logits = np.asarray(nnx.merge(graphdef, ts.params, ts.rest)(ids, attention_mask=attn), np.float64)[:, :-1]
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    lm = np.asarray(lm)
    lp = np.take_along_axis(logp, np.asarray(tgt)[..., None], -1)[..., 0] * lm
    ent = -(np.exp(logp) * logp).sum(-1) * lm
    return lp.astype(np.float32), ent.astype(np.float32), lm, np.asarray(adv)


@pytest.mark.parametrize("name", representative(["cispo", "gspo"]))
def test_step_loss_is_compute_policy_loss_plus_entropy_bonus_with_stare_and_filter(setup, name):
    batch, graphdef, ts = setup
    cfg = dataclasses.replace(
        BASE,
        stare=STARE_ON,
        policy_loss=PolicyLossConfig(name=name),
        entropy_coeff=0.01,
        token_filter=TokenFilterConfig(enabled=True, rho=0.3),
        loss_agg="seq-mean-token-sum",
    )
    _, _, met = make_train_step(graphdef, cfg, donate=False)(ts, batch, init_stare_state(STARE_ON))
    lp, ent, lm, adv = _naive_lp_ent(graphdef, ts, batch)
    old = np.asarray(met["debug/old_logprobs"])
    np.testing.assert_allclose(old, lp, atol=2e-5)
    keep = np.asarray(high_entropy_mask(np.asarray(met["debug/entropy"]), lm, 0.3))
    assert 0.2 < float(met["token_filter/frac_kept"]) < 0.4
    om = np.asarray(token_weights(old, adv, lm, variant="O1", w=1.5, gate_on=True)) * keep
    np.testing.assert_array_equal(np.asarray(met["debug/omega"]), om)
    want, _ = compute_policy_loss(
        name,
        old,
        lp,
        adv,
        lm,
        loss_agg_mode="seq-mean-token-sum",
        omega_BxT=om,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
    )
    want = want + entropy_bonus(ent, lm, 0.01, loss_agg_mode="seq-mean-token-sum")[0]
    np.testing.assert_allclose(float(met["loss"]), float(want), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "name,scope",
    representative(
        [
            ("clip_cov", "batch"),
            ("clip_cov", "micro_batch"),
            ("kl_cov", "batch"),
            ("geo_mean", "batch"),
            ("sapo", "batch"),
            ("gpg", "batch"),
        ],
        keep=2,
    ),
)
def test_every_loss_steps_finite_without_recompiling(setup, name, scope):
    batch, graphdef, ts = setup
    opts = {
        "clip_cov": dict(clip_cov_ratio=0.05, clip_cov_lb=0.0, scope=scope, micro_batch_size=2),
        "kl_cov": dict(kl_cov_ratio=0.05, scope=scope, micro_batch_size=2),
    }.get(name, {})
    cfg = dataclasses.replace(
        BASE,
        policy_loss=PolicyLossConfig(name=name, **opts),
        num_micro_batches=2,
        num_mini_batches=2,
        debug_outputs=False,
    )
    step = make_train_step(graphdef, cfg, donate=False)
    new, ss, met = step(ts, batch, init_stare_state(cfg.stare))
    new2, _, met2 = step(new, batch, ss)
    assert step._cache_size() == 1  # 0 recompiles after the first step
    for m in (met, met2):
        assert float(m["skipped_updates"]) == 0 and np.isfinite(float(m["loss"])), m
    if name == "clip_cov":
        assert float(met["clipfrac"]) > 0  # some tokens were detached


def test_sharded_equals_single_device_for_another_loss(setup):
    batch, graphdef, ts = setup
    cfg = dataclasses.replace(
        BASE,
        stare=STARE_ON,
        policy_loss=PolicyLossConfig(name="kl_cov", kl_cov_ratio=0.1),
        entropy_coeff=0.01,
        token_filter=TokenFilterConfig(enabled=True),
    )
    _, _, met1 = make_train_step(graphdef, cfg, donate=False)(ts, batch, init_stare_state(STARE_ON))
    mesh = make_mesh({"data": 2, "fsdp": 4})
    graphdef_s, ts_s = init_train_state(init_model(MODEL, seed=0, mesh=mesh), cfg)
    shard = jax.tree.map(lambda x: x.sharding, ts_s.params)
    ts_s = place_train_state(dataclasses.replace(ts_s, params=jax.device_put(ts.params, shard)), mesh)
    step = make_train_step(graphdef_s, cfg, mesh=mesh, train_state=ts_s, donate=False)
    _, _, met_s = step(ts_s, batch, init_stare_state(STARE_ON))
    np.testing.assert_allclose(float(met_s["loss"]), float(met1["loss"]), rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(met_s["debug/omega"]), np.asarray(met1["debug/omega"]))
    g1 = np.concatenate([np.ravel(x) for x in jax.tree.leaves(met1["debug/grads"])])
    gs = np.concatenate([np.ravel(x) for x in jax.tree.leaves(met_s["debug/grads"])])
    assert np.linalg.norm(gs - g1) <= 1e-5 * np.linalg.norm(g1)


def test_sequence_level_loss_with_token_weights_is_rejected(setup):
    _, graphdef, _ = setup
    cfg = dataclasses.replace(BASE, stare=STARE_ON, policy_loss=PolicyLossConfig(name="geo_mean"))
    with pytest.raises(ValueError, match="'geo_mean' has no per-token loss"):
        make_train_step(graphdef, cfg)
