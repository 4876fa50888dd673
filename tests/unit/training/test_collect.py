"""stare_jax.training.collect: left padding, and generate_rollouts on the real toy assets (SentencePiece tokenizer, tiny
model, digit-set verifier) on the 8-device test mesh: shapes, scores equal to the verifier applied to the decoded
texts, and the same samples whether the prompts go to the sampler in one call or in chunks."""

from __future__ import annotations

import json

import numpy as np
import pytest

from stare_jax.sampling.params import SamplingParams
from stare_jax.training.collect import (
    RewardFn,
    Rollouts,
    generate_rollouts,
    left_pad,
    reward_fn_for,
    train_batch_from_rollouts,
)


def test_reward_fn_scores_toy_tasks_in_process_and_math_in_the_pool():
    from stare_jax.rewards import RewardFn as FromRewards

    assert RewardFn is FromRewards  # the one RewardFn lives with the rewards; rollouts re-exports it
    scores, stats = reward_fn_for("digit_sum")(["18", " 99 ", "123"], ["2:9", "2:18", "2:3"])
    np.testing.assert_array_equal(scores, [1.0, 1.0, 0.0])
    assert scores.dtype == np.float32 and stats == {}
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        reward_fn_for("nope")
    fn = reward_fn_for("math", num_workers=1)
    try:  # a joined Minerva-style reference is scored against each of its forms
        scores, stats = fn(["\\boxed{0.02}", "\\boxed{3}", "\\boxed{9^{9^{9^{9}}}}"], ["0.01\n, 0.02\n", "4", "1"])
    finally:
        fn.close()
    np.testing.assert_array_equal(scores, [1.0, 0.0, 0.0])
    assert stats["n_items"] == 3 and stats["n_ok"] == 3


def test_left_pad():
    ids, mask = left_pad([[5, 6, 7], [9]], 4, pad_id=0)
    np.testing.assert_array_equal(ids, [[0, 5, 6, 7], [0, 0, 0, 9]])
    np.testing.assert_array_equal(mask, [[0, 1, 1, 1], [0, 0, 0, 1]])


@pytest.fixture(scope="module")
def toy_setup(tmp_path_factory):
    import jax

    from stare_jax import models
    from stare_jax.data.tokenizer import load_tokenizer
    from stare_jax.models.sharding import make_mesh
    from stare_jax.sampling import Sampler
    from stare_jax.toy import assets as toy

    assets = toy.prepare(
        toy.ToyAssetConfig(hidden_size=32, num_layers=2, sft_steps=20, num_train=300, num_eval=20),
        tmp_path_factory.mktemp("toy"),
        log=lambda *_: None,
    )
    tok = load_tokenizer(assets.model_dir / "tokenizer.model")
    mesh = make_mesh({"data": jax.device_count()}) if jax.device_count() > 1 else None
    model = models.from_pretrained(assets.model_dir, mesh=mesh)
    rows = [json.loads(line) for line in assets.train_path.read_text().splitlines()[:10]]
    prompts = [tok.encode(r["problem"]) for r in rows]
    return Sampler(model, mesh=mesh, pad_id=tok.pad_id), tok, prompts, [r["answer"] for r in rows], model


def _roll(toy_setup, **kw):
    sampler, tok, prompts, answers, _ = toy_setup
    return generate_rollouts(
        sampler,
        prompts,
        answers,
        tokenizer=tok,
        reward_fn=reward_fn_for("digit_set"),
        prompt_len=16,
        max_new_tokens=8,
        num_samples=3,
        sampling=SamplingParams(temperature=1.0, top_p=1.0, top_k=0, seed=7),
        index_offset=100,
        **kw,
    )


def test_rollouts_shapes_and_scores(toy_setup):
    from stare_jax.tasks import TASKS

    _, _, prompts, answers, _ = toy_setup
    r, texts, stats = _roll(toy_setup)
    assert r.tokens_PxGxN.shape == (10, 3, 8) and r.lengths_PxG.shape == (10, 3) and r.prompt_ids_PxT.shape == (10, 16)
    assert len(texts) == 30 and stats == {}
    want = [TASKS["digit_set"].score(t, answers[b // 3]) for b, t in enumerate(texts)]
    np.testing.assert_array_equal(r.correct_PxG.reshape(-1), want)
    assert (r.lengths_PxG > 0).all() and len({t for t in texts}) > 1
    for b, t in enumerate(texts):  # texts are the decoded tokens of each response, up to its length
        p, g = divmod(b, 3)
        assert t == toy_setup[1].decode(r.tokens_PxGxN[p, g, : r.lengths_PxG[p, g]].tolist())
    for p, ids in enumerate(prompts):  # left-padded prompts, mask on the real tokens
        assert r.prompt_ids_PxT[p, 16 - len(ids) :].tolist() == ids and r.prompt_mask_PxT[p].sum() == len(ids)


def test_chunked_calls_give_the_same_samples(toy_setup):
    whole, texts, _ = _roll(toy_setup)
    for chunk in (3, 4):  # uneven chunks: 3 + 3 + 3 + 1 and 4 + 4 + 2 prompts per sampler call
        parts, parts_texts, _ = _roll(toy_setup, max_prompts_per_call=chunk)
        for f in ("prompt_ids_PxT", "prompt_mask_PxT", "tokens_PxGxN", "lengths_PxG", "correct_PxG"):
            np.testing.assert_array_equal(getattr(parts, f), getattr(whole, f), err_msg=f"{f}, chunk {chunk}")
        assert parts_texts == texts


def test_the_samplers_log_probs_reach_the_train_batch_aligned_with_the_ids(toy_setup):
    """rollout_logprobs_BxT (rl.rollout_correction's input): the sampler's log-prob of input_ids[b, t] where it
    sampled that token, 0 elsewhere; equal, to fp32 rounding, to the trainer's teacher-forced recomputation."""
    from stare_jax.rl.step import policy_forward, shift_batch, split_model

    model = toy_setup[4]
    r, _, _ = _roll(toy_setup)
    assert r.logprobs_PxGxN is not None and r.logprobs_PxGxN.shape == r.tokens_PxGxN.shape
    batch = train_batch_from_rollouts(r, np.zeros(r.correct_PxG.shape, np.float32))
    roll, resp = batch["rollout_logprobs_BxT"], batch["response_mask_BxT"]
    assert roll.shape == resp.shape and roll.dtype == np.float32
    assert (roll[resp == 0] == 0).all() and (roll[resp > 0] < 0).all()
    ids, attn, tgt, lm, _ = shift_batch(batch)
    graphdef, params, rest = split_model(model)
    trainer, _ = policy_forward(graphdef, params, rest, ids, attn, tgt, lm, chunk_size=8)
    np.testing.assert_allclose(roll[:, 1:], np.asarray(trainer) * np.asarray(lm), atol=2e-4)
    # a tool row: observation tokens carry NaN log-probs and model_mask 0; they stay out (0) of the batch
    mm = np.ones_like(r.tokens_PxGxN)
    mm[:, :, 1:3] = 0
    lp = np.where(mm > 0, r.logprobs_PxGxN, np.nan).astype(np.float32)
    tool = Rollouts(**{**r.__dict__, "model_mask_PxGxN": mm, "logprobs_PxGxN": lp})
    tb = train_batch_from_rollouts(tool, np.zeros(r.correct_PxG.shape, np.float32))
    assert np.isfinite(tb["rollout_logprobs_BxT"]).all()
    assert (tb["rollout_logprobs_BxT"][tb["response_mask_BxT"] == 0] == 0).all()
