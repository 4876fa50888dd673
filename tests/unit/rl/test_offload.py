"""rl.offload.optimizer: the AdamW moments live in host memory (memory kind pinned_host) between updates and come
in for each update inside the step; the training equals keeping them on device (to rounding: the offloaded update
runs inside a lax.cond, which XLA fuses differently), on one device and on a mesh, a non-finite step is skipped with
the moments left where and as they were, and the state keeps its memory kind across steps (the step's outputs are
its next inputs). The compiled TPU step's device peak drops by the moments: tests/system/test_aot.py."""

import dataclasses

import jax
import numpy as np
import pytest

from stare_jax.config.offload import OffloadConfig
from stare_jax.models import init_model
from stare_jax.models.sharding import make_mesh
from stare_jax.rl.stare import StareConfig, init_stare_state
from stare_jax.rl.step import OptimizerConfig, TrainStepConfig, init_train_state, make_train_step, place_train_state
from support.params import representative
from support.rl import TINY_STEP_MODEL, random_train_batch

MODEL = TINY_STEP_MODEL
CFG = TrainStepConfig(
    optimizer=OptimizerConfig(lr=1e-3),
    stare=StareConfig(enabled=True, target_entropy=50.0),
    logprob_chunk_size=8,
    num_mini_batches=2,
)


def _batch(seed):
    return random_train_batch(MODEL.vocab_size, 16, 20, seed)


def _nan_batch(seed):
    b = _batch(seed)
    return dict(b, advantages_B=np.where(np.arange(16) % 8 == 3, np.nan, b["advantages_B"]).astype(np.float32))


def _kinds(tree):
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


def _train(cfg, mesh, steps=2, batch_fn=None):
    model = init_model(MODEL, seed=0, mesh=mesh)
    graphdef, ts = init_train_state(model, cfg)
    if mesh is not None:
        ts = place_train_state(ts, mesh)
    kinds = _kinds(ts.opt_state)
    step = make_train_step(graphdef, cfg, mesh=mesh, train_state=ts if mesh is not None else None)
    ss = init_stare_state(cfg.stare)
    for s in range(steps):
        ts, ss, met = step(ts, (batch_fn or _batch)(s), ss)
        assert _kinds(ts.opt_state) == kinds  # the step hands the moments back where they live
    return kinds, jax.device_get(ts), jax.device_get(met)


@pytest.mark.parametrize("mesh_axes", representative([None, {"data": 2, "fsdp": 4}]), ids=["one-device", "mesh-2x4"])
def test_offloaded_optimizer_trains_identically(mesh_axes):
    mesh = make_mesh(mesh_axes) if mesh_axes else None
    off_kinds, off, m_off = _train(dataclasses.replace(CFG, offload=OffloadConfig(optimizer=True)), mesh)
    on_kinds, on, m_on = _train(CFG, mesh)
    assert off_kinds == {"pinned_host"} and on_kinds == {"device"}
    for a, b in zip(jax.tree.leaves((off.params, off.opt_state)), jax.tree.leaves((on.params, on.opt_state))):
        # to float32 rounding, which depends on the CPU's fusions: 1 ulp on earlier machines; on an AVX2-only one
        # 1.8e-9 where terms cancel in a leaf of scale 0.47, and 4e-6 relative in a few moments on the 2 x 4 mesh.
        # An update applied wrongly (skipped, twice, moments not written back) is off by ~lr = 1e-3 or more.
        b = np.asarray(b)
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-6 * float(np.abs(b).max()))
    np.testing.assert_allclose(float(m_off["loss"]), float(m_on["loss"]), rtol=1e-6)
    np.testing.assert_allclose(float(m_off["grad_norm"]), float(m_on["grad_norm"]), rtol=1e-6)


@pytest.mark.parametrize("mesh_axes", representative([None, {"data": 2, "fsdp": 4}]), ids=["one-device", "mesh-2x4"])
def test_offloaded_nonfinite_step_is_skipped(mesh_axes):
    """A NaN advantage in each mini-batch: every update of the step is skipped; params and the host-resident
    moments come back equal to the initial ones, still in host memory."""
    mesh = make_mesh(mesh_axes) if mesh_axes else None
    cfg = dataclasses.replace(CFG, offload=OffloadConfig(optimizer=True))
    model = init_model(MODEL, seed=0, mesh=mesh)
    _, ts0 = init_train_state(model, cfg)
    init = jax.device_get((ts0.params, ts0.opt_state))
    kinds, final, met = _train(cfg, mesh, steps=1, batch_fn=_nan_batch)
    assert kinds == {"pinned_host"} and float(met["skipped_updates"]) == float(met["num_updates"]) == 2.0
    for a, b in zip(jax.tree.leaves(init), jax.tree.leaves((final.params, final.opt_state))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
