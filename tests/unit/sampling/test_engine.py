"""Rollout engine vs the static Sampler (the reference, itself tied to transformers' generate by
test_sampling_parity.py): token identity for greedy and temperature-1 sampling with long-tailed lengths, whatever
the slots / page size / chunk sizes; log-probs vs a full forward; page accounting (all pages back, only prompt
prefix pages shared, one prefill per prompt); preemption; the 8-device mesh; multi-turn continuation; bad input.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from stare_jax.models import init_model
from stare_jax.models.sharding import make_mesh
from stare_jax.sampling import Sampler, SamplingParams
from stare_jax.sampling.engine import Engine, EngineConfig, Scheduler, compiled_programs
from support.engine import EOS, PROMPTS, _assert_same, _tiny

SMALL = EngineConfig(max_slots=4, page_size=4, decode_chunk=4, prefill_chunk=8)


@pytest.fixture(scope="module")
def model():
    return _tiny("qwen2")


def _full_logprobs(model, seqs) -> list[np.ndarray]:
    """log softmax of one right-padded full forward over every sequence (causal: padding changes nothing)."""
    T = model.config.max_position_embeddings
    ids = np.zeros((len(seqs), T), np.int32)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = s
    logp = np.asarray(jax.nn.log_softmax(jax.jit(lambda x: model(x))(jnp.asarray(ids)), -1))
    return [logp[r] for r in range(len(seqs))]


@pytest.mark.parametrize(
    "family, config",
    [
        ("qwen2", SMALL),
        pytest.param("qwen2", EngineConfig(max_slots=16, page_size=16, decode_chunk=16), marks=pytest.mark.slow),
        pytest.param("qwen3", SMALL, marks=pytest.mark.slow),
    ],
    ids=["qwen2-slots4-page4-K4", "qwen2-slots16-page16-K16", "qwen3-slots4-page4-K4"],
)
def test_matches_static_sampler_greedy_and_sampled(family, config, model):
    model = model if family == "qwen2" else _tiny(family)
    kw = dict(max_new_tokens=24, num_samples=3)
    engine = Engine(model, config=config)
    free = Sampler(model).generate(PROMPTS, sampling=SamplingParams(temperature=0.0, eos_ids=[]), **kw)
    greedy_eos = sorted({free.tokens[3 * p][k] for p, k in ((0, 3), (2, 11), (4, 17))})
    for temperature, eos in ((0.0, greedy_eos), (1.0, EOS)):
        ref = Sampler(model).generate(
            PROMPTS, sampling=SamplingParams(temperature=temperature, eos_ids=eos, seed=5), **kw
        )
        out = engine.generate(PROMPTS, sampling=SamplingParams(temperature=temperature, eos_ids=eos, seed=5), **kw)
        _assert_same(out, ref)
        assert len(set(out.lengths)) >= 3  # rows finish at different times (slots are refilled)
        assert engine.pool.all_free()
        # one prefill per prompt (not per sample): the prompt minus its last token, once
        assert engine.stats["prefix_prefills"] == sum(len(p) > 1 for p in PROMPTS)
        assert engine.stats["prefill_tokens"] == sum(len(p) - 1 for p in PROMPTS)
    assert engine.stats["peak_pages"] < engine.pool.num_pages


def test_logprobs_equal_full_forward(model):
    out = Engine(model, config=SMALL).generate(
        PROMPTS[:3], max_new_tokens=16, num_samples=2, sampling=SamplingParams(temperature=1.0, eos_ids=EOS, seed=2)
    )
    full = _full_logprobs(model, [PROMPTS[r // 2] + toks for r, toks in enumerate(out.tokens)])
    for r, (toks, lps) in enumerate(zip(out.tokens, out.logprobs)):
        prompt = PROMPTS[r // 2]
        ref = full[r][len(prompt) - 1 : len(prompt) - 1 + len(toks)][np.arange(len(toks)), toks]
        np.testing.assert_allclose(lps, ref, atol=1e-5)


class _CheckedScheduler(Scheduler):
    """Checks the page invariants before every decode chunk: a page owned by two rows is a full page of their
    common prompt's prefix, and the pool's reference counts equal the owners."""

    def _decode_round(self, shards, draw_inputs, keep):
        n_shared = 0
        for sh in shards:
            rows = [c for c in sh.slots if c is not None and c.prefix is None]
            owners = {}
            for c in rows:
                for m, p in enumerate(c.pages):
                    owners.setdefault(p, []).append((c, m))
            for p, own in owners.items():
                if len(own) > 1:
                    n_shared += 1
                    assert len({c.prompt_pos for c, _ in own}) == 1
                    assert all(m < (c.prompt_len - 1) // self.engine_config.page_size for c, m in own)
                assert sh.pool.refs_N[p] >= len(own)
        self.shared_seen = getattr(self, "shared_seen", 0) + n_shared
        return super()._decode_round(shards, draw_inputs, keep)


def _with_scheduler(engine: Engine, scheduler_class) -> Engine:
    """The engine with its (still idle) host scheduler replaced by an instrumented subclass."""
    engine.scheduler = scheduler_class(engine.device, engine.engine_config)
    return engine


def test_prefix_pages_shared_never_written_twice_and_preemption(model):
    kw = dict(max_new_tokens=24, num_samples=3, sampling=SamplingParams(temperature=1.0, eos_ids=EOS, seed=5))
    ref = Sampler(model).generate(PROMPTS, **kw)
    engine = _with_scheduler(Engine(model, config=SMALL), _CheckedScheduler)
    _assert_same(engine.generate(PROMPTS, **kw), ref)
    assert engine.scheduler.shared_seen > 0 and engine.stats["recomputes"] == 0
    # A pool of 16 pages (15 usable) for 4 slots of up to 44 tokens (11 pages each): rows are preempted and
    # recomputed, with the same tokens.
    tight_config = EngineConfig(max_slots=4, page_size=4, decode_chunk=4, prefill_chunk=8, num_pages=16)
    tight = _with_scheduler(Engine(model, config=tight_config), _CheckedScheduler)
    _assert_same(tight.generate(PROMPTS, **kw), ref)
    assert tight.stats["recomputes"] > 0 and tight.stats["peak_pages"] <= 15 and tight.pool.all_free()


def test_array_api_matches_sampler(model):
    """generate_arrays with left padding, inactive prompts and global prompt indices (the train loop's call)."""
    ids = np.zeros((3, 16), np.int32)
    mask = np.zeros((3, 16), np.int32)
    for r, p in enumerate([PROMPTS[0], PROMPTS[1], PROMPTS[2]]):
        ids[r, 16 - len(p) :], mask[r, 16 - len(p) :] = p, 1
    kw = dict(
        max_new_tokens=12,
        num_samples=2,
        sampling=SamplingParams(temperature=1.0, eos_ids=EOS, seed=9),
        prompt_index_P=np.asarray([40, 41, 42]),
        active_P=np.asarray([True, False, True]),
    )
    ref = Sampler(model).generate_arrays(ids, mask, **kw)
    out = Engine(model, config=SMALL).generate_arrays(jnp.asarray(ids), jnp.asarray(mask), **kw)
    for a, b in zip(out, ref):
        assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_array_equal(out.tokens_BxN, ref.tokens_BxN)
    np.testing.assert_array_equal(out.lengths_B, ref.lengths_B)
    np.testing.assert_array_equal(out.finished_B, ref.finished_B)
    np.testing.assert_allclose(out.logprobs_BxN, ref.logprobs_BxN, atol=1e-5)
    assert np.all(np.asarray(out.lengths_B)[2:4] == 0)


def test_compute_dtype_bf16_engine_matches_the_bf16_static_sampler(model):
    """sampling.dtype reaches the engine as it reaches the static sampler: the same bf16 graph, the same draws."""
    kw = dict(max_new_tokens=8, num_samples=2, sampling=SamplingParams(temperature=1.0, eos_ids=EOS, seed=3))
    engine = Engine(model, config=SMALL, compute_dtype="bfloat16")
    assert engine.config.dtype == "bfloat16" and model.config.dtype == "float32"
    ref = Sampler(model, compute_dtype="bfloat16").generate(PROMPTS[:2], **kw)
    out = engine.generate(PROMPTS[:2], **kw)
    assert out.tokens == ref.tokens
    np.testing.assert_allclose(np.concatenate(out.logprobs), np.concatenate(ref.logprobs), atol=2e-2)


def test_no_recompilation_across_steps(model):
    """Programs are keyed by power-of-two buckets (rows, page-table width, prefill width): after a warm-up step
    that walks the buckets, later steps with new weights and other length mixes compile nothing."""
    engine = Engine(model, config=SMALL)
    kw = dict(max_new_tokens=24, num_samples=3)
    draws = SamplingParams(temperature=1.0, eos_ids=EOS)
    start = compiled_programs()
    mixes = [PROMPTS[k:] + PROMPTS[:k] for k in range(len(PROMPTS))] + [PROMPTS[::-1]]
    first = engine.generate(PROMPTS, sampling=draws.replace(seed=0), **kw)
    for seed, prompts in enumerate(mixes[1:], 1):  # warm-up: other length mixes reach the remaining buckets
        engine.generate(prompts, sampling=draws.replace(seed=seed), **kw)
    warm = compiled_programs()
    # the bound whatever the mix: page-table widths 1..16 (context 64 / page 4) for decode and for prefill, one
    # prefill width (prefill_chunk 8) and row bucket (max_slots 4), one copy shape
    assert warm - start <= 2 * 5 + 1
    engine.release()  # as the loop does before its train step: weights and KV pages freed
    assert engine.state is None and engine.pages is None and engine.pool is None
    engine.update_params(init_model(model.config, seed=7))  # the next RL step's weights, same programs
    second = engine.generate(PROMPTS, sampling=draws.replace(seed=0), **kw)
    for seed, prompts in enumerate(mixes, 10):  # the same mixes with other draws
        engine.generate(prompts, sampling=draws.replace(seed=seed), **kw)
    assert compiled_programs() == warm and second.tokens != first.tokens


def test_second_call_compiles_nothing(model):
    """The same call twice: the second compiles nothing (the pool is made committed to the weights' device, like
    every program output, so its first prefill and a later one share one executable)."""
    graphdef, state = nnx.split(model)  # committed weights, as from_pretrained loads them
    committed = nnx.merge(graphdef, jax.device_put(state, jax.devices()[0]))
    engine = Engine(committed, config=dataclasses.replace(SMALL, max_slots=8, prefill_chunk=32))  # one prefill
    kw = dict(max_new_tokens=12, num_samples=1, sampling=SamplingParams(temperature=1.0, eos_ids=EOS, seed=3))
    first = engine.generate(PROMPTS, **kw)
    warm = compiled_programs()
    assert engine.generate(PROMPTS, **kw).tokens == first.tokens
    assert compiled_programs() == warm


@pytest.mark.slow
def test_mesh_matches_single_device(model):
    mesh = make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
    sharded = init_model(model.config, seed=0, mesh=mesh)
    kw = dict(max_new_tokens=16, num_samples=3, sampling=SamplingParams(temperature=1.0, eos_ids=EOS, seed=4))
    on_mesh = Engine(sharded, mesh=mesh, config=SMALL).generate(PROMPTS, **kw)
    _assert_same(on_mesh, Engine(model, config=SMALL).generate(PROMPTS, **kw))


def test_multi_turn_continuation_equals_full_forward(model):
    engine = Engine(model, config=SMALL)
    kw = dict(sampling=SamplingParams(temperature=1.0, eos_ids=[], seed=3))
    convs = engine.start(PROMPTS[:2], max_new_tokens=5, num_samples=2, **kw)
    used = engine.pool.num_used
    assert used > 0  # the conversations keep their pages
    tool = [[200, 201, 202], [210], [220, 221], [230, 231, 232, 233]]
    engine.extend(convs, tool, max_new_tokens=6, **kw)
    # only the previous turn's last token + the appended tokens were prefilled, never the conversation
    assert engine.stats["prefill_tokens"] == sum(len(t) for t in tool)
    full = _full_logprobs(model, [c.tokens for c in convs])
    for c, t, logp in zip(convs, tool, full):
        assert len(c.turn_tokens) == 6
        assert c.response_mask == [1] * 5 + [0] * len(t)
        assert c.tokens[c.prompt_len + 5 : c.prompt_len + 5 + len(t)] == t
        n0 = len(c.seq)
        ref = logp[n0 - 1 : n0 - 1 + 6][np.arange(6), c.turn_tokens]
        np.testing.assert_allclose(c.turn_logprobs, ref, atol=1e-5)
        assert np.all(np.isnan(c.response_logprobs[5:]))
    engine.close(convs)
    assert engine.pool.all_free()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_slots=0), "sampling.engine: 'max_slots' = 0 is out of range; accepted: \\[1, inf\\]"),
        (dict(page_size=0), "sampling.engine: 'page_size' = 0 is out of range"),
        (dict(decode_chunk=2.5), "sampling.engine: 'decode_chunk' = 2.5 has the wrong type; expected an integer"),
        (dict(num_pages=1), "sampling.engine: 'num_pages' = 1 is not accepted: 0 \\(auto\\)"),
        (
            dict(attention="flash"),
            "sampling.engine: 'attention' = 'flash' is not accepted; accepted values: 'auto', 'gather', 'pallas'",
        ),
        (
            dict(max_slots="many"),
            "sampling.engine: 'max_slots' = 'many' has the wrong type; expected int or one of 'auto'",
        ),
    ],
)
def test_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(**kwargs)


