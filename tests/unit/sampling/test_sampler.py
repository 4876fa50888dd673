"""Sampler: token selection rules vs NumPy, sampled distributions (chi-square), EOS/length bookkeeping,
reproducibility, no recompilation within buckets, the array API, resharding, and bad input.

The model is a tiny random stare_jax Transformer (init_model); parity with transformers is in
test_sampling_parity.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from stare_jax.models import ModelConfig, init_model
from stare_jax.models.sharding import make_mesh
from stare_jax.sampling import (
    Sampler,
    SamplingParams,
    compiled_programs,
    generate,
    greedy_tokens,
    inverse_cdf_sample,
    next_bucket,
    quarter_octave_bucket,
    reshard_for_sampling,
    select_tokens,
    top_k_mask,
    top_p_mask,
)

V = 256
CONTEXT = [3, 14, 15, 92, 65, 35]


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig(
        vocab_size=V,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        max_position_embeddings=64,
        qkv_bias=True,
        initializer_range=0.1,
        eos_token_id=None,
        pad_token_id=0,
    )
    return init_model(cfg, seed=0)


@pytest.fixture(scope="module")
def next_logits(model):
    """fp64 logits of the token after CONTEXT, from a full forward."""
    return np.asarray(model(jnp.asarray([CONTEXT]))[0, -1], np.float64)


# ------------------------------------------------------------------------------------- selection rules
def _nucleus_np(scores, top_p):
    """Top-p set (float64): the most likely tokens whose preceding mass is < top_p (transformers'
    TopPLogitsWarper), with every token tied at the threshold kept (transformers keeps a sort-order subset)."""
    p = np.exp(scores - scores.max())
    p /= p.sum()
    above = np.array([p[p > x].sum() for x in p])  # mass strictly more likely than each token
    keep = above < top_p
    margin = np.min(np.abs(above - top_p))  # distance of the decision from the boundary
    return keep, margin


def test_greedy_tokens_blocked_matches_argmax():
    """The blocked pick (first 128-wide block holding the max, first max inside it) is numpy's argmax: ties across
    and inside blocks, a vocabulary that is not a multiple of the block, rows of -inf; a NaN row gets a valid id;
    select_tokens' log-probs (logsumexp from the block maxima) equal log_softmax."""
    rng = np.random.default_rng(0)
    V = 3 * 128 + 37
    logits = rng.standard_normal((6, V)).astype(np.float32)
    logits[1, [5, 200, 300]] = 9.0  # tie across blocks: the first wins
    logits[2, [130, 131]] = 9.0  # tie inside a block
    logits[3, V - 1] = 9.0  # the max in the padded tail block
    logits[4] = -np.inf
    np.testing.assert_array_equal(greedy_tokens(jnp.asarray(logits)), np.argmax(logits, axis=-1))
    tok, lp = select_tokens(jnp.asarray(logits[:4]), jnp.zeros(4), greedy=True, temperature=1.0, top_k=0, top_p=1.0)
    np.testing.assert_array_equal(tok, np.argmax(logits[:4], axis=-1))
    np.testing.assert_allclose(lp, jax.nn.log_softmax(logits[:4])[jnp.arange(4), tok], rtol=1e-6)
    nan_row = np.full((1, V), np.nan, np.float32)
    assert 0 <= int(greedy_tokens(jnp.asarray(nan_row))[0]) < V


def test_greedy_tokens_first_maximum():
    logits = jnp.asarray([[0.0, 2.0, 2.0, -1.0], [5.0, 1.0, 5.0, 5.0], [-3.0, -2.0, -2.5, -9.0]])
    np.testing.assert_array_equal(greedy_tokens(logits), [1, 0, 1])
    # A vanishing temperature samples the argmax (no NaN); log-probs stay the temperature-1 ones.
    u = jnp.asarray([0.0, 0.5, 0.999])
    logits = jnp.asarray([[0.0, 2.0, 1.0, -1.0], [5.0, 1.0, 4.0, 5.5], [-3.0, -2.0, -2.5, -9.0]])
    tok, lp = select_tokens(logits, u, greedy=False, temperature=1e-30, top_k=0, top_p=1.0)
    np.testing.assert_array_equal(tok, [1, 3, 1])
    np.testing.assert_allclose(lp, jax.nn.log_softmax(logits)[jnp.arange(3), tok], rtol=1e-6)


