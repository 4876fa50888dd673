"""Full-size configs built abstractly with eval_shape (no memory allocated): parameter counts and shardings."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from stare_jax.models import Transformer, get_preset
from stare_jax.models.sharding import make_mesh, state_shardings
from support.params import representative


def _abstract(name):
    cfg = get_preset(name, param_dtype="bfloat16", dtype="bfloat16")
    return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))


def _count(model):
    return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


@pytest.mark.parametrize(
    "name,expected", representative([("qwen2.5-7b", 7_615_616_512), ("qwen2.5-32b", 32_763_876_352)])
)
def test_full_size_param_count(name, expected):
    model = _abstract(name)
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)  # nothing allocated
    n = _count(model)
    assert abs(n - expected) / expected < 0.01
    assert n == expected == model.config.num_params()


def test_32b_scan_layers_abstract():
    cfg = get_preset("qwen2.5-32b", param_dtype="bfloat16", dtype="bfloat16", scan_layers=True)
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    assert model.layers.mlp.down_proj.kernel.get_value().shape == (64, 27648, 5120)
    assert _count(model) == 32_763_876_352


@pytest.mark.parametrize("name", ["qwen3-8b", "llama-3.2-1b", "r1-distill-qwen-1.5b"])
def test_other_presets_count_matches_formula(name):
    model = _abstract(name)
    assert _count(model) == model.config.num_params()


def test_7b_forward_shape_and_shardings():
    model = _abstract("qwen2.5-7b")
    graphdef, state = nnx.split(model)
    out = jax.eval_shape(lambda s, ids: nnx.merge(graphdef, s)(ids), state, jax.ShapeDtypeStruct((2, 8), jnp.int32))
    assert out.shape == (2, 8, 152064) and out.dtype == jnp.float32
    if len(jax.devices()) >= 8:
        mesh = make_mesh({"fsdp": 4, "tensor": 2})
        sh = dict(nnx.to_flat_state(state_shardings(state, mesh)))
        assert sh[("embed_tokens",)].get_value().spec == jax.sharding.PartitionSpec("tensor", "fsdp")
        # 4 kv heads split over tensor=2
        k_spec = sh[("layers", 0, "self_attn", "k_proj", "kernel")].get_value().spec
        assert k_spec == jax.sharding.PartitionSpec("fsdp", "tensor", None)
