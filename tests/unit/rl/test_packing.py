"""Sequence packing and token-budget micro-batches (stare_jax.rl.packing): the bin packing, the packed batch, the
model on packed rows (attention within a segment, positions restarting) on every attention path, and the train
step on the packed layout == the padded one (log-probs, entropy, omega, loss, gradient, metrics) on one device and
an 8-device mesh, every aggregation mode, STARE on, the sequence-level losses; 0 recompiles over varying lengths."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from stare_jax.config.kl import KLConfig
from stare_jax.config.packing import PackingConfig
from stare_jax.config.policy_loss import PolicyLossConfig, TokenFilterConfig
from stare_jax.models import ModelConfig, init_model
from stare_jax.models.sharding import make_mesh
from stare_jax.rl.packing import (
    fill_rate,
    first_fit_decreasing,
    host_layout,
    pack_batch,
    packed_stats,
    trim_padded_batch,
)
from stare_jax.rl.stare import StareConfig, init_stare_state
from stare_jax.rl.step import (
    OptimizerConfig,
    TrainStepConfig,
    init_train_state,
    make_train_step,
    place_train_state,
    split_model,
)
from support.models import COMMON
from support.params import representative
from support.rl import random_train_batch


def _family(name: str, **kw) -> ModelConfig:
    """stare_jax configs with the shapes of _model_fixtures' tiny HF checkpoints (Qwen2: q/k/v bias, untied;
    Qwen3: q/k norm, head_dim 16, tied; Llama: llama3 RoPE scaling, untied)."""
    c = dict(
        vocab_size=COMMON["vocab_size"],
        hidden_size=COMMON["hidden_size"],
        num_layers=COMMON["num_hidden_layers"],
        num_heads=COMMON["num_attention_heads"],
        num_kv_heads=COMMON["num_key_value_heads"],
        intermediate_size=COMMON["intermediate_size"],
        max_position_embeddings=COMMON["max_position_embeddings"],
        initializer_range=COMMON["initializer_range"],
    )
    extra = {
        "qwen2": dict(qkv_bias=True, rope_theta=10000.0),
        "qwen3": dict(qk_norm=True, head_dim=16, tie_word_embeddings=True, rope_theta=1e6),
        "llama": dict(
            rope_theta=5e5,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    }[name]
    return ModelConfig(**{**c, **extra, **kw})


B, L, ROW = 16, 24, 40  # 16 sequences of <= 24 tokens, packed into rows of 40
STARE_ON = StareConfig(enabled=True, variant="O1", w=1.5, target_entropy=50.0)  # the batch gate is on
BASE = TrainStepConfig(
    optimizer=OptimizerConfig(lr=1e-3),
    stare=STARE_ON,
    logprob_chunk_size=8,
    debug_outputs=True,
    loss_agg_constant=float(L - 1),
)


def _packed_cfg(cfg, tokens=2 * ROW):
    return dataclasses.replace(cfg, packing=PackingConfig(enabled=True, row_tokens=ROW), micro_batch_tokens=tokens)


def _layout(batch, cfg, shards=1):
    return host_layout(batch, cfg, shards)


# ------------------------------------------------------------------------------------------------ host side


def test_first_fit_decreasing_bins_every_item_once_within_capacity():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 100, size=300)
    bins = first_fit_decreasing(lengths, 100)
    assert sorted(i for b in bins for i in b) == list(range(300))
    assert all(lengths[b].sum() <= 100 for b in bins)
    assert len(bins) >= -(-lengths.sum() // 100)  # no fewer bins than the volume bound
    # the textbook case: decreasing order and the first bin with room
    assert first_fit_decreasing([4, 8, 1, 4, 2, 1], 10) == [[1, 4], [0, 3, 2, 5]]
    assert first_fit_decreasing([0, 3], 3) == [[1]]
    with pytest.raises(ValueError, match="exceeds the bin capacity 10"):
        first_fit_decreasing([11], 10)


def test_fill_rate_on_a_long_tailed_length_distribution():
    """Lengths lognormal with median max/8 (the benchmark's distribution): FFD fills the rows to >= 95%."""
    rng = np.random.default_rng(0)
    lengths = np.clip(np.round(rng.lognormal(np.log(256), 1.0, size=512)), 1, 2048).astype(int)
    assert fill_rate(lengths, 2048) > 0.95
    assert lengths.mean() / 2048 < 0.25  # what the padded layout fills


def test_pack_batch_places_every_sequence_whole_with_its_segment():
    batch = random_train_batch(96, B, L, 0)
    packed = pack_batch(batch, row_tokens=ROW, rows_per_micro=2, num_mini_batches=2)
    assert packed["input_ids_RxT"].shape == (2 * 4 * 2, ROW)  # 2 mini-batches x ceil(8 / 2) micro x 2 rows
    attn = batch["attention_mask_BxT"]
    for b in range(B):
        real = attn[b] > 0
        r, c, n = packed["seq_row_B"][b], packed["seq_col_B"][b], packed["seq_len_B"][b]
        assert n == real.sum()
        np.testing.assert_array_equal(packed["input_ids_RxT"][r, c : c + n], batch["input_ids_BxT"][b, real])
        np.testing.assert_array_equal(packed["response_mask_RxT"][r, c : c + n], batch["response_mask_BxT"][b, real])
        seg = packed["segment_ids_RxT"][r, c : c + n]
        assert (seg == seg[0]).all() and seg[0] > 0
        assert (r // 8) == b // 8  # mini-batch j's sequences stay in mini-batch j's rows
    seg = packed["segment_ids_RxT"]
    # segment ids count up along each row, padding (0) only at the end
    for row in seg:
        used = row[row > 0]
        assert (np.diff(used) >= 0).all() and (row[len(used) :] == 0).all()
    stats = packed_stats(packed, 2)
    assert stats["tokens"] == attn.sum() and 0.5 < stats["fill_rate"] <= 1.0


def test_a_sequence_longer_than_a_row_is_refused_by_name():
    batch = random_train_batch(96, B, L, 0)
    n = batch["attention_mask_BxT"].sum(1)
    with pytest.raises(ValueError, match=rf"has {n.max()} tokens .*rl\.packing\.row_tokens=10"):
        pack_batch(batch, row_tokens=10, rows_per_micro=1)
    gap = dict(batch, attention_mask_BxT=batch["attention_mask_BxT"].copy())
    gap["attention_mask_BxT"][3, -3] = 0
    with pytest.raises(ValueError, match="row 3: its real tokens .* not contiguous"):
        pack_batch(gap, row_tokens=ROW, rows_per_micro=1)


def test_trim_padded_batch_keeps_the_sequences_in_a_power_of_two_length():
    batch = random_train_batch(96, B, L, 0)
    wide = {k: (np.pad(v, ((0, 0), (5, 40))) if v.ndim == 2 else v) for k, v in batch.items()}
    cut = trim_padded_batch(wide)
    assert cut["input_ids_BxT"].shape[1] == 32  # the used columns (<= 24) in the next power of two
    for k in ("input_ids_BxT", "response_mask_BxT"):
        np.testing.assert_array_equal(cut[k][cut["attention_mask_BxT"] > 0], batch[k][batch["attention_mask_BxT"] > 0])


# ------------------------------------------------------------------------------------------------ the model


@pytest.mark.slow  # the packed train step equals the padded one by default (test_packed_step_equals_padded_step)
@pytest.mark.parametrize(
    "family,impl", [("qwen2", "xla"), ("qwen3", "dot_product"), ("llama", "splash"), ("qwen3", "xla")]
)
def test_packed_rows_give_each_sequence_its_own_hidden_states(family, impl):
    """Attention never crosses a segment and positions restart: each sequence's hidden states in a packed row are
    those of the sequence alone (xla mask, jax.nn.dot_product_attention, splash's segment ids)."""
    cfg = _family(family, attention_impl=impl)
    model = init_model(cfg, seed=0)
    rng = np.random.default_rng(1)
    lens = [5, 9, 3, 7]
    T = 128 if impl == "splash" else 32
    seqs = [rng.integers(3, cfg.vocab_size, n) for n in lens]
    ids = np.zeros((1, T), np.int32)
    seg = np.zeros((1, T), np.int32)
    col = 0
    for k, s in enumerate(seqs):
        ids[0, col : col + len(s)], seg[0, col : col + len(s)] = s, k + 1
        col += len(s)
    packed = np.asarray(model.hidden_states(jnp.asarray(ids), attention_mask=jnp.asarray(seg)))
    col = 0
    for s in seqs:
        alone = np.asarray(model.hidden_states(jnp.asarray(s[None].astype(np.int32))))[0]
        np.testing.assert_allclose(packed[0, col : col + len(s)], alone, atol=2e-5, rtol=1e-5)
        col += len(s)


# ------------------------------------------------------------------------------------------------ the train step


def _run(cfg, batch, model_cfg, mesh=None):
    """The step's outputs on `batch` laid out for cfg, from the same initial parameters (seed 0); with rl.kl the
    reference is another policy (seed 1), sharded like the params on a mesh."""
    graphdef, ts = init_train_state(init_model(model_cfg, seed=0), cfg)
    ref = split_model(init_model(model_cfg, seed=1))[1] if cfg.kl.enabled else None
    shards = 1
    if mesh is not None:
        graphdef, ts_s = init_train_state(init_model(model_cfg, seed=0, mesh=mesh), cfg)
        shard = jax.tree.map(lambda x: x.sharding, ts_s.params)
        ts = place_train_state(dataclasses.replace(ts_s, params=jax.device_put(ts.params, shard)), mesh)
        ref = None if ref is None else jax.device_put(ref, shard)
        shards = mesh.size
    step = make_train_step(graphdef, cfg, mesh=mesh, train_state=ts if mesh is not None else None, donate=False)
    init = jax.device_get(ts.params)
    refs = [ref] if cfg.kl.enabled else []
    new, ss, met = step(ts, _layout(batch, cfg, shards), init_stare_state(cfg.stare), *refs)
    return jax.device_get(met), jax.device_get(new.params), init


def _per_sequence(x, mask):
    """Each sequence's values on its loss tokens, in order (padded [B, L-1] or packed view [B, Lr-1] alike)."""
    return [np.asarray(x)[b][np.asarray(mask)[b] > 0] for b in range(len(x))]


def _assert_same(padded, packed, tol=1e-5):
    (m1, p1, init), (m2, p2, _) = padded, packed
    assert set(m1) == set(m2)
    kl_keys = [k for k in ("kl", "kl_loss", "kl/reward_penalty") if k in m1]
    for k in ["loss", "entropy", "grad_norm", "clipfrac", "approx_kl", "omega_mean_used"] + kl_keys:
        np.testing.assert_allclose(m2[k], m1[k], rtol=tol, atol=tol, err_msg=k)
    for k in ["response_tokens", "gate_on", "skipped_updates"] + [k for k in m1 if k.startswith("stare/")]:
        np.testing.assert_allclose(float(m2[k]), float(m1[k]), rtol=1e-6, err_msg=k)
    lm1, lm2 = m1["debug/loss_mask"], m2["debug/loss_mask"]
    assert lm1.sum() == lm2.sum()
    for k, t in (("debug/old_logprobs", tol), ("debug/entropy", tol), ("debug/omega", 0.0)):
        for a, b in zip(_per_sequence(m1[k], lm1), _per_sequence(m2[k], lm2)):
            np.testing.assert_allclose(b, a, atol=t, rtol=t, err_msg=k)
    g1, g2 = (np.concatenate([np.ravel(x) for x in jax.tree.leaves(m["debug/grads"])]) for m in (m1, m2))
    assert np.abs(g2 - g1).max() <= tol * max(1.0, np.abs(g1).max())
    # the AdamW update (its first step is ~lr * sign(g), so compare it as a whole, as test_rl_train_step does)
    d1, d2 = (np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(p)]) for p in (p1, p2))
    p0 = np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(init)])
    assert np.linalg.norm(d2 - d1) <= 1e-3 * np.linalg.norm(d1 - p0)