def test_top_k_and_top_p_sets_match_numpy():
    rng = np.random.default_rng(0)
    scores = rng.normal(size=(32, 300)) * 2.0
    scores[:4, :10] = 3.0  # ties at the top
    s32 = jnp.asarray(scores, jnp.float32)
    for k in (1, 5, 40):
        kept = np.isfinite(np.asarray(top_k_mask(s32, k)))
        kth = np.sort(np.asarray(s32), axis=-1)[:, -k][:, None]
        np.testing.assert_array_equal(kept, np.asarray(s32) >= kth)
    for top_p in (0.1, 0.5, 0.9, 0.99):
        kept = np.isfinite(np.asarray(top_p_mask(s32, jnp.float32(top_p))))
        checked = 0
        for b in range(scores.shape[0]):
            ref, margin = _nucleus_np(np.asarray(s32[b], np.float64), top_p)
            if margin > 1e-5:  # fp32 vs fp64 can only disagree right at the boundary
                np.testing.assert_array_equal(kept[b], ref, err_msg=f"top_p={top_p} row {b}")
                checked += 1
        assert checked >= 28


def test_inverse_cdf_sample_matches_searchsorted_and_skips_masked():
    rng = np.random.default_rng(1)
    scores = rng.normal(size=(8, 300)).astype(np.float32) * 3
    scores[:, rng.random(300) < 0.5] = -np.inf  # masked tokens (zero probability)
    scores[3] = -np.inf
    scores[3, 299] = 0.0  # a single allowed token at the very end
    u = rng.random((64, 8)).astype(np.float32)
    u[0], u[1] = 0.0, np.nextafter(np.float32(1), np.float32(0))
    f = jax.jit(inverse_cdf_sample)
    for row_u in u:
        toks = np.asarray(f(jnp.asarray(scores), jnp.asarray(row_u)))
        assert np.all(np.isfinite(scores[np.arange(8), toks])), "sampled a masked (-inf) token"
        for b in range(8):
            w = np.exp(scores[b].astype(np.float64) - scores[b].max())
            cdf = np.cumsum(w) / w.sum()
            ref = np.searchsorted(cdf, row_u[b], side="right")
            if np.min(np.abs(cdf - row_u[b])) > 1e-5:
                assert toks[b] == ref, (b, row_u[b])


# ------------------------------------------------------------------------------------- distributions
def _chi_square_pvalue(counts, probs, min_expected=5.0):
    """Pearson chi-square goodness of fit; categories with expected count < min_expected are pooled."""
    n = counts.sum()
    expected = probs * n
    big = expected >= min_expected
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] < min_expected:  # pooled bin too small: fold it into the smallest kept bin
        obs, exp = obs[:-1], exp[:-1]
        obs[np.argmin(exp)] += counts[~big].sum()
        exp[np.argmin(exp)] += expected[~big].sum()
    stat = float(np.sum((obs - exp) ** 2 / exp))
    dof = len(obs) - 1
    return float(jax.scipy.special.gammaincc(dof / 2.0, stat / 2.0)), dof


def _one_token_samples(model, n, **draws):
    sampler = Sampler(model)
    ids = np.zeros((1, 8), np.int32)
    mask = np.zeros((1, 8), np.int32)
    ids[0, -len(CONTEXT) :], mask[0, -len(CONTEXT) :] = CONTEXT, 1
    out = sampler.generate_arrays(
        ids, mask, max_new_tokens=1, num_samples=n, sampling=SamplingParams(eos_ids=(), **draws)
    )
    return np.asarray(out.tokens_BxN[:, 0]), np.asarray(out.logprobs_BxN[:, 0])


def test_temperature_one_reproduces_model_distribution(next_logits, model):
    n = 4000
    toks, lps = _one_token_samples(model, n, temperature=1.0, seed=7)
    probs = np.exp(next_logits - next_logits.max())
    probs /= probs.sum()
    pval, dof = _chi_square_pvalue(np.bincount(toks, minlength=V).astype(np.float64), probs)
    assert dof >= 10 and pval > 1e-3, (pval, dof)
    np.testing.assert_allclose(lps, np.log(probs[toks]), atol=1e-5)


