"""Rollout engine (continuous batching, paged KV) vs the static Sampler vs transformers' generate: useful tokens/s.

    .venv/bin/python -m benchmarks.rollout_engine                 # the issue's workload (about 25 min on 2 cores)
    .venv/bin/python -m benchmarks.rollout_engine --quick         # the same cases, smaller (about 4 min)
    .venv/bin/python -m benchmarks.rollout_engine --cases greedy --json

Model: a random Qwen2 shape (hidden 512, 6 layers, 8 heads / 2 kv, mlp 1536, vocab 32000, fp32) made by
transformers, saved with save_pretrained and loaded by every side (benchmarks/sampler_bench.py's checkpoint).

Cases (each side runs interleaved with the others through benchmarks/harness.py after an untimed first call,
which compiles; min / median / max wall time per side, tokens/s from the median, load average, CPU count, thread
settings, `busy` when the machine was oversubscribed):
- longtail: --prompts prompts (lengths uniform in [--min-prompt, --max-prompt]) x --group samples, temperature 1,
  up to --max-new new tokens. The last n_eos ids of the vocabulary end a row; n_eos is sized so that a row ends at
  each step with probability ~ 1 - 2^(-1/median), median = --max-new / --median-div: response lengths are geometric
  (long-tailed: median ~ max/8, a few rows at the max). The engine and the static sampler draw the same keys, so
  they produce the same tokens (rows_identical_engine_static: all but the few rows where a draw fell within fp32
  rounding of a CDF boundary; each side's tokens/s counts its own tokens). transformers' generate cannot draw our
  keys: an EOS logit bias (a LogitsProcessor) forces each of its rows to end exactly at the length the engine drew
  for that row (EOS banned before, forced at it), so it generates the engine's number of useful tokens (checked).
  It runs in batches of --hf-batch rows (the G samples of --hf-batch / G prompts; a batch runs until its longest
  row ends).
- uniform: --uniform-prompts x --group rows, no EOS, exactly --uniform-new tokens each (engine vs static: the
  continuous batching has nothing to gain; no regression expected).
- greedy: --greedy-batch prompts x --greedy-new tokens, greedy, no EOS: engine vs static vs transformers (greedy
  sequences compared with transformers').

Useful tokens = generated tokens up to and including EOS, never padding. KV memory: kv_bytes_static is the static
sampler's preallocated cache (rows x (prompt bucket + new-token bucket) slots, every layer, k and v),
kv_bytes_engine the engine's page pool (allocated once) and kv_peak_bytes_engine its peak pages in use.
--json prints one record with tokens_per_s_engine / _static / _hf and kv_bytes_engine / _static (longtail case)
and every comparison.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import add_harness_args, compare, emit  # noqa: E402
from sampler_bench import _make_checkpoint, add_model_args  # noqa: E402

QUICK = dict(prompts=8, max_new=128, uniform_prompts=4, uniform_new=64, greedy_batch=16, greedy_new=64, repeats=2)


def _parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default="longtail,uniform,greedy", help="comma-separated: longtail, uniform, greedy")
    ap.add_argument("--quick", action="store_true", help=f"smaller workload: {QUICK}")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=512)
    ap.add_argument("--median-div", type=float, default=8.0, help="median response length = max-new / this")
    ap.add_argument("--min-prompt", type=int, default=20)
    ap.add_argument("--max-prompt", type=int, default=200)
    ap.add_argument("--uniform-prompts", type=int, default=16)
    ap.add_argument("--uniform-new", type=int, default=128)
    ap.add_argument("--greedy-batch", type=int, default=64)
    ap.add_argument("--greedy-new", type=int, default=128)
    add_model_args(ap)
    ap.add_argument("--slots", type=int, default=64, help="sampling.engine.max_slots")
    ap.add_argument("--page-size", type=int, default=16, help="sampling.engine.page_size")
    ap.add_argument("--num-pages", type=int, default=0, help="sampling.engine.num_pages (0 = auto)")
    ap.add_argument("--chunk", type=int, default=16, help="sampling.engine.decode_chunk")
    ap.add_argument("--prefill-chunk", type=int, default=256, help="sampling.engine.prefill_chunk")
    ap.add_argument("--hf-batch", type=int, default=64, help="transformers' generate batch (rows) in longtail")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers")
    ap.add_argument("--seed", type=int, default=0)
    add_harness_args(ap, repeats=2)
    args = ap.parse_args(argv)
    if args.quick:
        for k, v in QUICK.items():
            setattr(args, k, v)
    return args


def eos_count(vocab: int, median: float) -> int:
    """EOS ids whose total probability under a near-uniform next-token distribution ends a row with median
    length `median` (geometric lengths: P(end at a step) = 1 - 2^(-1/median))."""
    return max(1, round(vocab * (1.0 - 2.0 ** (-1.0 / median))))


def _prompts(rng, n, lo, hi, vocab):
    return [rng.integers(1, vocab, size=k).tolist() for k in rng.integers(lo, hi + 1, size=n)]


def _left_pad(prompts):
    import torch

    T = max(map(len, prompts))
    ids = torch.zeros((len(prompts), T), dtype=torch.long)
    mask = torch.zeros((len(prompts), T), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, T - len(p) :] = torch.tensor(p)
        mask[i, T - len(p) :] = 1
    return ids, mask


def forced_length_processor(lengths_R, eos_ids, eos_at_end_R, prompt_len):
    """A transformers LogitsProcessor: row r samples no EOS before its response index lengths_R[r] - 1 and, where
    eos_at_end_R[r], only EOS (eos_ids[0]) at that index."""
    import torch
    import transformers

    eos = torch.tensor(eos_ids)
    last = torch.tensor(lengths_R) - 1
    force = torch.tensor(eos_at_end_R, dtype=torch.bool)

    class ForcedLength(transformers.LogitsProcessor):
        def __call__(self, input_ids, scores):
            step = input_ids.shape[1] - prompt_len
            scores[:, eos] = -math.inf
            rows = torch.nonzero(force & (last == step)).flatten()
            if len(rows):
                scores[rows] = -math.inf
                scores[rows, eos[0]] = 0.0
            return scores

    return ForcedLength()


def hf_longtail(hf, prompts, G, max_new, lengths, finished, eos_ids, batch_rows):
    """transformers' generate over the prompts in batches of batch_rows rows (G per prompt), each row forced to
    its given length; returns the useful tokens per row (prompt-major)."""
    import torch
    import transformers

    per, eos_set = max(1, batch_rows // G), set(eos_ids)
    useful = []
    for s in range(0, len(prompts), per):
        chunk = prompts[s : s + per]
        ids, mask = _left_pad(chunk)
        rows = slice(s * G, (s + len(chunk)) * G)
        proc = forced_length_processor(lengths[rows], eos_ids, finished[rows], ids.shape[1])
        with torch.no_grad():
            out = hf.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=max_new,
                num_return_sequences=G,
                pad_token_id=0,
                eos_token_id=list(eos_ids),
                logits_processor=transformers.LogitsProcessorList([proc]),
            )
        for row in out[:, ids.shape[1] :].tolist():
            ends = [i for i, t in enumerate(row) if t in eos_set]
            useful.append(ends[0] + 1 if ends else len(row))
    return useful


def rows_identical(a_tokens, b_tokens) -> list:
    """[rows with identical tokens, rows, fraction of tokens inside the rows' common prefixes]. Exact identity is
    what the tests check on small vocabularies; with a 32000-token near-uniform distribution a few temperature-1
    draws fall within fp32 rounding of a CDF boundary (the two attention paths sum over different key lengths),
    after which that row's continuation differs - at a random position, so most of each row still agrees. Sides
    that do not draw the same samples diverge at the first token: below half the tokens in common prefixes, exit
    with an error."""
    same = sum(x == y for x, y in zip(a_tokens, b_tokens))
    common = total = 0
    for x, y in zip(a_tokens, b_tokens):
        n = next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
        common, total = common + n, total + max(len(x), len(y))
    prefix = common / max(total, 1)
    if prefix < 0.5:
        raise SystemExit(
            f"only {same}/{len(a_tokens)} rows identical and {prefix:.2f} of the tokens in common "
            f"prefixes between the engine and the static sampler"
        )
    return [same, len(a_tokens), round(prefix, 4)]


def static_kv_bytes(sampler, cfg, num_rows: int, longest_prompt: int, max_new: int) -> int:
    """Bytes of the static sampler's preallocated KV cache for a call."""
    import jax.numpy as jnp

    from stare_jax.sampling.sampler import new_token_bucket, next_bucket

    slots = next_bucket(longest_prompt, sampler.min_prompt_bucket) + new_token_bucket(max_new, 16)
    item = jnp.dtype(sampler.cache_dtype).itemsize
    return int(slots * num_rows * cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * item)


def main(argv=None):
    args = _parse(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import torch

    from stare_jax.models import from_pretrained
    from stare_jax.sampling import Sampler, SamplingParams
    from stare_jax.sampling.engine import Engine, EngineConfig, kv_bytes

    out_stream = sys.stderr if args.json else sys.stdout
    with tempfile.TemporaryDirectory() as tmp:
        hf = _make_checkpoint(args, tmp)
        model = from_pretrained(tmp)
    cfg = model.config
    static = Sampler(model)
    engine = Engine(
        model,
        config=EngineConfig(
            max_slots=args.slots,
            page_size=args.page_size,
            num_pages=args.num_pages,
            decode_chunk=args.chunk,
            prefill_chunk=args.prefill_chunk,
        ),
    )
    rng = np.random.default_rng(args.seed)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    result: dict = {
        "benchmark": "rollout_engine",
        "comparisons": [],
        "model": {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab},
        "engine_config": {
            "max_slots": args.slots,
            "page_size": args.page_size,
            "decode_chunk": args.chunk,
            "prefill_chunk": args.prefill_chunk,
        },
    }
    G = args.group

    if "longtail" in cases:
        n_eos = eos_count(args.vocab, args.max_new / args.median_div)
        eos = list(range(args.vocab - n_eos, args.vocab))
        prompts = _prompts(rng, args.prompts, args.min_prompt, args.max_prompt, args.vocab - n_eos)
        kw = dict(
            max_new_tokens=args.max_new,
            num_samples=G,
            sampling=SamplingParams(temperature=1.0, eos_ids=eos, seed=args.seed),
        )
        ref, got = static.generate(prompts, **kw), engine.generate(prompts, **kw)  # compiles
        same = rows_identical(ref.tokens, got.tokens)
        lengths, finished = got.lengths, [r == "eos" for r in got.finish_reasons]
        useful, useful_static = sum(lengths), sum(ref.lengths)
        sides = {"engine": lambda: engine.generate(prompts, **kw), "static": lambda: static.generate(prompts, **kw)}
        if not args.no_hf:
            hf_useful = hf_longtail(hf, prompts, G, args.max_new, lengths, finished, eos, args.hf_batch)
            if hf_useful != lengths:
                raise SystemExit("longtail: transformers' rows did not end at the forced lengths")
            sides["transformers"] = lambda: hf_longtail(
                hf, prompts, G, args.max_new, lengths, finished, eos, args.hf_batch
            )
        res = compare(
            sides,
            repeats=args.repeats,
            warmup=0,
            reference="static",
            label="longtail",
            units=useful,
            unit_name="tokens",
        )
        result["comparisons"].append(res)
        med = {n: res["sides"][n]["median_s"] for n in sides}
        page_bytes = kv_bytes(engine) // engine.live_pool.num_pages
        result.update(
            {
                "workload": {
                    "prompts": args.prompts,
                    "group": G,
                    "max_new": args.max_new,
                    "eos_ids": n_eos,
                    "prompt_lens": [min(map(len, prompts)), max(map(len, prompts))],
                    "useful_tokens": useful,
                    "lengths_median": float(np.median(lengths)),
                    "lengths_mean": float(np.mean(lengths)),
                    "rows_at_max": int(sum(n == args.max_new for n in lengths)),
                    "hf_batch": args.hf_batch,
                },
                "rows_identical_engine_static": same,
                "tokens_per_s_engine": useful / med["engine"],
                "tokens_per_s_static": useful_static / med["static"],
                "tokens_per_s_hf": useful / med["transformers"] if "transformers" in med else None,
                "engine_vs_static": (useful / med["engine"]) / (useful_static / med["static"]),
                "engine_vs_hf": med["transformers"] / med["engine"] if "transformers" in med else None,
                "kv_bytes_static": static_kv_bytes(static, cfg, args.prompts * G, max(map(len, prompts)), args.max_new),
                "kv_bytes_engine": kv_bytes(engine),
                "kv_peak_bytes_engine": int(engine.stats["peak_pages"] * page_bytes),
                "engine_stats": dict(engine.stats),
            }
        )
        result["kv_ratio_engine_vs_static"] = result["kv_bytes_engine"] / result["kv_bytes_static"]
        print(
            f"[longtail] {result['workload']}\n[longtail] engine / static {result['engine_vs_static']:.2f}x, "
            f"engine / transformers {result['engine_vs_hf'] or float('nan'):.2f}x, KV bytes engine pool "
            f"{result['kv_bytes_engine']:,} (peak in use {result['kv_peak_bytes_engine']:,}) vs static "
            f"{result['kv_bytes_static']:,} = {result['kv_ratio_engine_vs_static']:.3f}x",
            file=out_stream,
        )

    if "uniform" in cases:
        prompts = _prompts(rng, args.uniform_prompts, args.min_prompt, args.max_prompt, args.vocab)
        kw = dict(
            max_new_tokens=args.uniform_new,
            num_samples=G,
            sampling=SamplingParams(temperature=1.0, eos_ids=[], seed=args.seed),
        )
        result["uniform_rows_identical"] = rows_identical(
            static.generate(prompts, **kw).tokens, engine.generate(prompts, **kw).tokens
        )
        res = compare(
            {"engine": lambda: engine.generate(prompts, **kw), "static": lambda: static.generate(prompts, **kw)},
            repeats=args.repeats,
            warmup=0,
            reference="static",
            label="uniform",
            units=len(prompts) * G * args.uniform_new,
            unit_name="tokens",
        )
        result["comparisons"].append(res)
        result["uniform_engine_vs_static"] = res["sides"]["static"]["median_s"] / res["sides"]["engine"]["median_s"]

    if "greedy" in cases:
        prompts = _prompts(rng, args.greedy_batch, args.min_prompt, min(args.max_prompt, 64), args.vocab)
        kw = dict(max_new_tokens=args.greedy_new, sampling=SamplingParams(temperature=0.0, eos_ids=[], seed=0))
        ids, mask = _left_pad(prompts)
        hf_kw = dict(
            max_new_tokens=args.greedy_new,
            min_new_tokens=args.greedy_new,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )

        def run_hf():
            with torch.no_grad():
                return hf.generate(input_ids=ids, attention_mask=mask, **hf_kw)

        ours = engine.generate(prompts, **kw).tokens
        result["greedy_rows_identical_engine_static"] = rows_identical(static.generate(prompts, **kw).tokens, ours)
        sides = {"engine": lambda: engine.generate(prompts, **kw), "static": lambda: static.generate(prompts, **kw)}
        if not args.no_hf:
            result["greedy_identical_to_hf"] = sum(a == b for a, b in zip(ours, run_hf()[:, ids.shape[1] :].tolist()))
            sides["transformers"] = run_hf
        res = compare(
            sides,
            repeats=args.repeats,
            warmup=0,
            reference="transformers" if not args.no_hf else "static",
            label="greedy",
            units=len(prompts) * args.greedy_new,
            unit_name="tokens",
        )
        result["comparisons"].append(res)
        if not args.no_hf:
            med = {n: res["sides"][n]["median_s"] for n in sides}
            result["greedy_engine_vs_hf"] = med["transformers"] / med["engine"]
            result["greedy_static_vs_hf"] = med["transformers"] / med["static"]
            print(
                f"[greedy] sequences identical to transformers: {result['greedy_identical_to_hf']}/{len(prompts)}",
                file=out_stream,
            )
    emit(result, args.json)
    return result


if __name__ == "__main__":
    main()
