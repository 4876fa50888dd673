"""Sequence packing: train-step useful tokens/s, packed vs padded, on a long-tailed RL batch (CPU).

The batch: 64 responses whose lengths are lognormal with median 1/8 of the maximum (2048 new tokens: median 256,
sigma 1), each after a prompt of 16-64 tokens (left-padded to 64), so the padded layout is [64, 2112] and most of
it is padding. The model: a ~55M-parameter Qwen2 shape (hidden 512, 8 layers, 8 heads / 2 KV heads, MLP 1408,
vocab 32000, q/k/v bias, untied; the shape benchmarks/model_fwd_bwd.py uses), fp32. The step: STARE-O1 (gate on),
token-mean, one micro-batch per row of 2112 tokens on both sides (padded: one sequence per micro-batch; packed:
one packed row, first-fit-decreasing, rl.packing.row_tokens = the padded length).

Useful tokens = the batch's real tokens (prompt + response); both sides process the same ones, so the speed ratio
is the ratio of step times. The timed calls' outputs check that both sides compute the same step: the loss and the
gradient (max abs difference printed) and the STARE selection.

    .venv/bin/python benchmarks/packing.py [--quick] [--repeats N] [--json]

--quick keeps the model shape and the distribution but takes 16 responses of at most 512 new tokens (a few
minutes on 2 cores; the full size takes hours on a shared 2-core machine). Both sides are compiled ahead of the
timing (jit .lower().compile()), so the timed rounds (harness.compare, interleaved, no warm-up call) hold no
compile.
"""

from __future__ import annotations

import argparse
import builtins
import dataclasses
import functools
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402
from harness import add_harness_args, compare, emit  # noqa: E402

from stare_jax.config.packing import PackingConfig  # noqa: E402
from stare_jax.models import ModelConfig, init_model  # noqa: E402
from stare_jax.rl.packing import fill_rate, host_layout, packed_stats, rows_per_micro  # noqa: E402
from stare_jax.rl.stare import StareConfig, init_stare_state  # noqa: E402
from stare_jax.rl.step import OptimizerConfig, TrainStepConfig, init_train_state, make_train_step  # noqa: E402

print = functools.partial(print, flush=True)  # noqa: A001 (progress visible when piped)

MODEL = dict(
    vocab_size=32000,
    hidden_size=512,
    num_layers=8,
    num_heads=8,
    num_kv_heads=2,
    intermediate_size=1408,
    qkv_bias=True,
    tie_word_embeddings=False,
    rope_theta=10000.0,
)
SIZES = {"full": (64, 2048, 64), "quick": (16, 512, 32)}  # responses, max new tokens, prompt bucket