@pytest.mark.parametrize(
    "family,agg",
    representative(
        [
            ("qwen2", "token-mean"),
            ("qwen3", "seq-mean-token-sum"),
            ("llama", "seq-mean-token-mean"),
            ("qwen2", "seq-mean-token-sum-norm"),
        ]
    ),
)
def test_packed_step_equals_padded_step(family, agg):
    """One device, STARE-O1 on, each aggregation mode: packed == padded to 1e-5 (log-probs, entropy, omega, loss,
    gradient, the update), the selection identical."""
    model_cfg = _family(family)
    batch = random_train_batch(model_cfg.vocab_size, B, L, 0)
    cfg = dataclasses.replace(BASE, loss_agg=agg)
    _assert_same(_run(cfg, batch, model_cfg), _run(_packed_cfg(cfg), batch, model_cfg))


@pytest.mark.parametrize("name", representative(["gspo", "geo_mean", "sapo"]))
def test_packed_sequence_level_losses_equal_padded(name):
    """GSPO's sequence ratio, geo_mean's per-sequence mean and sapo (seq-mean-token-mean) read each sequence back
    from its segment: packed == padded; with the entropy bonus, 2 mini-batches and 2 epochs."""
    model_cfg = _family("qwen2", num_layers=1)
    batch = random_train_batch(model_cfg.vocab_size, B, L, 1)
    cfg = dataclasses.replace(
        BASE,
        stare=StareConfig(),
        policy_loss=PolicyLossConfig(name=name),
        entropy_coeff=0.0 if name == "geo_mean" else 0.01,
        num_mini_batches=2,
        ppo_epochs=2,
    )
    _assert_same(_run(cfg, batch, model_cfg), _run(_packed_cfg(cfg, tokens=ROW), batch, model_cfg))