def test_top_k_top_p_temperature_support_and_distribution(next_logits, model):
    n = 4000
    temp, k, top_p = 0.8, 12, 0.7
    toks, lps = _one_token_samples(model, n, temperature=temp, top_k=k, top_p=top_p, seed=11)
    scores = next_logits / temp
    scores = np.where(scores >= np.sort(scores)[-k], scores, -np.inf)
    keep, margin = _nucleus_np(scores, top_p)
    assert margin > 1e-5
    assert set(toks.tolist()) <= set(np.flatnonzero(keep).tolist())
    probs = np.where(keep, np.exp(scores - scores.max()), 0.0)
    probs /= probs.sum()
    pval, _ = _chi_square_pvalue(np.bincount(toks, minlength=V).astype(np.float64), probs)
    assert pval > 1e-3, pval
    # log-probs stay those of the untempered, unfiltered model distribution
    full = next_logits - np.log(np.sum(np.exp(next_logits - next_logits.max()))) - next_logits.max()
    np.testing.assert_allclose(lps, full[toks], atol=1e-5)
    toks_k1, _ = _one_token_samples(model, n, temperature=1.0, top_k=1, seed=1)  # same program as above
    assert set(toks_k1.tolist()) == {int(np.argmax(next_logits))}


# ------------------------------------------------------------------------------------- bookkeeping
def test_eos_stops_and_pads(model):
    prompts = [CONTEXT, [9, 8, 7]]
    free = generate(model, prompts, max_new_tokens=12, sampling=SamplingParams(temperature=0.0, eos_ids=[]))
    eos = free.tokens[0][3]
    out = generate(model, prompts, max_new_tokens=12, sampling=SamplingParams(temperature=0.0, eos_ids=[eos, V - 1]))
    first = free.tokens[0].index(eos)
    assert out.tokens[0] == free.tokens[0][: first + 1]
    assert out.finish_reasons[0] == "eos" and out.lengths[0] == first + 1
    for toks, lps, reason, n in zip(out.tokens, out.logprobs, out.finish_reasons, out.lengths):
        assert len(toks) == len(lps) == n
        assert reason == ("eos" if toks[-1] in (eos, V - 1) else "length")
        assert reason == "eos" or n == 12


def test_array_api_layout(model):
    sampler = Sampler(model)
    ids = np.zeros((2, 16), np.int32)
    mask = np.zeros((2, 16), np.int32)
    ids[0, -6:], mask[0, -6:] = CONTEXT, 1
    ids[1, -3:], mask[1, -3:] = [5, 6, 7], 1
    greedy = sampler.generate_arrays(
        jnp.asarray(ids),
        jnp.asarray(mask),
        max_new_tokens=10,
        num_samples=3,
        sampling=SamplingParams(temperature=0.0, eos_ids=[]),
    )
    assert greedy.tokens_BxN.shape == (6, 10) and greedy.tokens_BxN.dtype == jnp.int32
    assert greedy.logprobs_BxN.shape == (6, 10) and greedy.logprobs_BxN.dtype == jnp.float32
    t = np.asarray(greedy.tokens_BxN)
    np.testing.assert_array_equal(t[0], t[2])  # prompt-major: rows 0..2 are prompt 0
    np.testing.assert_array_equal(t[3], t[5])
    np.testing.assert_array_equal(greedy.lengths_B, 10)
    assert not np.any(greedy.finished_B)
    eos = int(t[4, 2])
    out = sampler.generate_arrays(
        ids, mask, max_new_tokens=10, num_samples=3, sampling=SamplingParams(temperature=1.0, eos_ids=[eos], seed=5)
    )
    tok, lp, n, fin = map(np.asarray, out)
    for b in range(6):
        assert np.all(tok[b, n[b] :] == 0) and np.all(lp[b, n[b] :] == 0)
        assert np.all(lp[b, : n[b]] < 0)
        assert fin[b] == (tok[b, n[b] - 1] == eos) and (fin[b] or n[b] == 10)


