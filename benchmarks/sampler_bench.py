"""Sampler throughput: stare_jax vs transformers `generate`, same random Qwen2-shaped model, same CPU, one run.

    .venv/bin/python benchmarks/sampler_bench.py                 # batch 64 x 128 new tokens, greedy + sampling
    .venv/bin/python benchmarks/sampler_bench.py --mode greedy --batch 16 --new-tokens 32   # quick look

The weights are made by transformers (torch, fp32), saved with save_pretrained and loaded by both sides.
EOS is disabled on both sides so every sequence makes exactly --new-tokens tokens. Each side gets a warm-up call
(compilation for JAX, first-call overheads for torch), then --reps timed calls alternating the two sides; the
best wall time of each is reported as generated tokens per second (batch * new_tokens / seconds), with the
process CPU time of that call (both libraries use all cores) and the ratio stare_jax / transformers.
On a machine shared with other jobs the ratio moves with the load (torch's OpenMP matmuls degrade more under
oversubscription); compare the CPU seconds too.
"""
from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np


def _parse():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--min-prompt", type=int, default=16)
    ap.add_argument("--max-prompt", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--mode", choices=("greedy", "sample", "both"), default="both")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def _make_checkpoint(args, folder):
    import torch
    import transformers

    torch.manual_seed(args.seed)
    cfg = transformers.Qwen2Config(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, intermediate_size=args.intermediate,
        max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None,
        pad_token_id=0)
    hf = transformers.Qwen2ForCausalLM(cfg).eval().to(torch.float32)
    hf.save_pretrained(folder)
    return hf


def _prompts(args):
    rng = np.random.default_rng(args.seed)
    lens = rng.integers(args.min_prompt, args.max_prompt + 1, size=args.batch)
    return [rng.integers(1, args.vocab, size=n).tolist() for n in lens]


def _time_best(fns, reps):
    """Warm each side up, then alternate them `reps` times (so a load spike on this shared machine hits both);
    best wall time and the process CPU time of that run, per side."""
    for fn in fns:
        fn()  # warm-up (compile / first-call)
    best = [(float("inf"), 0.0)] * len(fns)
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t0, c0 = time.perf_counter(), time.process_time()
            fn()
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            best[i] = min(best[i], (wall, cpu))
    return best


def main():
    args = _parse()
    import jax
    import torch

    from stare_jax.models import from_pretrained
    from stare_jax.sampling import Sampler

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
        ids[i, T - len(p):] = torch.tensor(p)
        mask[i, T - len(p):] = 1

    print(f"model: Qwen2-shaped hidden {args.hidden}, {args.layers} layers, {args.heads} heads / {args.kv_heads} kv, "
          f"mlp {args.intermediate}, vocab {args.vocab}, fp32 | batch {args.batch} x {args.new_tokens} new tokens, "
          f"prompts {args.min_prompt}-{args.max_prompt} tokens | jax {jax.__version__} on "
          f"{jax.devices()[0].platform} ({len(jax.devices())} devices), torch {torch.__version__} "
          f"({torch.get_num_threads()} threads), {os.cpu_count()} CPUs")
    modes = ("greedy", "sample") if args.mode == "both" else (args.mode,)
    for mode in modes:
        greedy = mode == "greedy"
        jax_kw = dict(max_new_tokens=args.new_tokens, temperature=0.0 if greedy else 1.0, eos_ids=[], seed=0)
        hf_kw = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=not greedy,
                     pad_token_id=0, eos_token_id=None)
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

        (t_jax, c_jax), (t_hf, c_hf) = _time_best([run_jax, run_hf], args.reps)
        if greedy:
            ours, ref = run_jax().tokens, run_hf()[:, T:].tolist()
            same = sum(a == b for a, b in zip(ours, ref))
            agree = f" | greedy sequences identical to transformers: {same}/{args.batch}"
        else:
            agree = ""
        print(f"[{mode}] stare_jax: {n_tokens / t_jax:8.1f} tok/s ({t_jax:.2f} s wall, {c_jax:.2f} s CPU) | "
              f"transformers: {n_tokens / t_hf:8.1f} tok/s ({t_hf:.2f} s wall, {c_hf:.2f} s CPU) | "
              f"ratio {t_hf / t_jax:.2f}x{agree}")

if __name__ == "__main__":
    main()