def long_tailed_batch(rng, n: int, max_new: int, prompt_bucket: int, vocab: int, sigma: float = 1.0) -> dict:
    """The padded train batch (collect.train_batch_from_rollouts' layout): left-padded prompts of
    prompt_bucket / 4 .. prompt_bucket tokens, responses lognormal with median max_new / 8, GRPO-like advantages."""
    L = prompt_bucket + max_new
    rlen = np.clip(np.round(rng.lognormal(np.log(max_new / 8), sigma, size=n)), 1, max_new).astype(int)
    plen = rng.integers(prompt_bucket // 4, prompt_bucket + 1, size=n)
    ids = rng.integers(3, vocab, (n, L)).astype(np.int32)
    attn = np.zeros((n, L), np.int32)
    resp = np.zeros((n, L), np.int32)
    for i in range(n):
        attn[i, prompt_bucket - plen[i] : prompt_bucket + rlen[i]] = 1
        resp[i, prompt_bucket : prompt_bucket + rlen[i]] = 1
    acc = rng.integers(0, 2, size=(n // 8, 8)).astype(np.float32)
    acc[:, 0], acc[:, 1] = 1, 0
    adv = ((acc - acc.mean(1, keepdims=True)) / (acc.std(1, ddof=1, keepdims=True) + 1e-6)).reshape(-1)
    return dict(
        input_ids_BxT=np.where(attn > 0, ids, 0),
        attention_mask_BxT=attn,
        response_mask_BxT=resp,
        advantages_B=adv.astype(np.float32),
    )


def _grads(met):
    return np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(met["debug/grads"])])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="16 responses of at most 512 new tokens (same model)")
    ap.add_argument("--sigma", type=float, default=1.0, help="lognormal sigma of the response lengths")
    ap.add_argument("--seed", type=int, default=0)
    add_harness_args(ap, repeats=1)
    args = ap.parse_args(argv)
    if args.json:  # progress lines to stderr, the JSON record alone on stdout
        globals()["print"] = functools.partial(builtins.print, flush=True, file=sys.stderr)
    n, max_new, prompt_bucket = SIZES["quick" if args.quick else "full"]
    L = prompt_bucket + max_new
    mcfg = ModelConfig(**MODEL, max_position_embeddings=L)
    model = init_model(mcfg, seed=0)
    batch = long_tailed_batch(np.random.default_rng(args.seed), n, max_new, prompt_bucket, mcfg.vocab_size, args.sigma)
    real = int(batch["attention_mask_BxT"].sum())
    resp_len = batch["response_mask_BxT"].sum(1)
    stare = StareConfig(enabled=True, variant="O1", target_entropy=1e3)  # the batch gate is on
    padded_cfg = TrainStepConfig(
        optimizer=OptimizerConfig(lr=1e-6), stare=stare, num_micro_batches=n, debug_outputs=True
    )
    packed_cfg = dataclasses.replace(padded_cfg, packing=PackingConfig(enabled=True), micro_batch_tokens=L)
    packed = host_layout(batch, packed_cfg, shards=1)
    stats = packed_stats(packed, rows_per_micro(L, L, 1))
    print(
        f"batch: {n} responses, new tokens median {np.median(resp_len):.0f} mean {resp_len.mean():.0f} max "
        f"{resp_len.max()} (of {max_new}); padded [{n}, {L}] = {n * L} tokens, {real} real "
        f"({real / (n * L):.1%}); packed {stats['rows_used']} rows of {L} (fill {stats['fill_rate']:.1%}), "
        f"{stats['micro_batches_used']} of {stats['micro_batches']} micro-batches run"
    )
    big = np.clip(np.round(np.random.default_rng(1).lognormal(np.log(max_new / 8), args.sigma, 4096)), 1, max_new)
    print(
        f"first-fit-decreasing fill rate, 4096 responses of this distribution (+ {prompt_bucket}-token prompts) "
        f"in rows of {L}: {fill_rate(big + prompt_bucket, L):.1%}"
    )

    graphdef, ts = init_train_state(model, padded_cfg)
    ss = init_stare_state(stare)
    compiled = {}
    for name, cfg, b in (("packed", packed_cfg, packed), ("padded", padded_cfg, batch)):
        t0 = time.perf_counter()
        compiled[name] = (make_train_step(graphdef, cfg, donate=False).lower(ts, b, ss).compile(), b)
        print(f"{name}: compiled in {time.perf_counter() - t0:.1f} s")
    outs: dict = {}

    def call(name):  # a timed call; its metrics (the last round's) are the parity check's
        c, b = compiled[name]
        outs[name] = c(ts, b, ss)[2]
        return outs[name]

    res = compare(
        {name: functools.partial(call, name) for name in compiled},
        repeats=args.repeats,
        warmup=0,
        reference="padded",
        units=real,
        unit_name="useful_tokens",
        label=f"train step, {n} long-tailed responses (<= {max_new} new tokens): packed / padded",
    )
    m_pack, m_pad = jax.device_get(outs["packed"]), jax.device_get(outs["padded"])
    loss_diff = abs(float(m_pack["loss"]) - float(m_pad["loss"]))
    grad_diff = float(np.abs(_grads(m_pack) - _grads(m_pad)).max())
    grad_max = float(np.abs(_grads(m_pad)).max())
    print(
        f"same step: loss {float(m_pad['loss']):.8f} padded vs {float(m_pack['loss']):.8f} packed, max abs diff "
        f"{loss_diff:.2e}; gradient max abs diff {grad_diff:.2e} (max |g| {grad_max:.2e}); STARE reweighted "
        f"{float(m_pad['stare/frac_reweighted']):.6f} vs {float(m_pack['stare/frac_reweighted']):.6f}"
    )
    ratio = res["ratios"]["packed"]["ratio_of_medians"]
    print(
        f"useful tokens/s: packed {res['sides']['packed']['useful_tokens_per_s']:.1f}, padded "
        f"{res['sides']['padded']['useful_tokens_per_s']:.1f} -> packed / padded {ratio:.2f}x"
    )
    result = {
        "benchmark": "packing",
        "size": "quick" if args.quick else "full",
        "responses": n,
        "max_new_tokens": max_new,
        "padded_tokens": n * L,
        "real_tokens": real,
        "packing": stats,
        "loss_max_abs_diff": loss_diff,
        "grad_max_abs_diff": grad_diff,
        "grad_max_abs": grad_max,
        "comparisons": [res],
    }
    emit(result, args.json)
    return result


if __name__ == "__main__":
    main()
