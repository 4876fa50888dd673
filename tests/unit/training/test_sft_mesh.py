"""`stare-jax sft` on a mesh: the SFT step sharded over 8 (fake CPU) devices equals the single-device step, and
micro-batches with gradient accumulation equal the whole batch (losses and parameters, fp32), on a tiny random
Hugging Face folder loaded the way `run_conversation_sft` loads it; bf16 compute keeps fp32 master weights; a
batch that does not split over the mesh is a config error naming the keys. (Remat: the ahead-of-time SFT compile in
tests/system/test_aot.py, with the shipped config's remat_policy full.)"""

import jax
import numpy as np
import pytest

from stare_jax import models
from stare_jax.config.options import ConfigError
from stare_jax.models.sharding import make_mesh
from stare_jax.rl.step import split_model
from stare_jax.training.sft import ConversationSFTConfig, SFTConfig, pack_masked, sft_train

MODEL = models.ModelConfig(
    vocab_size=96,
    hidden_size=32,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=64,
    max_position_embeddings=128,
    architecture="Qwen2ForCausalLM",
    qkv_bias=True,
    tie_word_embeddings=True,
    initializer_range=0.3,
)
BATCH, LENGTH = 8, 33
CFG = SFTConfig(steps=2, batch_size=BATCH, lr=3e-3, warmup_steps=0, seed=0, chunk_size=8)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_sft_model")
    models.save_pretrained(models.init_model(MODEL, seed=0), folder)
    return folder


def _sample_batch(rng: np.random.Generator, batch_size: int):
    """Conversations of random lengths with assistant spans at random places (a different count of trained
    tokens per row, so a per-micro-batch normaliser would differ from the whole batch's)."""
    rows = []
    for _ in range(batch_size):
        n = int(rng.integers(8, LENGTH + 1))
        ids = rng.integers(1, MODEL.vocab_size, size=n).astype(np.int32)
        mask = np.zeros(n, np.int32)
        a = int(rng.integers(1, n - 2))
        mask[a : a + int(rng.integers(1, n - a))] = 1
        rows.append((ids, mask))
    return pack_masked(rows, 0, LENGTH)


def _train(folder, cfg: SFTConfig, mesh=None, **overrides):
    model = models.from_pretrained(folder, mesh=mesh, **overrides)
    losses = sft_train(model, _sample_batch, cfg, mesh=mesh)
    params = split_model(model)[1]
    return np.asarray(losses), {k: np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(params)}, params


@pytest.fixture(scope="module")
def single(hf_folder):
    return _train(hf_folder, CFG)


def _assert_same(a, b, tol=1e-5, param_atol=1e-4):
    """Losses to tol; parameters to param_atol (3% of one AdamW step of lr 3e-3): Adam divides each gradient by its
    own running scale, so a near-zero gradient component whose few-ulp difference (another summation order on the
    mesh) is large relative to itself moves its parameter by a visibly different fraction of lr (seen: 2.5e-5)."""
    np.testing.assert_allclose(a[0], b[0], rtol=tol, atol=tol)
    assert a[1].keys() == b[1].keys()
    for k in a[1]:
        np.testing.assert_allclose(a[1][k], b[1][k], rtol=tol, atol=param_atol, err_msg=str(k))


def test_micro_batches_equal_the_whole_batch(hf_folder, single):
    micro = _train(hf_folder, SFTConfig(**{**CFG.__dict__, "micro_batches": 4}))
    _assert_same(micro, single)


def test_mesh_equals_one_device(hf_folder, single):
    """data 2 x fsdp 2 x tensor 2 over the 8 fake devices, 2 micro-batches of 4 rows (one per data shard)."""
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2}, devices=jax.devices()[:8])
    sharded = _train(hf_folder, SFTConfig(**{**CFG.__dict__, "micro_batches": 2}), mesh=mesh)
    _assert_same(sharded, single)
    # the parameters stayed sharded (FSDP / tensor rules): the MLP's up projection is split over 2 x 2 devices
    shardings = {str(k): v.sharding for k, v in jax.tree_util.tree_leaves_with_path(sharded[2])}
    up = next(s for k, s in shardings.items() if "up" in k)
    assert up.mesh.shape == mesh.shape and len(up.device_set) == 8 and not up.is_fully_replicated


def test_bf16_compute_keeps_fp32_master_weights(hf_folder, single):
    losses, params, _ = _train(hf_folder, CFG, dtype="bfloat16", param_dtype="float32")
    assert all(v.dtype == np.float32 for v in params.values())
    np.testing.assert_allclose(losses, single[0], rtol=2e-2)


def test_micro_batch_size_must_split_the_batch():
    cfg = ConversationSFTConfig(batch_size=32, micro_batch_size=4)
    assert cfg.micro_batches(1) == 8 and cfg.micro_batches(4) == 2 and cfg.micro_batches(8) == 1
    assert ConversationSFTConfig(batch_size=32).micro_batches(4) == 1  # 0: the whole batch at once
    with pytest.raises(
        ConfigError,
        match=r"'batch_size' = 32 does not split into micro-batches of "
        r"'micro_batch_size' = 3 x 2 data shard",
    ):
        ConversationSFTConfig(batch_size=32, micro_batch_size=3).micro_batches(2)
    with pytest.raises(ConfigError, match=r"'micro_batch_size' = all x 64 data shard"):
        ConversationSFTConfig(batch_size=32).micro_batches(64)