def test_auto_slots_must_be_resolved_before_the_engine(model):
    """max_slots=auto is a config value (stare_jax.planning.estimate.auto_max_slots turns it into a number for the
    host or slice): the engine and the pool sizing refuse it unresolved, by name."""
    auto = EngineConfig(max_slots="auto")
    with pytest.raises(ValueError, match="max_slots=auto reached the engine unresolved"):
        Engine(model, config=auto)
    with pytest.raises(ValueError, match="max_slots=auto must be resolved"):
        auto.pool_pages(64)


def test_attention_config_resolves_per_platform(model):
    """sampling.engine.attention in the run config (validated with the key's name), and what auto resolves to: the
    gather path off TPU, whatever the cache dtype."""
    from stare_jax.config.loader import load_config
    from stare_jax.config.options import ConfigError

    assert load_config(None, ["sampling.engine.attention=pallas"]).sampling.engine.attention == "pallas"
    with pytest.raises(ConfigError, match="'sampling.engine.attention' = 'flash' is not accepted"):
        load_config(None, ["sampling.engine.attention=flash"])
    assert Engine(model, cache_dtype=jnp.bfloat16, config=SMALL).attention == "gather"  # auto on CPU
    assert Engine(model, config=dataclasses.replace(SMALL, attention="pallas")).attention == "pallas"


