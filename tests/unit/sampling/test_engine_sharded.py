"""The rollout engine on meshes that split the batch over data shards (the fake 8-device CPU mesh of conftest):
each data shard has its own slots and page pool ([D, K, N/D, P, Dh], leading axis over the batch axes), and the tokens
are those of the single-device engine and of the static sampler (greedy and temperature 1, long-tailed lengths);
multi-turn continuation; no recompilation across steps; the pool's bytes per device are 1/D; the compiled programs
gather pages locally (no all-gather of the pool)."""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
import pytest

from stare_jax.models import init_model, paged_attention as pa
from stare_jax.models.sharding import make_mesh
from stare_jax.sampling import Sampler, SamplingParams
from stare_jax.sampling.engine import (
    Engine,
    EngineConfig,
    assign_shards,
    compiled_programs,
    kv_bytes,
    programs as engine_programs,
)
from support.engine import EOS, PROMPTS, _assert_same, _tiny

MESHES = {
    "data2-tensor4": {"data": 2, "tensor": 4},
    "data4-tensor2": {"data": 4, "tensor": 2},
    "data2-fsdp2-tensor2": {"data": 2, "fsdp": 2, "tensor": 2},
}
CONFIG = EngineConfig(max_slots=8, page_size=8, decode_chunk=4, prefill_chunk=8, num_pages=32)  # few page buckets


@pytest.fixture(scope="module")
def model():
    return _tiny("qwen2")


def _on_mesh(model, shape):
    mesh = make_mesh(shape)
    return Engine(init_model(model.config, seed=0, mesh=mesh), mesh=mesh, config=CONFIG)


@pytest.mark.slow  # ~1 min per mesh on 2 CPU cores; the default suite runs the data-split mesh in the tests below
@pytest.mark.parametrize("shape", MESHES.values(), ids=MESHES.keys())
def test_data_split_mesh_matches_single_device_and_sampler(model, shape):
    engine = _on_mesh(model, shape)
    D = engine.data_shards
    kw = dict(max_new_tokens=16, num_samples=3)
    free = Sampler(model).generate(PROMPTS, sampling=SamplingParams(temperature=0.0, eos_ids=[]), **kw)
    greedy_eos = sorted({free.tokens[3 * p][k] for p, k in ((0, 3), (2, 9), (4, 13))})
    single = Engine(model, config=CONFIG)
    for temperature, eos in ((0.0, greedy_eos), (1.0, EOS)):
        ref = Sampler(model).generate(
            PROMPTS, sampling=SamplingParams(temperature=temperature, eos_ids=eos, seed=5), **kw
        )
        out = engine.generate(PROMPTS, sampling=SamplingParams(temperature=temperature, eos_ids=eos, seed=5), **kw)
        _assert_same(out, ref)
        _assert_same(
            out, single.generate(PROMPTS, sampling=SamplingParams(temperature=temperature, eos_ids=eos, seed=5), **kw)
        )
        assert len(set(out.lengths)) >= 3  # long-tailed: rows finish at different times
        assert len(engine.pools) == D and all(p.all_free() for p in engine.pools)
        assert engine.stats["prefix_prefills"] == sum(len(p) > 1 for p in PROMPTS)  # one per prompt, on its shard
    k = engine.pages[0]["k"]
    cfg = model.config
    assert engine.keys_transposed and single.keys_transposed  # the CPU's key layout, on a mesh as on one device
    assert k.shape == pa.pool_shape(
        32 // D, CONFIG.page_size, cfg.num_kv_heads, cfg.head_dim, data_shards=D, transposed=True
    )
    assert single.pages[0]["k"].shape == pa.pool_shape(
        32, CONFIG.page_size, cfg.num_kv_heads, cfg.head_dim, transposed=True
    )
    # each device holds its shard's pages (and its share of the kv heads where tensor divides them): 1/D of the
    # pool a data-replicated engine holds per device
    heads_split = shape["tensor"] if model.config.num_kv_heads % shape["tensor"] == 0 else 1
    assert k.addressable_shards[0].data.nbytes * D * heads_split == k.nbytes
    assert kv_bytes(engine) == kv_bytes(single)  # the same pages in all


@pytest.mark.slow  # a mesh engine and a single-device one, two turns each
def test_multi_turn_extend_on_a_data_split_mesh(model):
    """start / extend / close (tools/rollout.py's calls) on data=2 x tensor=4: the same turns as one device, each
    conversation's pages in its shard's pool."""
    kw = dict(sampling=SamplingParams(temperature=1.0, eos_ids=EOS, seed=3))
    tool = [[200, 201, 202], [210], [220, 221], [230, 231, 232, 233], [240], [241, 242]]
    runs = []
    for engine in (_on_mesh(model, MESHES["data2-tensor4"]), Engine(model, config=CONFIG)):
        convs = engine.start(PROMPTS[:3], max_new_tokens=6, num_samples=2, **kw)
        engine.extend(convs, tool, max_new_tokens=[5, 3, 6, 2, 4, 6], **kw)
        runs.append([(c.tokens, c.response_mask, c.shard) for c in convs])
        engine.close(convs)
        assert all(p.all_free() for p in engine.pools)
    (sharded, single) = runs
    assert [t for t, m, _ in sharded] == [t for t, m, _ in single]
    assert [m for _, m, _ in sharded] == [m for _, m, _ in single]
    assert {d for *_, d in sharded} == {0, 1}  # prompts on both shards, a prompt's samples on one
    assert all(sharded[2 * p][2] == sharded[2 * p + 1][2] for p in range(3))