@pytest.mark.slow
def test_packed_step_equals_padded_on_an_8_device_mesh():
    """data 2 x fsdp 4: STARE-O1 with the 80/20 filter, 2 mini-batches, packed micro-batches of one row per device:
    packed on the mesh == padded on one device (slow: ~80 s uncached on 2 cores; test_train_stages runs a packed
    update on the 8-device mesh in the default tier)."""
    model_cfg = _family("qwen3")
    batch = random_train_batch(model_cfg.vocab_size, B, L, 2)
    cfg = dataclasses.replace(
        BASE, token_filter=TokenFilterConfig(enabled=True, rho=0.5), num_mini_batches=2, loss_agg="seq-mean-token-mean"
    )
    mesh = make_mesh({"data": 2, "fsdp": 4})
    _assert_same(_run(cfg, batch, model_cfg), _run(_packed_cfg(cfg, tokens=ROW), batch, model_cfg, mesh=mesh))


def _with_rewards(batch, seed=3):
    """batch + rewards_B (0/1 scores, each group of 4 with one of each): what rl.kl.use_as 'reward' reads."""
    acc = np.random.default_rng(seed).integers(0, 2, size=(B // 4, 4)).astype(np.float32)
    acc[:, 0], acc[:, 1] = 1, 0
    return dict(batch, rewards_B=acc.reshape(-1))


KL_CASES = {  # rl.kl as a loss term (verl use_kl_loss, each estimator family) and in the reward (use_kl_in_reward)
    "loss_low_var_kl": (KLConfig(coef=0.05, reference="initial"), "token-mean"),
    "loss_k1": (KLConfig(coef=0.05, estimator="k1", reference="initial"), "seq-mean-token-sum"),
    "reward_kl": (KLConfig(coef=0.1, use_as="reward", reference="initial"), "seq-mean-token-mean"),
}


def _kl_cfg(case, **kw):
    kl, agg = KL_CASES[case]
    return dataclasses.replace(BASE, kl=kl, loss_agg=agg, group_size=4, **kw)


@pytest.mark.parametrize(
    "case",
    [
        "loss_low_var_kl",
        pytest.param("loss_k1", marks=pytest.mark.slow),
        pytest.param("reward_kl", marks=pytest.mark.slow),
    ],
)
def test_packed_step_with_kl_equals_padded(case):
    """rl.kl with packing, one device, STARE-O1 on, 2 mini-batches: the reference's log-probs come from the packed
    rows (segment ids, per-segment positions), so kl, the KL loss term / the per-sequence KL-in-reward sums, the
    loss and the gradient are the padded layout's to 1e-5 (slow cases: ~35 s each uncached on 2 cores)."""
    model_cfg = _family("qwen2", num_layers=1)
    batch = _with_rewards(random_train_batch(model_cfg.vocab_size, B, L, 4))
    cfg = _kl_cfg(case, num_mini_batches=2)
    padded, packed = _run(cfg, batch, model_cfg), _run(_packed_cfg(cfg, tokens=ROW), batch, model_cfg)
    assert abs(float(padded[0]["kl"])) > 1e-3  # the reference is another policy: the KL term is not trivially 0
    _assert_same(padded, packed)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["loss_low_var_kl", "reward_kl"])
def test_packed_step_with_kl_on_an_8_device_mesh_equals_padded(case):
    """data 2 x fsdp 4, STARE-O1 on, the reference sharded like the policy: packed on the mesh == padded on one
    device (slow: ~60 s each uncached on 2 cores)."""
    model_cfg = _family("qwen3", num_layers=1)
    batch = _with_rewards(random_train_batch(model_cfg.vocab_size, B, L, 5))
    cfg = _kl_cfg(case)
    mesh = make_mesh({"data": 2, "fsdp": 4})
    _assert_same(_run(cfg, batch, model_cfg), _run(_packed_cfg(cfg, tokens=ROW), batch, model_cfg, mesh=mesh))


def test_pack_batch_carries_the_rewards_for_the_kl_in_reward_advantage():
    batch = _with_rewards(random_train_batch(96, B, L, 0))
    packed = pack_batch(batch, row_tokens=ROW, rows_per_micro=2)
    np.testing.assert_array_equal(packed["rewards_B"], batch["rewards_B"])
    assert "rewards_B" not in pack_batch(random_train_batch(96, B, L, 0), row_tokens=ROW, rows_per_micro=2)


def test_micro_batch_scoped_selections_are_refused_with_packing():
    with pytest.raises(ValueError, match="rl.stare.scope = 'micro_batch'"):
        _packed_cfg(
            dataclasses.replace(BASE, stare=dataclasses.replace(STARE_ON, scope="micro_batch", micro_batch_size=2))
        )
    with pytest.raises(ValueError, match="loss_agg_constant"):
        _packed_cfg(dataclasses.replace(BASE, loss_agg="seq-mean-token-sum-norm", loss_agg_constant=None))


def _long_tailed_batch(seed, L_max=48):
    """A batch whose response lengths vary from step to step (lognormal), left-padded prompts of 2-6 tokens."""
    rng = np.random.default_rng(seed)
    batch = random_train_batch(96, B, L_max, seed)
    plen = rng.integers(2, 7, size=B)
    rlen = np.clip(np.round(rng.lognormal(np.log(6 + 4 * (seed % 3)), 0.7, size=B)), 1, L_max - 8).astype(int)
    attn = np.zeros((B, L_max), np.int32)
    resp = np.zeros((B, L_max), np.int32)
    for i in range(B):
        attn[i, 8 - plen[i] : 8 + rlen[i]] = 1
        resp[i, 8 : 8 + rlen[i]] = 1
    return dict(batch, attention_mask_BxT=attn, response_mask_BxT=resp)


def test_token_budget_micro_batches_compile_once_over_varying_lengths():
    """Packed: the shapes depend on the config only, so steps over batches of varying lengths add 0 compiles after
    the first; the number of micro-batches that run follows the tokens."""
    model_cfg = _family("qwen2", num_layers=1)
    cfg = dataclasses.replace(
        BASE, debug_outputs=False, packing=PackingConfig(enabled=True, row_tokens=48), micro_batch_tokens=96
    )
    graphdef, ts = init_train_state(init_model(model_cfg, seed=0), cfg)
    step = make_train_step(graphdef, cfg, donate=False)
    ss = init_stare_state(cfg.stare)
    used = []
    for seed in range(4):
        packed = _layout(_long_tailed_batch(seed), cfg)
        used.append(packed_stats(packed, 2)["micro_batches_used"])
        ts, ss, met = step(ts, packed, ss)
        assert float(met["skipped_updates"]) == 0
    assert step._cache_size() == 1  # 0 recompiles after warm-up
    assert len(set(used)) > 1  # the lengths did vary the work


def test_padded_token_budget_follows_the_length_bucket_and_matches_the_plain_step():
    """No packing: the batch is cut to its length bucket and micro-batches hold micro_batch_tokens // L sequences;
    one program per bucket, and the loss and gradient are those of the uncut batch in one micro-batch."""
    model_cfg = _family("llama", num_layers=1)
    cfg = dataclasses.replace(BASE, micro_batch_tokens=64)
    graphdef, ts = init_train_state(init_model(model_cfg, seed=0), cfg)
    step = make_train_step(graphdef, cfg, donate=False)
    batches = [_long_tailed_batch(s) for s in (0, 2, 3, 5)]
    lengths = set()
    for b in batches:
        cut = _layout(b, cfg)
        lengths.add(cut["input_ids_BxT"].shape[1])
        _, _, met = step(ts, cut, init_stare_state(cfg.stare))
    assert step._cache_size() == len(lengths) >= 2
    plain = dataclasses.replace(BASE)
    _assert_same(_run(plain, batches[0], model_cfg), _run(cfg, batches[0], model_cfg))