@pytest.mark.slow  # the kernel itself against the gather path: tests/unit/models/test_paged_attention.py
@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "t1"])
def test_pallas_decode_gives_the_gather_tokens(model, temperature):
    """attention=pallas (the TPU kernel, Pallas interpret mode on CPU: ~20 s) decodes the gather path's tokens with
    a bfloat16 pool (the kernel reads pages as bfloat16); log-probs to float tolerance."""
    kw = dict(max_new_tokens=8, num_samples=2, sampling=SamplingParams(temperature=temperature, eos_ids=EOS, seed=4))
    out = {
        a: Engine(model, cache_dtype=jnp.bfloat16, config=dataclasses.replace(SMALL, attention=a)).generate(
            PROMPTS[:3], **kw
        )
        for a in ("gather", "pallas")
    }
    assert out["pallas"].tokens == out["gather"].tokens and out["pallas"].lengths == out["gather"].lengths
    np.testing.assert_allclose(
        np.concatenate(out["pallas"].logprobs), np.concatenate(out["gather"].logprobs), atol=1e-4
    )


def test_bad_input(model):
    engine = Engine(model, config=EngineConfig(max_slots=2, page_size=4, num_pages=4))
    with pytest.raises(
        ValueError, match="sampling.engine.num_pages=4 cannot hold one request of 30 tokens .* needs >= 10"
    ):
        engine.generate([[1] * 6], max_new_tokens=24)
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        engine.generate([], max_new_tokens=4)
    with pytest.raises(ValueError, match="prompt 0: 60 tokens \\+ max_new_tokens 5 exceeds"):
        engine.generate([[1] * 60], max_new_tokens=5)
    with pytest.raises(ValueError, match="top_p must be in"):
        engine.generate([[1]], max_new_tokens=4, sampling=SamplingParams(top_p=0.0))
    engine.release()
    with pytest.raises(RuntimeError, match="released: call update_params"):
        engine.generate([[1]], max_new_tokens=4)


