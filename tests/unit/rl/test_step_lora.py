"""The train step on a LoRA model (ModelConfig.lora_rank > 0): only the adapters train (the base rides in
TrainState.rest and comes out bit-identical, the optimizer state covers the adapters alone), the first step's
forward metrics equal the full-parameter step's (B starts at zero: the adapted policy is the base), and a KL
reference 'initial' (a copy of the starting adapters over the same frozen base) is the base policy itself."""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from stare_jax.config.kl import KLConfig
from stare_jax.models import init_model
from stare_jax.rl.stare import StareConfig, init_stare_state
from stare_jax.rl.step import OptimizerConfig, TrainStepConfig, init_train_state, make_train_step, trainable
from support.rl import TINY_STEP_MODEL, random_train_batch

MODEL = dataclasses.replace(TINY_STEP_MODEL, num_layers=2)
LORA = dataclasses.replace(
    MODEL,
    lora_rank=4,
    lora_alpha=8.0,
    lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
)
STARE_ON = StareConfig(enabled=True, variant="O1", w=1.5, target_entropy=50.0)
CFG = TrainStepConfig(optimizer=OptimizerConfig(lr=1e-2), stare=STARE_ON, logprob_chunk_size=8)
B, L = 16, 20


def _leaves(tree):
    return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.fixture(scope="module")
def batch():
    return random_train_batch(MODEL.vocab_size, B, L, 0)


def _run(model_cfg, cfg, batch, steps=1):
    model = init_model(model_cfg, seed=0)
    graphdef, ts0 = init_train_state(model, cfg)
    step = make_train_step(graphdef, cfg, donate=False)
    ts, ss, mets = ts0, init_stare_state(cfg.stare), []
    for _ in range(steps):
        ts, ss, met = step(ts, batch, ss, ts0.params) if cfg.kl.enabled else step(ts, batch, ss)
        mets.append(met)
    return model, ts0, ts, mets


def test_only_the_adapters_train(batch):
    model, ts0, ts1, _ = _run(LORA, CFG, batch, steps=2)
    assert trainable(model) is nnx.LoRAParam
    names = {"/".join(map(str, p)) for p, _ in nnx.to_flat_state(ts0.params)}
    assert names and all(n.endswith(("lora_a", "lora_b")) for n in names)
    assert len(names) == 2 * 7 * LORA.num_layers
    for a, b in zip(_leaves(ts0.rest), _leaves(ts1.rest)):  # the frozen base: bit-identical
        np.testing.assert_array_equal(a, b)
    changed = [not np.array_equal(a, b) for a, b in zip(_leaves(ts0.params), _leaves(ts1.params))]
    assert all(changed)  # every A and B moved (B from zero: the update reaches A from the second step on)
    n_adapter = sum(x.size for x in _leaves(ts0.params))
    n_opt = sum(np.size(x) for x in _leaves(ts0.opt_state))
    assert n_opt <= 2 * n_adapter + 16  # AdamW's two moments of the adapters, plus counters: no base moments


def test_first_step_forward_equals_the_full_parameter_step(batch):
    _, _, _, lora = _run(LORA, CFG, batch)
    _, _, _, full = _run(MODEL, CFG, batch)
    for key in ("entropy", "stare/frac_reweighted", "clipfrac"):
        np.testing.assert_allclose(float(lora[0][key]), float(full[0][key]), rtol=1e-6, err_msg=key)


def test_kl_reference_initial_is_the_frozen_base(batch):
    cfg = dataclasses.replace(CFG, kl=KLConfig(coef=0.1, reference="initial"))
    _, _, _, mets = _run(LORA, cfg, batch, steps=2)
    assert abs(float(mets[0]["kl"])) < 1e-6  # step 1: policy = base = reference
    assert float(mets[1]["kl"]) > 0  # the adapters moved away from the base
