"""How the rollout engine samples from a LoRA policy: with the adapters in its forward (what the loop does: the
engine runs the same Attention/MLP projections, x W + s x A B) or from merged weights (W + s A B computed once per
RL step by stare_jax.models.lora.merge_lora, then a plain model). Per RL step the merged side pays the merge and
the adapter side pays the extra rank-r matmuls in every decode step; both sample the same tokens up to float
rounding. Prints the harness comparison (speed ratio > 1: the first side is faster).

    python benchmarks/lora_sampling.py [--hidden 512 --layers 8 --rank 32 --prompts 16 --group 4 --max-new 128]
"""

from __future__ import annotations

import argparse
import dataclasses

import numpy as np
from harness import add_harness_args, compare, emit

from stare_jax.models import ModelConfig, init_model
from stare_jax.models.config import LORA_TARGETS
from stare_jax.models.lora import merge_lora
from stare_jax.sampling import SamplingParams
from stare_jax.sampling.engine import Engine, EngineConfig


def _parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--rank", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-new", type=int, default=128)
    add_harness_args(ap, repeats=3)
    return ap.parse_args(argv)


def main(argv=None):
    args = _parse(argv)
    base = ModelConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=8,
        num_kv_heads=4,
        intermediate_size=4 * args.hidden,
        max_position_embeddings=1024,
        eos_token_id=None,
        pad_token_id=0,
    )
    cfg = dataclasses.replace(base, lora_rank=args.rank, lora_alpha=2.0 * args.rank, lora_targets=LORA_TARGETS)
    model = init_model(cfg, seed=0)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, args.vocab, size=args.prompt_len).tolist() for _ in range(args.prompts)]
    slots = args.prompts * args.group
    sampling = SamplingParams(temperature=1.0, eos_ids=[], seed=0)
    adapter_engine = Engine(model, config=EngineConfig(max_slots=slots))
    merged_engine = Engine(merge_lora(model), config=EngineConfig(max_slots=slots))

    def adapters():
        adapter_engine.update_params(model)  # as the loop does after each update
        return adapter_engine.generate(
            prompts, max_new_tokens=args.max_new, num_samples=args.group, sampling=sampling
        ).tokens

    def merged():
        merged_engine.update_params(merge_lora(model))  # the merge each RL step would pay
        return merged_engine.generate(
            prompts, max_new_tokens=args.max_new, num_samples=args.group, sampling=sampling
        ).tokens

    res = compare(
        {"adapters_in_forward": adapters, "merged_per_step": merged},
        repeats=args.repeats,
        label=f"one RL step's sampling: {slots} rows x {args.max_new} new tokens, d={args.hidden}, "
        f"{args.layers} layers, rank {args.rank}",
    )
    same = float(np.mean(np.asarray(adapters()) == np.asarray(merged())))
    emit({"benchmark": "lora_sampling", "comparisons": [res], "same_token_fraction": same}, as_json=args.json)


if __name__ == "__main__":
    main()