def test_drop_in_for_generate_rollouts(model):
    """The train loop's call (collect.generate_rollouts) gives the same rollouts with the engine as the sampler."""
    from stare_jax.training.collect import generate_rollouts, reward_fn_for

    class Tok:
        bos_id, eos_ids = 1, EOS

        def decode(self, ids):
            return " ".join(map(str, ids))

    kw = dict(
        tokenizer=Tok(),
        reward_fn=reward_fn_for("digit_sum"),
        prompt_len=32,
        max_new_tokens=12,
        num_samples=2,
        sampling=SamplingParams(temperature=1.0, top_p=1.0, top_k=0, seed=3),
        index_offset=5,
    )
    a, texts_a, _ = generate_rollouts(Sampler(model), PROMPTS, ["1:1"] * len(PROMPTS), **kw)
    b, texts_b, _ = generate_rollouts(Engine(model, config=SMALL), PROMPTS, ["1:1"] * len(PROMPTS), **kw)
    assert texts_a == texts_b
    for name in ("prompt_ids_PxT", "prompt_mask_PxT", "tokens_PxGxN", "lengths_PxG", "correct_PxG"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


def test_extend_with_a_limit_per_conversation(model):
    """max_new_tokens per conversation (a multi-turn rollout's remaining budgets): each turn stops at its own
    limit, with the same draws as a common limit (keys depend on prompt, sample and position only)."""
    kw = dict(sampling=SamplingParams(temperature=1.0, eos_ids=[], seed=5))
    tool = [[200], [201, 202], [203], [204, 205, 206]]
    limits = [2, 5, 1, 3]
    engine = Engine(model, config=SMALL)
    convs = engine.start(PROMPTS[:2], max_new_tokens=3, num_samples=2, **kw)
    engine.extend(convs, tool, max_new_tokens=limits, **kw)
    ref_engine = Engine(model, config=SMALL)
    ref = ref_engine.start(PROMPTS[:2], max_new_tokens=3, num_samples=2, **kw)
    ref_engine.extend(ref, tool, max_new_tokens=5, **kw)
    for c, r, n in zip(convs, ref, limits):
        assert len(c.turn_tokens) == n and c.turn_tokens == r.turn_tokens[:n]
    with pytest.raises(ValueError, match="3 max_new_tokens for 4 conversations"):
        engine.extend(convs, tool, max_new_tokens=[1, 2, 3], **kw)
    with pytest.raises(ValueError, match="max_new_tokens must be a positive int"):
        engine.extend(convs, tool, max_new_tokens=[1, 0, 1, 1], **kw)
    engine.close(convs)
    ref_engine.close(ref)
    assert engine.pool.all_free()


def test_make_generator_picks_the_engine_where_it_runs(model, monkeypatch):
    """sampling.engine.enabled: auto = the engine on any mesh, in one process or several (its pool's kv heads
    split over the tensor axis, its slots and pages over the data axes) for response budgets >=
    auto_min_new_tokens, the static sampler for short budgets and on several processes without a mesh; true
    there is refused by name."""
    from stare_jax import distributed
    from stare_jax.sampling.engine import make_generator

    long = dict(max_new_tokens=128)
    assert isinstance(make_generator(model, config=EngineConfig(), **long), Engine)
    assert isinstance(make_generator(model, config=EngineConfig(), max_new_tokens=8), Sampler)  # nothing to refill
    assert isinstance(make_generator(model, config=EngineConfig(enabled=True), max_new_tokens=8), Engine)
    assert isinstance(make_generator(model, config=EngineConfig(enabled=False), **long), Sampler)
    data_mesh = make_mesh({"data": 2}, devices=jax.devices()[:2])
    assert make_generator(model, config=EngineConfig(), mesh=data_mesh, **long).data_shards == 2
    with monkeypatch.context() as m:  # several processes: the engine as in one (replicated scheduler), on a mesh
        m.setattr(distributed, "is_multiprocess", lambda: True)
        assert isinstance(make_generator(model, config=EngineConfig(), mesh=data_mesh, **long), Engine)
        assert isinstance(make_generator(model, config=EngineConfig(), **long), Sampler)  # no mesh: not the engine
        with pytest.raises(
            ValueError, match="sampling.engine.enabled=true: the run has 1 processes but the engine got no mesh"
        ):
            make_generator(model, config=EngineConfig(enabled=True), **long)
    tensor_mesh = make_mesh({"data": 1, "tensor": 2}, devices=jax.devices()[:2])
    sharded = init_model(model.config, seed=0, mesh=tensor_mesh)
    engine = make_generator(sharded, config=SMALL, mesh=tensor_mesh, **long)
    assert isinstance(engine, Engine)
    kw = dict(max_new_tokens=12, num_samples=2, sampling=SamplingParams(temperature=1.0, eos_ids=EOS, seed=3))
    _assert_same(engine.generate(PROMPTS, **kw), Engine(model, config=SMALL).generate(PROMPTS, **kw))
    assert engine.pages[0]["k"].sharding.spec[0] == "tensor"  # kv heads (first: [K, N, P, Dh]) split, not replicated
    n = compiled_programs()
    engine.generate(PROMPTS, **kw)
    assert compiled_programs() == n  # the pool keeps its layout through the donated programs


def test_any_number_of_eos_ids(model):
    """More stop ids than the smallest EOS bucket (8): padded to a power of two, same stops in both samplers."""
    many = list(range(100, 140))
    kw = dict(max_new_tokens=16, num_samples=2, sampling=SamplingParams(temperature=1.0, eos_ids=many, seed=1))
    out = Engine(model, config=SMALL).generate(PROMPTS, **kw)
    _assert_same(out, Sampler(model).generate(PROMPTS, **kw))
    assert "eos" in out.finish_reasons and all(
        t[-1] in many for t, r in zip(out.tokens, out.finish_reasons) if r == "eos"
    )


class _AdmissionLog(Scheduler):
    """Records each admitted conversation's index and the slots busy right after each admission round."""

    def _admit(self, sh):
        before = {id(c) for c in sh.slots if c is not None}
        progress = super()._admit(sh)
        new = [c for c in sh.slots if c is not None and id(c) not in before]
        self.order = getattr(self, "order", []) + [c.index for c in sorted(new, key=lambda c: c.admitted)]
        self.busy = getattr(self, "busy", []) + [sum(c is not None for c in sh.slots)]
        return progress


def test_slots_refilled_in_queue_order(model):
    """Requests enter slots in queue order (prompt-major: p * G + g), a freed slot is refilled in the next round,
    and never more than max_slots rows run at once."""
    engine = _with_scheduler(Engine(model, config=SMALL), _AdmissionLog)
    out = engine.generate(
        PROMPTS, max_new_tokens=24, num_samples=3, sampling=SamplingParams(temperature=1.0, eos_ids=EOS, seed=5)
    )
    log = engine.scheduler
    assert log.order == list(range(len(PROMPTS) * 3))
    assert max(log.busy) == SMALL.max_slots and len(set(out.lengths)) > 1
    assert sum(b == SMALL.max_slots for b in log.busy) >= len(log.busy) // 2  # slots kept full while queued


def test_extend_a_subset_while_other_rows_decode(model):
    """The resumable batch (start / extend with wait=False, advance): each row's second turn is queued the round
    its first turn ends, while the other rows still decode their first; the tokens, masks and log-probs equal two
    blocking calls (start, then extend of every row), whatever joins when."""
    kw = dict(sampling=SamplingParams(temperature=1.0, eos_ids=EOS, seed=6))
    tool = lambda c: [200 + c.index, 201]  # noqa: E731
    ref_engine = Engine(model, config=SMALL)
    ref = ref_engine.start(PROMPTS[:3], max_new_tokens=16, num_samples=2, **kw)
    ref_engine.extend(ref, [tool(c) for c in ref], max_new_tokens=[4 + c.index for c in ref], **kw)
    engine = Engine(model, config=SMALL)
    convs = engine.start(PROMPTS[:3], max_new_tokens=16, num_samples=2, wait=False, **kw)
    assert engine.running and all(c.running for c in convs) and not any(c.turn_tokens for c in convs)
    turns, first_still_decoding = {}, []
    while engine.running:
        for c in engine.advance():
            assert not c.running
            turns[c.index] = turns.get(c.index, 0) + 1
            if turns[c.index] == 1:
                first_still_decoding.append(sum(t == 1 for t in turns.values()) < len(convs))
                engine.extend([c], [tool(c)], max_new_tokens=4 + c.index, wait=False, **kw)
    assert turns == {c.index: 2 for c in convs} and any(first_still_decoding)
    for c, r in zip(convs, ref):
        assert c.tokens == r.tokens and c.response_mask == r.response_mask and c.finished_eos == r.finished_eos
        np.testing.assert_allclose(
            c.response_logprobs + c.turn_logprobs, r.response_logprobs + r.turn_logprobs, atol=1e-5
        )
    engine.close(convs)
    ref_engine.close(ref)
    assert engine.pool.all_free() and not engine.running


def test_running_batch_refuses_blocking_calls_and_close_cancels_it(model):
    kw = dict(sampling=SamplingParams(temperature=1.0, eos_ids=EOS, seed=6))
    engine = Engine(model, config=SMALL)
    convs = engine.start(PROMPTS[:3], max_new_tokens=16, num_samples=2, wait=False, **kw)
    engine.advance()  # prefix entries prefilled, rows in slots
    with pytest.raises(ValueError, match="running conversations queued with wait=False"):
        engine.generate(PROMPTS[:1], max_new_tokens=4)
    with pytest.raises(ValueError, match="running conversations queued with wait=False"):
        engine.start(
            PROMPTS[:1], max_new_tokens=4, wait=False, sampling=SamplingParams(temperature=0.0)
        )  # other sampling arguments
    running = next(c for c in convs if c.running)
    with pytest.raises(ValueError, match=f"conversation {running.index} is still running"):
        engine.extend([running], [[1]], max_new_tokens=2, wait=False, **kw)
    engine.close(convs)  # an error path: the batch is cancelled, every page (prefix entries too) goes back
    assert not engine.running and engine.pool.all_free() and not any(c.running for c in convs)
    engine.generate(PROMPTS[:1], max_new_tokens=4)  # the engine is usable again


@pytest.mark.slow  # multi-turn generation with parked rows runs by default in tests/unit/tools/test_rollout.py
def test_rows_parked_between_turns_give_their_pages_to_decoding_rows(model):
    """More kept conversations than the pool holds: rows parked between turns (start with keep=True) are evicted
    for the rows still decoding and recomputed on their next turn (the whole conversation prefilled again); the
    tokens and log-probs equal a roomy pool's, and every page comes back."""
    kw = dict(sampling=SamplingParams(temperature=1.0, eos_ids=[], seed=7))
    tool = [[200 + i, 201] for i in range(10)]

    def two_turns(config):
        engine = Engine(model, config=config)
        convs = engine.start(PROMPTS, max_new_tokens=8, num_samples=2, **kw)
        evicted = engine.stats["evictions"]
        engine.extend(convs, tool, max_new_tokens=6, **kw)
        out = [(c.tokens, c.response_mask, c.response_logprobs + c.turn_logprobs) for c in convs]
        engine.close(convs)
        assert engine.pool.all_free()
        return out, evicted + engine.stats["evictions"]

    roomy, n_roomy = two_turns(dataclasses.replace(SMALL, num_pages=200))
    auto, n_auto = two_turns(SMALL)  # the auto pool holds max_slots + 1 requests, not 10 kept conversations
    tight, n_tight = two_turns(EngineConfig(max_slots=2, page_size=4, decode_chunk=4, prefill_chunk=8, num_pages=24))
    assert n_roomy == 0 and n_auto > 0 and n_tight > 0
    for other in (auto, tight):
        for (tok_a, mask_a, lp_a), (tok_b, mask_b, lp_b) in zip(roomy, other, strict=True):
            assert tok_a == tok_b and mask_a == mask_b
            np.testing.assert_allclose(lp_a, lp_b, atol=1e-5)