def test_reproducible_and_independent_of_batch_composition(model):
    kw = dict(max_new_tokens=16, num_samples=3)
    draws = SamplingParams(temperature=1.0, eos_ids=(), seed=42)
    a = generate(model, [CONTEXT, [1, 2, 3], [4] * 9], sampling=draws, **kw)
    b = generate(model, [CONTEXT, [1, 2, 3], [4] * 9], sampling=draws, **kw)
    # Same prompt alone: the other rows are now padding (min_batch_bucket=4 keeps the program; the samples do
    # not depend on which prompts share the batch).
    alone = Sampler(model, min_batch_bucket=4).generate([CONTEXT], sampling=draws, **kw)
    other = generate(model, [CONTEXT, [1, 2, 3], [4] * 9], sampling=draws.replace(seed=43), **kw)
    assert a.tokens == b.tokens and a.logprobs == b.logprobs
    assert alone.tokens == a.tokens[:3]
    assert len({tuple(t) for t in a.tokens[:3]}) == 3  # G samples differ
    assert other.tokens != a.tokens
    # The array API pads an unbucketed [3, 9] batch itself (to [3, 16]) and gives the same samples.
    prompts = [CONTEXT, [1, 2, 3], [4] * 9]
    ids, mask = np.zeros((3, 9), np.int32), np.zeros((3, 9), np.int32)
    for r, p in enumerate(prompts):
        ids[r, 9 - len(p) :], mask[r, 9 - len(p) :] = p, 1
    arr = Sampler(model).generate_arrays(jnp.asarray(ids), jnp.asarray(mask), sampling=draws, **kw)
    assert arr.tokens_BxN.shape == (9, 16) and arr.lengths_B.shape == (9,)
    assert np.asarray(arr.tokens_BxN).tolist() == a.tokens


def test_no_recompilation_within_buckets(model):
    sampler = Sampler(model, min_prompt_bucket=16, min_new_bucket=16, min_batch_bucket=2)
    sampler.generate([CONTEXT, [1, 2]], max_new_tokens=9, sampling=SamplingParams(temperature=0.7, top_p=0.9, seed=0))
    before = compiled_programs()
    # Other prompt lengths (<= 16), max_new_tokens (<= 16), 1-2 prompts, sampling settings (greedy included),
    # seeds and EOS ids all reuse the program; so does a new Sampler on the same model.
    sampler.generate(
        [[5] * 13, [7, 7, 7]], max_new_tokens=16, sampling=SamplingParams(temperature=1.3, top_p=0.5, top_k=7, seed=1)
    )
    sampler.generate([[9]], max_new_tokens=3, sampling=SamplingParams(temperature=0.0, seed=2, eos_ids=[1, 2, 3]))
    Sampler(model, min_batch_bucket=2).generate(
        [CONTEXT], max_new_tokens=5, sampling=SamplingParams(temperature=0.9, top_k=3, seed=3)
    )
    assert compiled_programs() == before
    assert next_bucket(1, 16) == 16 and next_bucket(17, 16) == 32 and next_bucket(64, 8) == 64
    assert [quarter_octave_bucket(n) for n in (1, 3, 8, 9, 11, 17, 100, 192, 193, 256)] == [
        1,
        3,
        8,
        10,
        12,
        20,
        112,
        192,
        224,
        256,
    ]
    assert Sampler(model, min_batch_bucket=2).batch_bucket(1) == 2


