"""Forward+backward tokens/s: stare_jax (jitted) vs transformers/PyTorch on the same CPU, same weights.

A ~55M-parameter Qwen2-shaped model (hidden 512, 8 layers, 8 heads / 2 kv heads, intermediate 1408,
vocab 32000) in fp32; loss = mean next-token cross entropy over the batch (what HF computes with labels=ids).
Both sides get the same random token batch and run the same number of timed steps after warm-up.

    .venv/bin/python benchmarks/model_fwd_bwd.py [--batch 8 --seq 256 --steps 5]
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time

import numpy as np


def build_hf(args):
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                                   num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                                   intermediate_size=args.intermediate, max_position_embeddings=4096,
                                   tie_word_embeddings=False, rope_theta=10000.0)
    model = transformers.Qwen2ForCausalLM(cfg).to(torch.float32)
    model.config._attn_implementation = "sdpa"
    return model


def bench_torch(model, ids_np, steps, warmup):
    import torch

    model.train()
    ids = torch.as_tensor(ids_np, dtype=torch.long)

    def step():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return float(loss.detach())

    for _ in range(warmup):
        loss = step()
    t0 = time.perf_counter()
    for _ in range(steps):
        loss = step()
    return (time.perf_counter() - t0) / steps, loss


def bench_jax(folder, ids_np, steps, warmup, scan_layers=False):
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from stare_jax.models import from_pretrained

    model = from_pretrained(folder, scan_layers=scan_layers)
    graphdef, state = nnx.split(model)
    ids = jnp.asarray(ids_np)

    def loss_fn(state, ids):
        logits = nnx.merge(graphdef, state)(ids)
        logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1))

    step = jax.jit(jax.value_and_grad(loss_fn))
    t0 = time.perf_counter()
    step = step.lower(state, ids).compile()
    bench_jax.compile_s = time.perf_counter() - t0
    for _ in range(warmup):
        loss, grads = step(state, ids)
        jax.block_until_ready(grads)
    t0 = time.perf_counter()
    for _ in range(steps):
        loss, grads = step(state, ids)
        jax.block_until_ready(grads)
    return (time.perf_counter() - t0) / steps, float(loss)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=1408)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--scan-layers", action="store_true", help="stare_jax with ModelConfig.scan_layers=True")
    args = p.parse_args(argv)

    hf_model = build_hf(args)
    n_params = sum(x.numel() for x in hf_model.parameters())
    ids = np.random.default_rng(0).integers(0, args.vocab, size=(args.batch, args.seq)).astype(np.int32)
    tokens = args.batch * args.seq
    with tempfile.TemporaryDirectory() as d:
        hf_model.save_pretrained(d)
        t_jax, loss_jax = bench_jax(d, ids, args.steps, args.warmup, args.scan_layers)
    t_torch, loss_torch = bench_torch(hf_model, ids, args.steps, args.warmup)
    res = {
        "params": n_params, "batch": args.batch, "seq": args.seq, "steps": args.steps,
        "jax_tokens_per_s": tokens / t_jax, "torch_tokens_per_s": tokens / t_torch,
        "ratio_jax_over_torch": t_torch / t_jax, "jax_compile_s": bench_jax.compile_s,
        "scan_layers": args.scan_layers, "loss_jax": loss_jax, "loss_torch": loss_torch,
    }
    print(f"params {n_params / 1e6:.1f}M, batch {args.batch} x {args.seq} tokens, fp32, fwd+bwd")
    print(f"stare_jax (jit)      : {res['jax_tokens_per_s']:9.1f} tokens/s  ({t_jax * 1e3:.0f} ms/step, "
          f"loss {loss_jax:.5f}, compile {bench_jax.compile_s:.1f} s)")
    print(f"transformers (torch) : {res['torch_tokens_per_s']:9.1f} tokens/s  ({t_torch * 1e3:.0f} ms/step, "
          f"loss {loss_torch:.5f})")
    print(f"ratio jax/torch      : {res['ratio_jax_over_torch']:.2f}")
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
