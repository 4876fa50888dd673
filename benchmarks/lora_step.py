"""The RL train step with LoRA adapters vs full fine-tuning, same model and batch: optimizer-state bytes (AdamW
moments of what is trained), trained-parameter count, and step time interleaved by the harness (speed ratio > 1:
the first side is faster).

    python benchmarks/lora_step.py [--hidden 512 --layers 8 --rank 32 --batch 32 --len 256]
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import numpy as np
from harness import add_harness_args, compare, emit

from stare_jax.models import ModelConfig, init_model
from stare_jax.models.config import LORA_TARGETS
from stare_jax.rl.stare import StareConfig, init_stare_state
from stare_jax.rl.step import OptimizerConfig, TrainStepConfig, init_train_state, make_train_step


def _batch(vocab: int, B: int, T: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    prompt = T // 4
    ids = rng.integers(1, vocab, size=(B, T)).astype(np.int32)
    attn = np.ones((B, T), np.int32)
    resp = np.zeros((B, T), np.int32)
    resp[:, prompt:] = 1
    return {
        "input_ids_BxT": ids,
        "attention_mask_BxT": attn,
        "response_mask_BxT": resp,
        "advantages_B": rng.normal(size=B).astype(np.float32),
    }


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--len", type=int, default=256)
    add_harness_args(ap, repeats=3)
    args = ap.parse_args(argv)
    full_cfg = ModelConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=8,
        num_kv_heads=4,
        intermediate_size=4 * args.hidden,
        max_position_embeddings=args.len,
    )
    lora_cfg = dataclasses.replace(full_cfg, lora_rank=args.rank, lora_alpha=2.0 * args.rank, lora_targets=LORA_TARGETS)
    stare = StareConfig(enabled=True, variant="O1", w=1.5, target_entropy=50.0)
    step_cfg = TrainStepConfig(optimizer=OptimizerConfig(lr=1e-4), stare=stare, logprob_chunk_size=64)
    batch = _batch(args.vocab, args.batch, args.len)
    sides, sizes = {}, {}
    for name, cfg in (("lora", lora_cfg), ("full", full_cfg)):
        graphdef, ts = init_train_state(init_model(cfg, seed=0), step_cfg)
        step = make_train_step(graphdef, step_cfg, donate=False)
        ss = init_stare_state(stare)
        sizes[name] = {
            "trained_params": int(sum(x.size for x in jax.tree.leaves(ts.params))),
            "optimizer_state_bytes": int(sum(x.nbytes for x in jax.tree.leaves(ts.opt_state))),
        }
        sides[name] = lambda step=step, ts=ts, ss=ss: step(ts, batch, ss)
    res = compare(
        sides,
        repeats=args.repeats,
        label=f"train step: {args.batch} x {args.len} tokens, d={args.hidden}, {args.layers} layers, rank {args.rank}",
    )
    emit({"benchmark": "lora_step", "comparisons": [res], "sizes": sizes}, as_json=args.json)
    for name, s in sizes.items():
        print(f"{name}: trained parameters {s['trained_params']:,}, optimizer state {s['optimizer_state_bytes']:,} B")


if __name__ == "__main__":
    main()
