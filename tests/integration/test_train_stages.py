"""The RL loop's stages one at a time, in-process (test_train.py runs the whole loop as users do, in a subprocess):
open_run -> collect (collect.collect_batch) -> update -> step_record -> evaluate -> save, on the embedded toy task
with a tiny model on the 8-device test mesh; and the loop's derived static config (training.setup.train_step_config)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from stare_jax import models
from stare_jax.config.loader import load_config
from stare_jax.config.packing import PackingConfig
from stare_jax.rl.step import TrainStepConfig, make_train_step, split_model
from stare_jax.sampling import Engine
from stare_jax.toy import assets as toy
from stare_jax.training.collect import CollectedBatch, Rollouts, train_batch_from_rollouts
from stare_jax.training.loop import open_run, run_training, step_record, update_was_finite
from stare_jax.training.metrics import read_metrics
from stare_jax.training.setup import DERIVED_STEP_FIELDS, TrainingError, make_sampler, train_step_config

# 4 prompts x 4 responses on the 8-device test mesh (fsdp=8): micro-batches of 2 sequences per device
TINY = [
    "toy.hidden_size=32",
    "toy.num_layers=2",
    "toy.sft_steps=60",
    "toy.num_train=200",
    "toy.num_eval=8",
    "rl.train_batch_size=4",
    "rl.group_size=4",
    "rl.gen_batch_size=8",
    "rl.micro_batch_size=2",
    "logging.eval_every_steps=1",
    "logging.tensorboard=false",
    "logging.progress_bar=false",
    "checkpoint.async_save=false",
    "sampling.eval_num_samples=2",
    "total_steps=3",
]


def test_every_step_field_is_an_rl_option_of_the_same_name_or_derived():
    cfg = load_config(
        "configs/tiny_cpu_stare.yaml",
        ["rl.clip_high=0.3", "rl.ppo_epochs=2", "rl.mini_batches=2", "optimizer.schedule=cosine", "total_steps=7"],
    )
    tcfg = train_step_config(cfg)
    for f in dataclasses.fields(TrainStepConfig):
        if f.name not in DERIVED_STEP_FIELDS:
            assert getattr(tcfg, f.name) == getattr(cfg.rl, f.name), f.name
    assert tcfg.clip_high == 0.3 and tcfg.ppo_epochs == 2 and tcfg.num_mini_batches == 2
    assert tcfg.optimizer == dataclasses.replace(cfg.optimizer, total_steps=7 * 2 * 2)  # counted in updates
    assert tcfg.stare is cfg.rl.stare
    with pytest.raises(TrainingError, match="rl.mini_batches=3"):
        train_step_config(load_config("configs/tiny_cpu_stare.yaml", ["rl.mini_batches=3"]))
    packed = train_step_config(
        load_config("configs/tiny_cpu_stare.yaml", ["rl.packing.enabled=true", "rl.micro_batch_tokens=256"])
    )
    assert packed.packing.enabled and packed.micro_batch_tokens == 256
    longest = cfg.data.max_prompt_len + cfg.sampling.max_new_tokens
    with pytest.raises(TrainingError, match=rf"rl.packing.row_tokens=8 is shorter .* = {longest}"):
        train_step_config(
            load_config("configs/tiny_cpu_stare.yaml", ["rl.packing.enabled=true", "rl.packing.row_tokens=8"])
        )
    with pytest.raises(TrainingError, match="rl.packing.enabled cannot be combined with rl.stare.scope"):
        train_step_config(
            load_config("configs/tiny_cpu_stare.yaml", ["rl.packing.enabled=true", "rl.stare.scope=micro_batch"])
        )


@pytest.fixture(scope="module")
def toy_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("toycache")


@pytest.fixture(scope="module")
def run(tmp_path_factory, toy_cache):
    run_dir = tmp_path_factory.mktemp("stages") / "run"
    cfg = load_config("configs/tiny_cpu_stare.yaml", [f"toy.cache_dir={toy_cache}", *TINY])
    r = open_run(cfg, run_dir, resume=False, inputs_for=toy.run_inputs, log=lambda *_: None)
    yield r
    r.close()


def test_collect_keeps_varied_groups_with_grpo_advantages(run):
    state = run.stream.state()
    a = run.collect(0)
    run.stream.restore(state)
    b = run.collect(0)  # randomness is a function of (seed, step, generation batch) and the stream position
    for k in a.batch:
        np.testing.assert_array_equal(a.batch[k], b.batch[k])
    P, G = run.cfg.rl.train_batch_size, run.cfg.rl.group_size
    assert a.kept.correct_PxG.shape == (P, G) and a.num_gen_batches >= 1
    assert (a.kept.correct_PxG.std(axis=1) > 0).all()  # dynamic sampling keeps only groups whose rewards vary
    r = a.rewards_PxG
    adv = (r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-6)  # verl's GRPO, NumPy
    np.testing.assert_allclose(a.batch["advantages_B"], adv.reshape(-1), rtol=1e-5, atol=1e-6)
    expect = train_batch_from_rollouts(a.kept, adv)
    for k in ("input_ids_BxT", "attention_mask_BxT", "response_mask_BxT"):
        np.testing.assert_array_equal(a.batch[k], expect[k])
    assert a.correct_all.size == a.num_gen_batches * run.cfg.rl.gen_batch_size * G
    assert a.metrics().keys() >= {
        "reward_mean",
        "accuracy",
        "train_accuracy",
        "response_len_mean",
        "kept_groups_frac",
        "num_gen_batches",
        "gen_time_s",
    }
    assert a.batch["input_ids_BxT"].shape[0] == P * G


def test_update_record_evaluate_and_save(run):
    collected = run.collect(0)
    before = jax.device_get(run.train_state.params)
    metrics, seconds = run.update(collected.batch)
    after = jax.device_get(run.train_state.params)
    assert seconds > 0 and np.isfinite(metrics["loss"])
    assert any(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(before), jax.tree.leaves(after)))
    record = step_record(run.cfg, collected, metrics, step_time_s=1.0, train_time_s=seconds)
    assert update_was_finite(record) and record["stare_enabled"] and record["target_entropy"] == 0.7
    assert record["gate_on"] == bool(metrics["gate_on"])
    ev = run.evaluate(1)
    assert 0.0 <= ev["eval/accuracy"] <= 1.0 and "eval/heldout/response_len_mean" in ev
    assert run.eval_due(1) and run.eval_due(run.cfg.total_steps)
    run.save(1, force=True)
    run.ckpt.wait()
    assert run.ckpt.latest_step() == 1


def test_update_with_packing_is_the_padded_update(run):
    """rl.packing in the loop: Run.update lays the collected batch out in packed rows (host_layout) for a packed
    step on the mesh; its loss, entropy, response tokens and gradient norm are the padded step's."""
    collected = run.collect(1)
    start = jax.tree.map(jnp.copy, (run.train_state, run.stare_state))
    padded, _ = run.update(collected.batch)
    tcfg = dataclasses.replace(run.step_config, packing=PackingConfig(enabled=True), micro_batch_tokens=64)
    step_fn, step_config = run.step_fn, run.step_config
    run.train_state, run.stare_state = start
    run.step_fn = make_train_step(run.graphdef, tcfg, mesh=run.sampler.mesh, train_state=run.train_state)
    run.step_config = tcfg
    try:
        packed, _ = run.update(collected.batch)
    finally:
        run.step_fn, run.step_config = step_fn, step_config
    for k in ("loss", "entropy", "grad_norm", "response_tokens", "stare_w", "gate_on"):
        np.testing.assert_allclose(packed[k], padded[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_record_of_grpo_ds_has_unit_weights_and_flags_nonfinite_updates():
    cfg = load_config("configs/tiny_cpu_grpo_ds.yaml")
    kept = Rollouts(
        np.zeros((1, 2), np.int32),
        np.ones((1, 2), np.int32),
        np.zeros((1, 2, 3), np.int32),
        np.array([[3, 1]]),
        np.array([[1.0, 0.0]], np.float32),
    )
    collected = CollectedBatch(
        {},
        kept,
        np.array([[1.0, 0.0]]),
        np.array([1.0, 0.0, 0.0, 0.0]),
        np.array([3, 1, 2, 2]),
        {"n_items": 4},
        1,
        2,
        1,
        0.5,
    )
    m = {
        "entropy": 0.4,
        "stare_w": 1.3,
        "stare_m": 0.8,
        "gate_on": True,
        "clipfrac": 0.0,
        "clipfrac_lower": 0.0,
        "approx_kl": 0.0,
        "loss": float("nan"),
        "grad_norm": 1.0,
        "skipped_updates": 1.0,
    }
    rec = step_record(cfg, collected, m, step_time_s=2.0, train_time_s=1.0)
    assert rec["stare_w"] == rec["stare_m"] == 1.0 and rec["gate_on"] is False  # GRPO-ds never reweights
    assert rec["accuracy"] == 0.25 and rec["train_accuracy"] == 0.5 and rec["kept_groups_frac"] == 0.5
    assert rec["reward/n_items"] == 4 and not update_was_finite(rec)


def test_collect_with_the_rollout_engine_draws_the_same_samples(run):
    """sampling.engine.enabled swaps the static sampler for the engine (training.setup.make_sampler): the same keys per
    (prompt, sample, position), so the same train batch -- on one device and on the run's fsdp=8 mesh (each data
    shard its own slots and page pool)."""
    cfg = dataclasses.replace(
        run.cfg,
        sampling=dataclasses.replace(
            run.cfg.sampling,
            engine=dataclasses.replace(run.cfg.sampling.engine, enabled=True, max_slots=8, page_size=4),
        ),
    )
    state = run.stream.state()
    static = run.collect(5)
    model = nnx.merge(run.graphdef, run.train_state.params, run.train_state.rest)
    for mesh in (None, run.sampler.mesh):
        static_sampler, run.sampler = run.sampler, make_sampler(model, cfg, mesh, run.tokenizer.pad_id)
        try:
            assert isinstance(run.sampler, Engine) and run.sampler.data_shards == (1 if mesh is None else 8)
            run.stream.restore(state)
            paged = run.collect(5)
        finally:
            run.sampler = static_sampler
        for k in static.batch:
            if k == "rollout_logprobs_BxT":  # the two programs' log-probs of the same tokens: equal to rounding
                np.testing.assert_allclose(paged.batch[k], static.batch[k], atol=1e-5, err_msg=f"{k} (mesh {mesh})")
            else:
                np.testing.assert_array_equal(paged.batch[k], static.batch[k], err_msg=f"{k} (mesh {mesh})")


def test_auto_max_slots_on_this_host_is_one_slot_per_response(run):
    """sampling.engine.max_slots=auto is resolved by make_sampler for the devices the run has: the CPU reports no
    HBM figure, so one slot per response of a generation batch (rl.gen_batch_size x rl.group_size), logged."""
    cfg = dataclasses.replace(
        run.cfg,
        sampling=dataclasses.replace(
            run.cfg.sampling, engine=dataclasses.replace(run.cfg.sampling.engine, enabled=True, max_slots="auto")
        ),
    )
    model = nnx.merge(run.graphdef, run.train_state.params, run.train_state.rest)
    lines: list[str] = []
    engine = make_sampler(model, cfg, None, run.tokenizer.pad_id, log=lines.append)
    slots = cfg.rl.gen_batch_size * cfg.rl.group_size
    assert isinstance(engine, Engine) and engine.engine_config.max_slots == slots
    assert lines == [
        f"sampling.engine.max_slots=auto -> {slots} (no HBM figure on this host: one slot per response "
        f"of a generation batch)"
    ]
    static_cfg = dataclasses.replace(
        cfg, sampling=dataclasses.replace(cfg.sampling, engine=dataclasses.replace(cfg.sampling.engine, enabled=False))
    )
    assert not isinstance(make_sampler(model, static_cfg, None, run.tokenizer.pad_id, log=lines.append), Engine)
    assert len(lines) == 1  # resolved only where the engine is built


def test_kl_reference_is_the_starting_policy_also_after_resume(toy_cache, tmp_path):
    """rl.kl.reference 'initial' is re-derived from model.path when a run opens: on resume it is still the run's
    starting weights, not the restored (trained) policy; it is not in the checkpoint."""
    over = [
        f"toy.cache_dir={toy_cache}",
        *TINY,
        "rl.kl.reference=initial",
        "rl.kl.coef=0.01",
        # an entropy bonus moves the policy in the first update even where every advantage of the tiny batch is 0
        # (without it the update was rounding noise: kl at step 2 was ~1e-9, and exactly 0 under other numerics)
        "rl.entropy_coeff=0.01",
        "checkpoint.every_steps=1",
        "total_steps=2",
        "logging.eval_every_steps=0",
    ]
    cfg = load_config("configs/tiny_cpu_grpo_kl.yaml", over)
    summary = run_training(cfg, tmp_path / "run", inputs_for=toy.run_inputs, log=lambda *_: None)
    assert summary["new_compiles_per_step"][1:] == [0]  # the step with the reference: no recompile after warm-up
    recs = read_metrics(tmp_path / "run")
    assert recs[0]["kl"] == 0.0 and recs[1]["kl"] > 1e-6  # the reference is the policy before the first update
    r = open_run(cfg, tmp_path / "run", resume=True, inputs_for=toy.run_inputs, log=lambda *_: None)
    try:
        assert r.start_step == 2
        model_dir = toy.prepare(toy.asset_config(cfg.toy), toy_cache, log=lambda *_: None).model_dir
        initial = split_model(models.from_pretrained(model_dir, mesh=r.sampler.mesh))[1]
        for ref, init, now in zip(
            jax.tree.leaves(r.ref_params), jax.tree.leaves(initial), jax.tree.leaves(r.train_state.params)
        ):
            np.testing.assert_array_equal(np.asarray(ref), np.asarray(init))
        assert any(
            not np.array_equal(np.asarray(a), np.asarray(b))
            for a, b in zip(jax.tree.leaves(r.ref_params), jax.tree.leaves(r.train_state.params))
        )
        saved = r.ckpt.restore(abstract_state=None)
        assert set(saved.state) == {"train_state", "stare_state"}  # the reference is not checkpointed
    finally:
        r.close()