def test_decode_phases_same_results_and_teacher_forced(model):
    """A 2-phase decode (cache grown after 32 tokens) == the 1-phase decode; log-probs == full forward."""
    prompts = [CONTEXT, [7] * 20]
    kw = dict(max_new_tokens=40, num_samples=2, sampling=SamplingParams(temperature=1.0, seed=9, eos_ids=[]))
    two = Sampler(model, decode_phases=2)
    assert two.phases(64) == (32, 64)
    a, b = two.generate(prompts, **kw), Sampler(model).generate(prompts, **kw)
    assert a.tokens == b.tokens
    np.testing.assert_allclose(np.concatenate(a.logprobs), np.concatenate(b.logprobs), atol=1e-5)
    for r, (toks, lps) in enumerate(zip(a.tokens, a.logprobs)):
        prompt = prompts[r // 2]
        logp = np.asarray(jax.nn.log_softmax(model(jnp.asarray([prompt + toks]))[0], -1))
        ref = logp[len(prompt) - 1 : len(prompt) - 1 + len(toks)][np.arange(len(toks)), toks]
        np.testing.assert_allclose(lps, ref, atol=1e-5)


def test_bf16_cache_close_to_fp32(model):
    f32 = generate(model, [CONTEXT, [1, 2]], max_new_tokens=8, sampling=SamplingParams(temperature=0.0, eos_ids=[]))
    b16 = Sampler(model, cache_dtype=jnp.bfloat16).generate(
        [CONTEXT, [1, 2]], max_new_tokens=8, sampling=SamplingParams(temperature=0.0, eos_ids=[])
    )
    assert b16.tokens[0][:2] == f32.tokens[0][:2]
    np.testing.assert_allclose(b16.logprobs[0][:2], f32.logprobs[0][:2], atol=0.05)


# ------------------------------------------------------------------------------------- meshes
def test_reshard_and_tensor_parallel_sampling(model):
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    sharded = init_model(model.config, seed=0, mesh=mesh)  # trainer layout (FSDP + tensor)
    from flax import nnx

    state = nnx.split(sharded)[1]
    resharded = reshard_for_sampling(state, mesh)
    specs = []
    for x, y in zip(jax.tree.leaves(state), jax.tree.leaves(resharded)):
        assert isinstance(y.sharding, NamedSharding)
        spec = tuple(a for e in y.sharding.spec if e is not None for a in ((e,) if isinstance(e, str) else e))
        assert "fsdp" not in spec and "data" not in spec
        specs.append(spec)
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert any("tensor" in s for s in specs)  # tensor parallelism kept
    prompts = [CONTEXT, [1, 2, 3], [4] * 9]
    kw = dict(max_new_tokens=16, num_samples=3, sampling=SamplingParams(temperature=1.0, eos_ids=[], seed=4))
    mesh_sampler = Sampler(sharded, mesh=mesh)
    on_mesh = mesh_sampler.generate(prompts, **kw)
    single = generate(model, prompts, **kw)
    assert on_mesh.tokens == single.tokens
    np.testing.assert_allclose(np.concatenate(on_mesh.logprobs), np.concatenate(single.logprobs), atol=1e-5)
    # Once per RL step: new trainer parameters -> sampler layout, same program, new behaviour.
    before = compiled_programs()
    mesh_sampler.update_params(init_model(model.config, seed=1, mesh=mesh))
    changed = mesh_sampler.generate(prompts, **kw)
    assert compiled_programs() == before and changed.tokens != on_mesh.tokens


# ------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "prompts, kwargs, match",
    [
        ([], {}, "prompt_ids is empty"),
        ([[1, 2], []], {}, "prompt 1 has no tokens"),
        ([[1, 2], [3, V]], {}, "prompt 1 has token id 256 outside"),
        ([[1], [-1]], {}, "prompt 1 has token id -1"),
        ([[1] * 65], {}, "prompt 0 has 65 tokens, more than the model's context 64"),
        ([[1], [1] * 60], {"max_new_tokens": 5}, "prompt 1: 60 tokens \\+ max_new_tokens 5 exceeds"),
        ([[1]], {"max_new_tokens": 0}, "max_new_tokens must be a positive int, got 0"),
        ([[1]], {"max_new_tokens": -3}, "max_new_tokens must be a positive int, got -3"),
        ([[1]], {"temperature": -0.5}, "temperature must be .* got -0.5"),
        ([[1]], {"temperature": float("nan")}, "temperature"),
        ([[1]], {"top_p": 0.0}, "top_p must be in \\(0, 1\\], got 0.0"),
        ([[1]], {"top_p": 1.5}, "top_p must be in \\(0, 1\\], got 1.5"),
        ([[1]], {"top_k": -1}, "top_k must be an int >= 0 .* got -1"),
        ([[1]], {"top_k": 2.5}, "top_k must be an int"),
        ([[1]], {"num_samples": 0}, "num_samples must be a positive int, got 0"),
        ([[1]], {"eos_ids": [V + 3]}, "eos id 259 is outside the vocabulary"),
    ],
)
def test_bad_input(model, prompts, kwargs, match):
    draws = {k: v for k, v in kwargs.items() if k in ("temperature", "top_p", "top_k", "eos_ids")}
    sizes = {"max_new_tokens": 4, **{k: v for k, v in kwargs.items() if k not in draws}}
    with pytest.raises(ValueError, match=match):  # bad draw options are refused when SamplingParams is built
        generate(model, prompts, sampling=SamplingParams(**draws), **sizes)


