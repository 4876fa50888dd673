"""Mesh helpers, logical->mesh rules, sharded HF loading (slice reads) and sharded-forward parity."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from stare_jax.models import from_pretrained, hf_io, init_model
from stare_jax.models.sharding import (
    DEFAULT_RULES,
    activation_rules,
    logical_to_spec,
    make_mesh,
    no_sharding,
    shard_model,
    state_shardings,
)
from support.models import hf_logits, padded_batch

needs8 = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 (fake) devices")


def test_make_mesh_errors_name_both_counts():
    n = len(jax.devices())
    with pytest.raises(ValueError, match=rf"{n + 1} devices.*{n} devices"):
        make_mesh({"data": n + 1})
    with pytest.raises(ValueError, match="fsdp"):
        make_mesh({"fsdp": 0})


@needs8
def test_make_mesh_fills_standard_axes():
    mesh = make_mesh({"data": 2, "fsdp": 4})
    assert dict(mesh.shape) == {"data": 2, "fsdp": 4, "tensor": 1}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)


@needs8
def test_logical_to_spec_rules_and_divisibility():
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    assert logical_to_spec(("embed", "q_heads", "head_dim"), DEFAULT_RULES, (64, 4, 16), mesh) == P(
        "fsdp", "tensor", None
    )
    # 3 kv heads do not split over tensor=2 -> replicated on that dim
    assert logical_to_spec(("embed", "kv_heads", "head_dim"), DEFAULT_RULES, (64, 3, 16), mesh) == P("fsdp", None, None)
    assert logical_to_spec(("batch", "seq"), DEFAULT_RULES, (4, 8), mesh) == P(("data", "fsdp"), None)
    assert logical_to_spec(("batch", "seq"), DEFAULT_RULES, (2, 8), mesh) == P("data", None)
    assert logical_to_spec(("embed", "mlp"), no_sharding(), (64, 128), mesh) == P(None, None)
    with pytest.raises(ValueError, match="nope"):
        logical_to_spec(("nope",), DEFAULT_RULES)


@pytest.mark.parametrize(
    "kind,shape",
    [("in_heads", (8, 4, 6)), ("out_heads", (4, 6, 8)), ("T", (8, 10)), ("heads", (4, 6)), ("same", (10, 8))],
)
def test_slice_reads_equal_full_transform(tmp_path, kind, shape):
    """_read_view(slice) == full HF->ours transform, then slice (for every kind of layout)."""
    hf_shape, r_shape, perm, _ = hf_io._recipe(kind, shape)
    rng = np.random.default_rng(0)
    hf = rng.standard_normal(hf_shape).astype(np.float32)
    hf_io._write_safetensors(tmp_path / "model.safetensors", {"w": hf})
    ckpt = hf_io._Checkpoint(tmp_path)
    ours = hf.reshape(r_shape).transpose(perm)
    assert ours.shape == shape
    idx = tuple(slice(n // 2, n) if i % 2 == 0 else slice(None) for i, n in enumerate(shape))
    np.testing.assert_array_equal(hf_io._read_view(ckpt, "w", kind, shape, idx, np.float32), ours[idx])
    np.testing.assert_array_equal(hf_io._read_view(ckpt, "w", kind, shape, (), np.float32), ours)


@needs8
@pytest.mark.parametrize(
    "mesh_shape", [{"data": 2, "fsdp": 2, "tensor": 2}, {"data": 2, "fsdp": 4}], ids=["d2f2t2", "d2f4"]
)
def test_sharded_load_same_logits(hf_checkpoints, mesh_shape):
    folder, hf_model = hf_checkpoints["qwen2"]
    mesh = make_mesh(mesh_shape)
    model = from_pretrained(folder, mesh=mesh)
    q = model.layers[0].self_attn.q_proj.kernel[...]
    want = logical_to_spec(("embed", "q_heads", "head_dim"), DEFAULT_RULES, q.shape, mesh)
    assert q.sharding.spec == want and q.sharding.mesh == mesh
    assert len(q.addressable_shards) == 8
    ids, mask, pos = padded_batch([5, 12, 1, 9], 12, left=True, seed=1)
    ref = hf_logits(hf_model, ids, mask, pos)
    graphdef, state = nnx.split(model)
    data_sh = jax.sharding.NamedSharding(mesh, logical_to_spec(("batch", "seq"), DEFAULT_RULES, ids.shape, mesh))

    @jax.jit
    def fwd(state, ids, mask):
        return nnx.merge(graphdef, state)(ids, mask)

    with jax.set_mesh(mesh), activation_rules(DEFAULT_RULES):
        out = fwd(state, jax.device_put(ids, data_sh), jax.device_put(mask, data_sh))
    unsharded = np.asarray(jax.jit(lambda m: m(ids, mask))(from_pretrained(folder)))
    real = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(out)[real], unsharded[real], atol=1e-5)
    np.testing.assert_allclose(np.asarray(out)[real], ref[real], atol=1e-4)


@needs8
def test_init_model_on_mesh_and_shard_model():
    from stare_jax.models import ModelConfig

    cfg = ModelConfig(vocab_size=128, hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2, intermediate_size=64)
    mesh = make_mesh({"fsdp": 4, "tensor": 2})
    m_mesh = init_model(cfg, seed=3, mesh=mesh)
    m_host = init_model(cfg, seed=3)
    emb = m_mesh.embed_tokens[...]
    assert emb.sharding.spec == P("tensor", "fsdp")
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-8),
        nnx.state(m_mesh, nnx.Param),
        nnx.state(m_host, nnx.Param),
    )
    shard_model(m_host, mesh)
    assert m_host.layers[0].mlp.down_proj.kernel[...].sharding.spec == P("tensor", "fsdp")
    sh = state_shardings(nnx.state(m_host), mesh)
    assert isinstance(jax.tree.leaves(sh)[0], jax.sharding.NamedSharding)


@needs8
def test_splash_under_mesh_uses_shard_map_and_matches():
    """Under jax.set_mesh + activation_rules the splash kernel runs per shard (shard_map over batch and heads);
    results equal the einsum reference on real positions (Pallas interpreter on CPU)."""
    from stare_jax.models import attention as A

    rng = np.random.default_rng(0)
    b, t, h, k, d = 4, 100, 4, 2, 32
    q, kk, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in [(b, t, h, d), (b, t, k, d), (b, t, k, d)])
    mask = np.ones((b, t), np.int32)
    mask[0, :30] = 0
    mask[2, :70] = 0
    m = jnp.asarray(mask)
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    f = jax.jit(lambda q, k, v, m: A.attend("splash", q, k, v, None, attention_mask_BxT=m))
    with jax.set_mesh(mesh), activation_rules(DEFAULT_RULES):
        assert "shard_map" in str(jax.make_jaxpr(f)(q, kk, v, m))
        out = f(q, kk, v, m)
    ref = A.attention_xla(q, kk, v, A.causal_padding_mask(m))
    real = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(ref)[real], atol=1e-5)


@needs8
def test_scan_layers_sharded_load(hf_checkpoints):
    folder, _ = hf_checkpoints["llama"]
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    model = from_pretrained(folder, mesh=mesh, scan_layers=True)
    w = model.layers.mlp.gate_proj.kernel[...]
    assert w.shape == (2, 64, 128) and w.sharding.spec == P(None, "fsdp", "tensor")
    ids, mask, _ = padded_batch([5, 12, 1, 9], 12, left=True, seed=1)
    with jax.set_mesh(mesh), activation_rules(DEFAULT_RULES):
        out = jax.jit(lambda m: m(ids, mask))(model)
    ref = jax.jit(lambda m: m(ids, mask))(from_pretrained(folder))
    real = mask.astype(bool)
    np.testing.assert_allclose(np.asarray(out)[real], np.asarray(ref)[real], atol=1e-5)


@needs8
def test_shard_count_follows_the_active_mesh_and_rules():
    """shard_count: the devices `constrain` would split a dimension over (1 outside a program context, 1 for a
    dimension the mesh axes do not divide)."""
    from stare_jax.models.sharding import program_context, shard_count

    assert shard_count("act_vocab", 96) == 1  # no mesh, no rules
    mesh = make_mesh({"data": 2, "tensor": 4})
    with program_context(mesh):
        assert shard_count("act_vocab", 96) == 4
        assert shard_count("act_vocab", 10) == 1  # 4 does not divide 10: replicated
        assert shard_count("batch", 8) == 2
        assert shard_count(None, 8) == 1
    with program_context(mesh, no_sharding()):
        assert shard_count("act_vocab", 96) == 1
