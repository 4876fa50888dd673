"""Sampler throughput: stare_jax vs transformers `generate`, same random Qwen2-shaped model, same CPU, one run.

    .venv/bin/python benchmarks/sampler_bench.py                 # batch 16 x 32 new tokens, greedy + sampling
    .venv/bin/python benchmarks/sampler_bench.py --batch 64 --new-tokens 128   # the larger setting (many minutes
                                                                              # on 2 cores: transformers' generate)

The weights are made by transformers (torch, fp32), saved with save_pretrained and loaded by both sides.
EOS is disabled on both sides so every sequence makes exactly --new-tokens tokens. The two sides run interleaved
in one process through benchmarks/harness.py (an untimed warm-up call each: compilation for JAX, first-call
overheads for torch; then --repeats rounds A B A B ...): min/median/max wall time per side, generated tokens per
second at the median (batch * new_tokens / seconds), the process CPU time, the ratio stare_jax / transformers of the
medians, the load average before/after and the thread settings (--json for the record).
On a machine shared with other jobs the ratio moves with the load (torch's OpenMP matmuls degrade more under
oversubscription; the harness flags `busy` when the load average exceeded the core count); compare the CPU seconds
too.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import add_harness_args, compare, emit  # noqa: E402


def _parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=64)
    add_model_args(ap)
    ap.add_argument("--mode", choices=("greedy", "sample", "both"), default="both")
    ap.add_argument("--reps", type=int, default=None, help="old name of --repeats")
    ap.add_argument("--seed", type=int, default=0)
    add_harness_args(ap, repeats=3)
    args = ap.parse_args(argv)
    if args.reps is not None:
        args.repeats = args.reps
    return args


def add_model_args(ap) -> None:
    """The random Qwen2 shape's flags (default hidden 512, 6 layers, 8 heads / 2 kv, mlp 1536, vocab 32000), read by
    _make_checkpoint; shared with benchmarks/rollout_engine.py."""
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=32000)


def _make_checkpoint(args, folder):
    import torch
    import transformers

    torch.manual_seed(args.seed)
    cfg = transformers.Qwen2Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        intermediate_size=args.intermediate,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
    )
    hf = transformers.Qwen2ForCausalLM(cfg).eval().to(torch.float32)
    hf.save_pretrained(folder)
    return hf


def _prompts(args):
    rng = np.random.default_rng(args.seed)
    lens = rng.integers(args.min_prompt, args.max_prompt + 1, size=args.batch)
    return [rng.integers(1, args.vocab, size=n).tolist() for n in lens]


def main(argv=None):
    args = _parse(argv)
    import jax
    import torch

    from stare_jax.models import from_pretrained
    from stare_jax.sampling import Sampler, SamplingParams

    prompts = _prompts(args)
    n_tokens = args.batch * args.new_tokens
    with tempfile.TemporaryDirectory() as tmp:
        hf = _make_checkpoint(args, tmp)
        model = from_pretrained(tmp)
    sampler = Sampler(model)

    T = max(map(len, prompts))
    ids = torch.zeros((args.batch, T), dtype=torch.long)
    mask = torch.zeros((args.batch, T), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, T - len(p) :] = torch.tensor(p)
        mask[i, T - len(p) :] = 1

    out = sys.stderr if args.json else sys.stdout
    print(
        f"model: Qwen2-shaped hidden {args.hidden}, {args.layers} layers, {args.heads} heads / {args.kv_heads} kv, "
        f"mlp {args.intermediate}, vocab {args.vocab}, fp32 | batch {args.batch} x {args.new_tokens} new tokens, "
        f"prompts {args.min_prompt}-{args.max_prompt} tokens | jax {jax.__version__} on "
        f"{jax.devices()[0].platform} ({len(jax.devices())} devices), torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), {os.cpu_count()} CPUs",
        file=out,
    )
    comparisons, agreement = [], {}
    modes = ("greedy", "sample") if args.mode == "both" else (args.mode,)
    for mode in modes:
        greedy = mode == "greedy"
        jax_kw = dict(
            max_new_tokens=args.new_tokens,
            sampling=SamplingParams(temperature=0.0 if greedy else 1.0, eos_ids=[], seed=0),
        )
        hf_kw = dict(
            max_new_tokens=args.new_tokens,
            min_new_tokens=args.new_tokens,
            do_sample=not greedy,
            pad_token_id=0,
            eos_token_id=None,
        )
        if not greedy:
            hf_kw.update(temperature=1.0, top_k=0, top_p=1.0)

        def run_jax():
            out = sampler.generate(prompts, **jax_kw)
            assert out.lengths == [args.new_tokens] * args.batch
            return out

        def run_hf():
            with torch.no_grad():
                out = hf.generate(input_ids=ids, attention_mask=mask, **hf_kw)
            assert out.shape == (args.batch, T + args.new_tokens)
            return out

        res = compare(
            {"stare_jax": run_jax, "transformers": run_hf},
            repeats=args.repeats,
            label=mode,
            units=n_tokens,
            unit_name="tokens",
        )
        comparisons.append(res)
        if greedy:
            ours, ref = run_jax().tokens, run_hf()[:, T:].tolist()
            agreement["greedy_sequences_identical"] = sum(a == b for a, b in zip(ours, ref))
            print(
                f"[greedy] sequences identical to transformers: {agreement['greedy_sequences_identical']}/{args.batch}",
                file=out,
            )
    result = {
        "benchmark": "sampler_bench",
        "batch": args.batch,
        "new_tokens": args.new_tokens,
        "comparisons": comparisons,
        **agreement,
    }
    emit(result, args.json)
    return result


if __name__ == "__main__":
    main()
