"""The jitted train step on the real stare_jax model: sharded == single device, micro-batch accumulation == full
batch, STARE-O1 raises entropy vs GRPO, NaN skip, PPO epochs / micro-batch scope."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stare_jax import models
from stare_jax.models import init_model
from stare_jax.models.sharding import make_mesh
from stare_jax.rl.losses import policy_loss
from stare_jax.rl.stare import StareConfig, init_stare_state, token_weights
from stare_jax.rl.step import (
    OptimizerConfig,
    TrainStepConfig,
    batch_entropy,
    init_train_state,
    make_train_step,
    place_train_state,
    shift_batch,
)
from support.rl import TINY_STEP_MODEL, random_train_batch

MODEL = TINY_STEP_MODEL
B, L = 16, 20
STARE_ON = StareConfig(enabled=True, variant="O1", w=1.5, target_entropy=50.0)  # H_bar < 50: the batch gate is on
BASE = TrainStepConfig(optimizer=OptimizerConfig(lr=1e-3), stare=STARE_ON, logprob_chunk_size=8, debug_outputs=True)


def _batch(seed=0):
    return random_train_batch(MODEL.vocab_size, B, L, seed)


@pytest.fixture(scope="module")
def batch():
    return _batch()


@pytest.fixture(scope="module")
def single(batch):
    model = init_model(MODEL, seed=0)
    graphdef, ts = init_train_state(model, BASE)
    step = make_train_step(graphdef, BASE, donate=False)
    new_ts, ss, met = step(ts, batch, init_stare_state(STARE_ON))
    return graphdef, ts, new_ts, ss, met, step


def _flat(tree):
    return np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(tree)])


def _delta(ts0, ts1):
    return _flat(ts1.params) - _flat(ts0.params)


def test_step_matches_manual_loss(single, batch):
    graphdef, ts, _, ss, met, _ = single
    assert bool(ss.gate_on) and float(ss.w) == 1.5
    ids, attn, tgt, lm, adv = shift_batch(batch)
    lm = np.asarray(lm)
    # the batch shift: loss positions are exactly the response tokens of input_ids[:, 1:]
    np.testing.assert_array_equal(lm, batch["response_mask_BxT"][:, 1:])
    # omega recomputed from the debug old log-probs with token_weights
    old = np.asarray(met["debug/old_logprobs"])
    om = token_weights(old, adv, lm, variant="O1", w=1.5, gate_on=True)
    np.testing.assert_array_equal(np.asarray(met["debug/omega"]), np.asarray(om))
    assert float(met["stare/frac_reweighted"]) > 0
    # naive reference: full logits from the model call, then policy_loss
    from flax import nnx

    model = nnx.merge(graphdef, ts.params, ts.rest)
    logits = np.asarray(model(ids, attention_mask=attn), np.float64)[:, :-1]
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    lp_ref = np.take_along_axis(logp, np.asarray(tgt)[..., None], -1)[..., 0] * lm
    np.testing.assert_allclose(old, lp_ref, atol=2e-5)
    ent_ref = (-(np.exp(logp) * logp).sum(-1) * lm).sum() / lm.sum()
    np.testing.assert_allclose(float(met["entropy"]), ent_ref, rtol=1e-5)
    loss_ref, _ = policy_loss(lp_ref.astype(np.float32), old, adv, lm, omega_BxT=om)
    np.testing.assert_allclose(float(met["loss"]), float(loss_ref), rtol=1e-4, atol=1e-6)
    assert float(met["approx_kl"]) == pytest.approx(0.0, abs=1e-5) and float(met["clipfrac"]) == 0.0


def test_micro_batches_equal_full_batch(single, batch):
    graphdef, ts, new1, _, met1, _ = single
    cfg4 = dataclasses.replace(BASE, num_micro_batches=4)
    step4 = make_train_step(graphdef, cfg4, donate=False)
    new4, _, met4 = step4(ts, batch, init_stare_state(STARE_ON))
    np.testing.assert_allclose(float(met4["loss"]), float(met1["loss"]), rtol=1e-5, atol=1e-7)
    g1, g4 = _flat(met1["debug/grads"]), _flat(met4["debug/grads"])
    assert np.linalg.norm(g4 - g1) <= 1e-5 * np.linalg.norm(g1)
    d1, d4 = _delta(ts, new1), _delta(ts, new4)
    assert np.linalg.norm(d4 - d1) <= 1e-3 * np.linalg.norm(d1)


def test_sharded_equals_single_device(single, batch):
    graphdef, ts, new1, _, met1, _ = single
    mesh = make_mesh({"data": 2, "fsdp": 4})
    model = init_model(MODEL, seed=0, mesh=mesh)
    graphdef_s, ts_s = init_train_state(model, BASE)
    # same parameter values as the single-device run (jitted and eager init differ in the last bit)
    shard = jax.tree.map(lambda x: x.sharding, ts_s.params)
    ts_s = place_train_state(dataclasses.replace(ts_s, params=jax.device_put(ts.params, shard)), mesh)
    assert any(
        len(x.sharding.device_set) == 8 and not x.sharding.is_fully_replicated for x in jax.tree.leaves(ts_s.params)
    )
    np.testing.assert_array_equal(_flat(ts_s.params), _flat(ts.params))
    step = make_train_step(graphdef_s, BASE, mesh=mesh, train_state=ts_s, donate=False)
    new_s, ss, met_s = step(ts_s, batch, init_stare_state(STARE_ON))
    np.testing.assert_allclose(float(met_s["loss"]), float(met1["loss"]), rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(np.asarray(met_s["debug/omega"]), np.asarray(met1["debug/omega"]))
    g1, gs = _flat(met1["debug/grads"]), _flat(met_s["debug/grads"])
    assert np.linalg.norm(gs - g1) <= 1e-5 * np.linalg.norm(g1)
    d1, ds = _delta(ts, new1), _delta(ts_s, new_s)
    assert np.linalg.norm(ds - d1) <= 1e-3 * np.linalg.norm(d1)
    # the output keeps the input shardings
    for a, b in zip(jax.tree.leaves(new_s.params), jax.tree.leaves(ts_s.params)):
        assert a.sharding.is_equivalent_to(b.sharding, a.ndim)


def test_stare_o1_raises_entropy_vs_grpo(single, batch):
    graphdef, ts, new_stare, _, met, step = single
    grpo = dataclasses.replace(BASE, stare=dataclasses.replace(STARE_ON, enabled=False))
    step_g = make_train_step(graphdef, grpo, donate=False)
    new_grpo, _, met_g = step_g(ts, batch, init_stare_state(grpo.stare))
    np.testing.assert_array_equal(np.asarray(met_g["debug/omega"]), 1.0)
    ent = jax.jit(lambda p: batch_entropy(graphdef, p, ts.rest, batch, chunk_size=8))
    h0, h_stare, h_grpo = float(ent(ts.params)), float(ent(new_stare.params)), float(ent(new_grpo.params))
    assert h_stare > h_grpo, (h0, h_stare, h_grpo)


def test_nonfinite_loss_skips_update(single, batch):
    _, ts, _, _, _, step = single
    bad = dict(batch, advantages_B=np.where(np.arange(B) == 3, np.nan, batch["advantages_B"]).astype(np.float32))
    new, ss, met = step(ts, bad, init_stare_state(STARE_ON))
    assert float(met["skipped_updates"]) == 1.0
    np.testing.assert_array_equal(_flat(new.params), _flat(ts.params))
    assert int(new.step) == int(ts.step) + 1


def test_ppo_epochs_minibatches_and_micro_batch_scope(single, batch):
    graphdef, ts, _, _, _, _ = single
    cfg = dataclasses.replace(
        BASE,
        ppo_epochs=2,
        num_mini_batches=2,
        num_micro_batches=2,
        debug_outputs=False,
        stare=dataclasses.replace(
            STARE_ON, variant="C2", scope="micro_batch", micro_batch_size=2, rule="exact_top_k", theory_diagnostics=True
        ),
    )
    step = make_train_step(graphdef, cfg, donate=True)
    new, ss, met = step(jax.tree.map(jnp.copy, ts), batch, init_stare_state(cfg.stare))
    assert float(met["num_updates"]) == 4 and float(met["skipped_updates"]) == 0
    assert float(met["approx_kl"]) != 0.0  # later updates see a policy that moved: ratio departs from 1
    assert np.isfinite(float(met["loss"])) and float(met["omega_mean_used"]) != 1.0
    for k in (
        "theory/lambda",
        "theory/gamma_pos",
        "theory/predicted_dH",
        "theory/s_star_mean",
        "theory/frac_pos_high_above_sstar",
    ):
        assert np.isfinite(float(met[k])), k
    with pytest.raises(ValueError, match="micro_batch_size"):
        bad = dataclasses.replace(cfg, stare=dataclasses.replace(cfg.stare, micro_batch_size=3))
        make_train_step(graphdef, bad)(ts, batch, init_stare_state(bad.stare))


def test_optimizer_state_sharded_like_params():
    """Adam's moments live sharded like their parameters (per-device bytes = total / shards), counts replicated;
    before this fix jax.jit(tx.init) replicated them on every device."""
    mesh = make_mesh({"fsdp": 4}, devices=jax.devices()[:4])
    model = init_model(MODEL, seed=0, mesh=mesh)
    _, ts = init_train_state(model, BASE)

    def per_device_and_total(tree):
        leaves = jax.tree.leaves(tree)
        per_dev = sum(x.addressable_shards[0].data.nbytes for x in leaves)
        return per_dev, sum(x.nbytes for x in leaves)

    p_dev, p_total = per_device_and_total(ts.params)
    moments = [x for x in jax.tree.leaves(ts.opt_state) if x.ndim > 0]
    o_dev, o_total = per_device_and_total(moments)
    assert o_total == 2 * p_total  # mu and nu
    assert o_dev == 2 * p_dev  # each moment exactly as sharded as its parameter
    assert o_dev < o_total / 3  # all but the (tiny) norm weights are split 4 ways
    for mu, p in zip(jax.tree.leaves(ts.opt_state[1][0].mu), jax.tree.leaves(ts.params)):
        assert mu.sharding.is_equivalent_to(p.sharding, p.ndim)
        if not p.sharding.is_fully_replicated:  # per-device bytes == total / shards
            assert mu.addressable_shards[0].data.nbytes == mu.nbytes // 4
    # the abstract path (ahead-of-time compile) gives the same shardings without allocating
    abstract_model = models.abstract_model(MODEL, mesh=mesh)
    _, abstract_ts = init_train_state(abstract_model, BASE)
    for a, r in zip(jax.tree.leaves(abstract_ts.opt_state), jax.tree.leaves(ts.opt_state)):
        assert isinstance(a, jax.ShapeDtypeStruct) and a.shape == r.shape
        assert a.sharding.is_equivalent_to(r.sharding, r.ndim)