def test_no_recompilation_across_steps_on_a_data_split_mesh(model):
    """A second RL step (new weights through update_params, after release) runs the compiled programs: the pool
    and row arrays keep their layouts through the donated programs."""
    engine = _on_mesh(model, MESHES["data2-tensor4"])
    kw = dict(max_new_tokens=12, num_samples=2, sampling=SamplingParams(temperature=1.0, eos_ids=[], seed=1))
    first = engine.generate(PROMPTS, **kw)
    warm = compiled_programs()
    engine.release()
    assert engine.pools is None and engine.pages is None
    engine.update_params(init_model(model.config, seed=7, mesh=engine.mesh))
    second = engine.generate(PROMPTS, **kw)
    assert compiled_programs() == warm and second.tokens != first.tokens


def test_compiled_programs_gather_pages_locally(model, monkeypatch):
    """The decode, prefill and copy programs over data=2 x tensor=4 have no all-gather of the page pool (each
    device reads and writes only its shard's pages): the programs the engine ran, compiled again from their
    arguments' shapes and layouts."""
    engine = _on_mesh(model, MESHES["data2-tensor4"])
    jitted = {name: getattr(engine_programs, name) for name in ("_decode_jit", "_prefill_jit", "_copy_jit")}
    seen: dict = {}
    for name, program in jitted.items():

        def record(*args, _program=program, _name=name, **kwargs):
            abstract = jax.tree.map(
                lambda x: (
                    jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x
                ),
                args,
            )
            seen.setdefault(_name, (abstract, kwargs))
            return _program(*args, **kwargs)

        monkeypatch.setattr(engine_programs, name, record)
    engine.generate(
        PROMPTS, max_new_tokens=8, num_samples=3, sampling=SamplingParams(temperature=1.0, eos_ids=EOS, seed=2)
    )
    assert set(seen) == set(jitted)
    N = engine.pages[0]["v"].shape[2]  # [D, K, N, P, Dh] (keys [D, K, N, Dh, P])
    Dh = model.config.head_dim
    with engine.program_context():
        for name, (args, kwargs) in seen.items():
            hlo = jitted[name].lower(*args, **kwargs).compile().as_text()
            gathers = [line for line in hlo.splitlines() if re.search(r"all-gather(-start)?\(", line)]
            tail = rf"({CONFIG.page_size},{Dh}|{Dh},{CONFIG.page_size})"  # a v or (transposed) k pool
            pool = [g for g in gathers if re.search(rf"\[(\d+,)*{N},{tail}\]", g)]
            assert not pool, (name, pool[:3])


@pytest.mark.slow  # ~1 min: the Pallas interpreter per device
def test_pallas_decode_on_a_data_tensor_mesh_gives_the_gather_tokens(model):
    """attention=pallas on data=2 x tensor=2 (the kernel under shard_map, each device on its data shard's pool and
    its kv head; Pallas interpret mode on CPU): the gather path's greedy tokens, with a bfloat16 pool."""
    mesh = make_mesh({"data": 2, "tensor": 2}, devices=jax.devices()[:4])
    sharded = init_model(model.config, seed=0, mesh=mesh)
    kw = dict(max_new_tokens=8, num_samples=2, sampling=SamplingParams(temperature=0.0, eos_ids=EOS, seed=4))
    out = {
        a: Engine(sharded, mesh=mesh, cache_dtype="bfloat16", config=dataclasses.replace(CONFIG, attention=a)).generate(
            PROMPTS, **kw
        )
        for a in ("gather", "pallas")
    }
    assert out["pallas"].tokens == out["gather"].tokens and out["pallas"].lengths == out["gather"].lengths
    np.testing.assert_allclose(
        np.concatenate(out["pallas"].logprobs), np.concatenate(out["gather"].logprobs), atol=1e-4
    )


def test_assign_shards_keeps_prompts_whole_and_balances_work():
    assert assign_shards([10, 10, 10, 10], 1) == [0, 0, 0, 0]
    assert assign_shards([10, 10, 10, 10], 2) == [0, 1, 0, 1]  # equal work: round-robin
    assert assign_shards([30, 10, 10, 10, 5], 2) == [0, 1, 1, 1, 0]  # the least loaded shard
    assert np.bincount(assign_shards([7] * 12, 4)).tolist() == [3, 3, 3, 3]
