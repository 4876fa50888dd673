"""The frozen reference policy and the KL penalty in the jitted train step (rl.kl; verl use_kl_loss /
use_kl_in_reward): the step's loss == a NumPy re-derivation for every estimator (loss term) and for the KL-in-reward
GRPO advantage; its gradient == jax.grad of a naive full-logits loss; the reference is never updated; kl == 0 when the
reference is the policy; sharded (8 devices) == single device; 0 recompiles after the first step; EntroAdv's token
advantage through the step."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from stare_jax import models
from stare_jax.config.advantage import AdvantageConfig
from stare_jax.config.kl import KLConfig
from stare_jax.config.loader import load_config
from stare_jax.models import init_model
from stare_jax.models.sharding import make_mesh
from stare_jax.rl.stare import init_stare_state
from stare_jax.rl.step import (
    OptimizerConfig,
    TrainStepConfig,
    init_train_state,
    make_train_step,
    place_train_state,
    shift_batch,
    split_model,
)
from stare_jax.training.setup import TrainingError, reference_params
from support.params import representative
from support.rl import TINY_STEP_MODEL, np_agg, random_train_batch

MODEL = TINY_STEP_MODEL
B, L, G = 16, 20, 4
BASE = TrainStepConfig(optimizer=OptimizerConfig(lr=1e-3), logprob_chunk_size=8, debug_outputs=True, group_size=G)
KL_LOSS = KLConfig(coef=0.05, reference="initial")


@pytest.fixture(scope="module")
def setup():
    batch = random_train_batch(MODEL.vocab_size, B, L, 0)
    batch["rewards_B"] = np.random.default_rng(1).integers(0, 2, B).astype(np.float32)
    graphdef, ts = init_train_state(init_model(MODEL, seed=0), BASE)
    ref = split_model(init_model(MODEL, seed=1))[1]  # another policy: the KL is far from 0
    return batch, graphdef, ts, ref


def _naive_lp(graphdef, params, rest, batch):
    """float64 per-token log-probs of the targets from the full logits (NumPy), zero off the loss mask."""
    ids, attn, tgt, lm, _ = shift_batch(batch)
    logits = np.asarray(nnx.merge(graphdef, params, rest)(ids, attention_mask=attn), np.float64)[:, :-1]
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    lm = np.asarray(lm)
    return np.take_along_axis(logp, np.asarray(tgt)[..., None], -1)[..., 0] * lm, lm


def _np_kl(lp, ref, kind):
    """Schulman's estimators as verl's kl_penalty_forward, written out again in NumPy."""
    d = lp - ref
    if kind in ("kl", "k1"):
        return d
    if kind == "abs":
        return np.abs(d)
    if kind in ("mse", "k2"):
        return 0.5 * d * d
    x = np.clip(-d, -20, 20)
    return np.clip(np.exp(x) - x - 1, -10, 10)


@pytest.mark.parametrize(
    "kind,agg",
    representative(
        [
            ("kl", "token-mean"),
            ("low_var_kl", "token-mean"),
            ("abs", "seq-mean-token-sum"),
            ("mse", "seq-mean-token-mean"),
            ("k3", "seq-mean-token-sum-norm"),
        ],
        keep=2,
    ),
)
def test_kl_loss_term_matches_numpy(setup, kind, agg):
    batch, graphdef, ts, ref = setup
    cfg = dataclasses.replace(BASE, kl=dataclasses.replace(KL_LOSS, estimator=kind), loss_agg=agg)
    _, _, met = make_train_step(graphdef, cfg, donate=False)(ts, batch, init_stare_state(cfg.stare), ref)
    lp, lm = _naive_lp(graphdef, ts.params, ts.rest, batch)
    ref_lp, _ = _naive_lp(graphdef, ref, ts.rest, batch)
    adv = np.broadcast_to(np.asarray(batch["advantages_B"])[:, None], lp.shape)
    kld = _np_kl(lp, ref_lp, kind) * lm
    # on-policy vanilla (old = sg(lp), ratio 1): the surrogate is -A per token
    want = np_agg(-adv * lm, lm, agg) + 0.05 * np_agg(kld, lm, agg)
    np.testing.assert_allclose(float(met["loss"]), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(met["kl_loss"]), np_agg(kld, lm, agg), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(met["kl"]), kld.sum() / lm.sum(), rtol=1e-5, atol=1e-6)


def test_kl_loss_gradient_matches_naive_autodiff(setup):
    batch, graphdef, ts, ref = setup
    cfg = dataclasses.replace(BASE, kl=KL_LOSS)  # low_var_kl, token-mean
    _, _, met = make_train_step(graphdef, cfg, donate=False)(ts, batch, init_stare_state(cfg.stare), ref)
    ids, attn, tgt, lm, adv = shift_batch(batch)

    def lp_of(params):
        logits = nnx.merge(graphdef, params, ts.rest)(ids, attention_mask=attn)[:, :-1].astype(jnp.float32)
        return jnp.take_along_axis(jax.nn.log_softmax(logits), tgt[..., None], -1)[..., 0] * lm

    ref_lp = jax.lax.stop_gradient(lp_of(ref))

    def naive_loss(params):
        lp = lp_of(params)
        surrogate = -adv[:, None] * jnp.exp(lp - jax.lax.stop_gradient(lp))
        x = jnp.clip(ref_lp - lp, -20, 20)
        kld = jnp.clip(jnp.exp(x) - x - 1, -10, 10)
        return jnp.sum((surrogate + 0.05 * kld) * lm) / jnp.sum(lm)

    want = np.concatenate([np.ravel(g) for g in jax.tree.leaves(jax.jit(jax.grad(naive_loss))(ts.params))])
    got = np.concatenate([np.ravel(g) for g in jax.tree.leaves(met["debug/grads"])])
    assert np.linalg.norm(got - want) <= 1e-4 * np.linalg.norm(want)


def test_kl_in_reward_advantage_matches_numpy(setup):
    batch, graphdef, ts, ref = setup
    cfg = dataclasses.replace(BASE, kl=KLConfig(coef=0.1, use_as="reward", reference="initial"))
    assert cfg.kl.kind == "kl"  # verl's algorithm.kl_penalty default
    _, _, met = make_train_step(graphdef, cfg, donate=False)(ts, batch, init_stare_state(cfg.stare), ref)
    lp, lm = _naive_lp(graphdef, ts.params, ts.rest, batch)
    ref_lp, _ = _naive_lp(graphdef, ref, ts.rest, batch)
    kld = (lp - ref_lp) * lm
    seq = (batch["rewards_B"] - 0.1 * kld.sum(1)).reshape(-1, G)
    adv = ((seq - seq.mean(1, keepdims=True)) / (seq.std(1, ddof=1, keepdims=True) + 1e-6)).reshape(-1)
    want = np_agg(-np.broadcast_to(adv[:, None], lp.shape) * lm, lm, "token-mean")
    np.testing.assert_allclose(float(met["loss"]), want, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(float(met["kl/reward_penalty"]), np.mean(kld.sum(1) / lm.sum(1)), rtol=1e-5)
    assert "kl_loss" not in met  # the reward penalty adds no loss term


def test_reference_is_never_updated_kl_is_zero_at_the_start_and_nothing_recompiles(setup):
    batch, graphdef, ts, _ = setup
    cfg = dataclasses.replace(BASE, kl=KL_LOSS, optimizer=OptimizerConfig(lr=3e-2), debug_outputs=False)
    ref = jax.tree.map(jnp.copy, ts.params)  # "initial": the reference is the policy at step 0
    ref_before = [np.asarray(x).copy() for x in jax.tree.leaves(ref)]
    step = make_train_step(graphdef, cfg)  # the train state is donated; the reference is not
    state, ss = jax.tree.map(jnp.copy, ts), init_stare_state(cfg.stare)
    kls = []
    for _ in range(3):
        state, ss, met = step(state, batch, ss, ref)
        kls.append(float(met["kl"]))
    assert kls[0] == 0.0 and kls[1] > 1e-6 and kls[2] > kls[1]  # the policy moves away from the frozen reference
    assert step._cache_size() == 1  # 0 recompiles after the first step
    for a, b in zip(jax.tree.leaves(ref), ref_before):
        np.testing.assert_array_equal(np.asarray(a), b)
    with pytest.raises(ValueError, match="reference parameters"):
        step(state, batch, ss)


@pytest.mark.parametrize(
    "kl", representative([KL_LOSS, KLConfig(coef=0.1, use_as="reward", estimator="k3", reference="initial")])
)
def test_sharded_equals_single_device(setup, kl):
    batch, graphdef, ts, ref = setup
    cfg = dataclasses.replace(BASE, kl=kl, num_micro_batches=2)
    _, _, met1 = make_train_step(graphdef, cfg, donate=False)(ts, batch, init_stare_state(cfg.stare), ref)
    mesh = make_mesh({"data": 2, "fsdp": 4})
    graphdef_s, ts_s = init_train_state(init_model(MODEL, seed=0, mesh=mesh), cfg)
    shard = jax.tree.map(lambda x: x.sharding, ts_s.params)
    ts_s = place_train_state(dataclasses.replace(ts_s, params=jax.device_put(ts.params, shard)), mesh)
    ref_s = jax.device_put(ref, shard)  # the reference sharded like the policy
    step = make_train_step(graphdef_s, cfg, mesh=mesh, train_state=ts_s, donate=False)
    assert step.with_ref and step.keys[-1] == ("rewards_B" if kl.as_reward else "advantages_B")
    _, _, met_s = step(ts_s, batch, init_stare_state(cfg.stare), ref_s)
    for k in ("loss", "kl"):
        np.testing.assert_allclose(float(met_s[k]), float(met1[k]), rtol=1e-5, atol=1e-7)
    g1 = np.concatenate([np.ravel(x) for x in jax.tree.leaves(met1["debug/grads"])])
    gs = np.concatenate([np.ravel(x) for x in jax.tree.leaves(met_s["debug/grads"])])
    assert np.linalg.norm(gs - g1) <= 1e-5 * np.linalg.norm(g1)


def test_entropy_advantage_through_the_step(setup):
    batch, graphdef, ts, _ = setup
    cfg = dataclasses.replace(BASE, advantage=AdvantageConfig(entropy_adv=True))
    _, _, met = make_train_step(graphdef, cfg, donate=False)(ts, batch, init_stare_state(cfg.stare))
    ent, lm = np.asarray(met["debug/entropy"], np.float64), np.asarray(met["debug/loss_mask"])
    adv = np.broadcast_to(np.asarray(batch["advantages_B"], np.float64)[:, None], ent.shape)
    tok_adv = adv + np.minimum(0.4 * ent, np.abs(adv) / 2.0)
    np.testing.assert_allclose(float(met["loss"]), np_agg(-tok_adv * lm, lm, "token-mean"), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(met["entropy_adv/bonus_mean"]), ((tok_adv - adv) * lm).sum() / lm.sum(), rtol=1e-5)


def test_reference_from_a_folder_or_initial_and_bad_references(tmp_path):
    """training.setup.reference_params: 'initial' = a copy of the given (starting) params; a Hugging Face folder = its
    weights on the policy's shardings; another architecture or a missing folder is a TrainingError naming
    rl.kl.reference."""
    models.save_pretrained(init_model(MODEL, seed=1), tmp_path / "ref")
    models.save_pretrained(init_model(MODEL.replace(hidden_size=16), seed=1), tmp_path / "other")
    params = split_model(init_model(MODEL, seed=0))[1]
    init = reference_params(load_config(None, ["rl.kl.reference=initial"]), params)
    for a, b in zip(jax.tree.leaves(init), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert a is not b  # a copy: the train state's params are donated to the step
    folder = reference_params(load_config(None, [f"rl.kl.reference={tmp_path / 'ref'}"]), params, log=print)
    want = split_model(models.from_pretrained(tmp_path / "ref"))[1]
    for a, b in zip(jax.tree.leaves(folder), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert reference_params(load_config(None), params) is None
    with pytest.raises(TrainingError, match=r"rl.kl.reference = '.*other': its parameters differ"):
        reference_params(load_config(None, [f"rl.kl.reference={tmp_path / 'other'}"]), params)
    with pytest.raises(TrainingError, match=r"rl.kl.reference = '.*nowhere' is neither 'initial' nor"):
        reference_params(load_config(None, [f"rl.kl.reference={tmp_path / 'nowhere'}"]), params)