# ------------------------------------------------------------------------------------- memory layout
def test_sampler_weights_in_compute_dtype_same_tokens(model):
    """A bf16-compute model's sampler copy is bf16 (half the fp32 master weights; the forward casts every weight to
    bf16 anyway), and it samples exactly what sampling from the fp32 weights does."""
    bf16 = init_model(model.config.replace(dtype="bfloat16"), seed=0)
    sampler = Sampler(bf16)
    assert {x.dtype for x in jax.tree.leaves(sampler.state)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(jax.tree.leaves(bf16))} <= {jnp.dtype(jnp.float32)}
    kw = dict(max_new_tokens=12, num_samples=2, sampling=SamplingParams(temperature=1.0, eos_ids=[], seed=5))
    from flax import nnx

    graphdef, state = nnx.split(bf16)
    fp32_copy = Sampler.__new__(Sampler)
    fp32_copy.__dict__.update(sampler.__dict__)
    fp32_copy.state = state  # the uncast master weights through the same program
    a, b = sampler.generate([CONTEXT, [1, 2]], **kw), fp32_copy.generate([CONTEXT, [1, 2]], **kw)
    assert a.tokens == b.tokens
    np.testing.assert_allclose(np.concatenate(a.logprobs), np.concatenate(b.logprobs), atol=1e-6)


def test_compute_dtype_samples_a_float32_model_as_a_bf16_one(model):
    """sampling.dtype: a float32 model sampled with compute_dtype bfloat16 runs the bf16 graph on bf16 weights - the
    same program as sampling a bf16-compute model - while the model itself stays float32 (the trainer's)."""
    kw = dict(max_new_tokens=12, num_samples=2, sampling=SamplingParams(temperature=1.0, eos_ids=[], seed=5))
    sampler = Sampler(model, compute_dtype="bfloat16")
    assert sampler.compute_dtype == "bfloat16" and sampler.config.dtype == "bfloat16"
    assert model.config.dtype == "float32"
    assert {x.dtype for x in jax.tree.leaves(sampler.state)} == {jnp.dtype(jnp.bfloat16)}
    want = Sampler(init_model(model.config.replace(dtype="bfloat16"), seed=0)).generate([CONTEXT, [1, 2]], **kw)
    got = sampler.generate([CONTEXT, [1, 2]], **kw)
    assert got.tokens == want.tokens
    np.testing.assert_array_equal(np.concatenate(got.logprobs), np.concatenate(want.logprobs))
    fp32 = Sampler(model, compute_dtype="float32").generate([CONTEXT, [1, 2]], **kw)
    gap = np.abs(np.concatenate(fp32.logprobs)[:4] - np.concatenate(got.logprobs)[:4])
    assert 0 < gap.max() < 0.1  # the bf16 sampler's log-probs differ from the fp32 ones by rounding


def test_release_drops_the_weight_copy(model):
    sampler = Sampler(model)
    sampler.release()
    assert sampler.state is None
    with pytest.raises(RuntimeError, match="released: call update_params"):
        sampler.generate([CONTEXT], max_new_tokens=4)
    sampler.update_params(model)
    assert len(sampler.generate([CONTEXT], max_new_tokens=4, sampling=SamplingParams(eos_ids=[])).tokens[0]) == 4


def test_cache_holds_the_context_it_needs():
    """prompt 1024 + 3072 new tokens -> a 4096-slot cache (a power-of-two new-token bucket made it 5120)."""
    from stare_jax.sampling.sampler import new_token_bucket

    assert next_bucket(1024, 16) + new_token_bucket(3072, 16) == 4096
    assert [new_token_bucket(n, 16) for n in (1, 16, 17, 100, 3072, 3073, 8192, 16384)] == [
        16,
        16,
        20,
        112,
        3072,
        3584,
        8192,
        16384,
    ]
