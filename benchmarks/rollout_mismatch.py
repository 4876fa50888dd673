"""The sampler/trainer mismatch (issue: rollout correction), measured: the same responses scored by the sampler that
drew them and by the train step's teacher-forced pass (fp32), for a float32 sampler and a bfloat16 one
(sampling.dtype; KV cache in the sampler's dtype), on the toy of the default demo and on SmolLM2-135M-Instruct with
GSM8K prompts. Prints, per model and sampler dtype, verl's diagnostics (stare_jax.rl.rollout_correction
.offpolicy_metrics) over all response tokens, over STARE's high-surprisal set (pos_high | neg_high at P = 0.1,
ranked by the trainer's log-probs) and over the rest, and how often STARE's selection differs when it ranks the
sampler's log-probs instead (rl.stare.surprisal_source: rollout): |A xor B| / |A|.

    python benchmarks/rollout_mismatch.py [--models toy,smollm2] [--prompts 16 --group 8 --max-new 32]
      [--smollm2-prompts 8 --smollm2-group 4 --smollm2-max-new 96] [--data ../shared/data/math/gsm8k_test.jsonl]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import time

import numpy as np

from stare_jax import models
from stare_jax.config.loader import load_config
from stare_jax.data.tokenizer import load_tokenizer
from stare_jax.rewards.reward_fn import RewardFn
from stare_jax.rl.rollout_correction import offpolicy_metrics
from stare_jax.rl.stare import token_weights
from stare_jax.rl.step import policy_forward, shift_batch, split_model
from stare_jax.sampling import Sampler, SamplingParams
from stare_jax.toy.assets import asset_config, prepare
from stare_jax.training.collect import generate_rollouts, train_batch_from_rollouts

REPO = pathlib.Path(__file__).resolve().parents[1]
COLUMNS = ("kl", "k3_kl", "chi2_token", "chi2_seq", "max_abs_log_ratio")
SUBSETS = ("", "high_surprisal_", "rest_")


def _parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="toy,smollm2")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=32, help="toy responses (its context is 64 tokens)")
    ap.add_argument("--smollm2-prompts", type=int, default=8)
    ap.add_argument("--smollm2-group", type=int, default=4)
    ap.add_argument("--smollm2-max-new", type=int, default=96)
    ap.add_argument("--data", default=str(REPO.parent / "shared" / "data" / "math" / "gsm8k_test.jsonl"))
    ap.add_argument("--top-p", type=float, default=0.1, help="STARE's P for the high-surprisal set")
    ap.add_argument("--json", default="", help="also write the rows to this file")
    return ap.parse_args(argv)


def _toy():
    """(model folder, prompts as text, answers) of the default demo's toy."""
    cfg = load_config(REPO / "configs" / "tiny_cpu_stare.yaml", [])
    assets = prepare(asset_config(cfg.toy), REPO / cfg.toy.cache_dir, log=lambda *_: None)
    rows = [json.loads(line) for line in assets.train_path.read_text().splitlines()]
    return assets.model_dir, [r["problem"] for r in rows], [r["answer"] for r in rows]


def _smollm2(data: str):
    from stare_jax.models.gguf_convert import ensure_smollm2_hf

    folder = ensure_smollm2_hf(str(REPO / ".cache" / "smollm2-135m-instruct-hf"))
    rows = [json.loads(line) for line in pathlib.Path(data).read_text().splitlines()]
    return folder, [r["problem"] + "\nAnswer:" for r in rows], [r["answer"] for r in rows]


def _zero_reward():
    """The responses' scores do not matter here (a reward function that scores every response 0)."""
    return RewardFn(score=lambda text, answer: 0.0)


def measure(folder, texts, *, prompts, group, max_new, top_p, dtype) -> dict:
    """One row: sample with a `dtype` sampler, recompute with the fp32 trainer pass, the diagnostics."""
    model = models.from_pretrained(folder)
    tok = load_tokenizer(folder)
    ids = [tok.encode(t) for t in texts[:prompts]]
    prompt_len = max(16, 1 << (max(len(p) for p in ids) - 1).bit_length())
    sampler = Sampler(model, cache_dtype=dtype, compute_dtype=dtype, pad_id=tok.pad_id)
    t0 = time.time()
    r, _, _ = generate_rollouts(
        sampler,
        ids,
        ["0"] * len(ids),
        tokenizer=tok,
        reward_fn=_zero_reward(),
        prompt_len=prompt_len,
        max_new_tokens=max_new,
        num_samples=group,
        sampling=SamplingParams(temperature=1.0, top_p=1.0, top_k=0, seed=0),
    )
    sample_s = time.time() - t0
    batch = train_batch_from_rollouts(r, np.zeros(r.correct_PxG.shape, np.float32))
    # advantages of both signs (half of each group correct) so that both high-surprisal sets exist
    adv = np.tile(np.where(np.arange(group) % 2 == 0, 1.0, -1.0), len(ids)).astype(np.float32)
    input_ids, attn, tgt, lm, _ = shift_batch(batch)
    graphdef, params, rest = split_model(model)
    trainer, _ = policy_forward(graphdef, params, rest, input_ids, attn, tgt, lm, chunk_size=256)
    trainer, lm = np.asarray(trainer) * np.asarray(lm), np.asarray(lm)
    rollout = batch["rollout_logprobs_BxT"][:, 1:]
    opts = dict(variant="C2", w=2.0, m=0.5, top_p=top_p, gate_on=True)
    high = np.asarray(token_weights(trainer, adv, lm, **opts)) != 1.0
    high_rollout = np.asarray(token_weights(rollout, adv, lm, **opts)) != 1.0
    diagnostics = offpolicy_metrics(trainer, rollout, lm, {"high_surprisal": high, "rest": ~high})
    m = {k: float(v) for k, v in diagnostics.items()}
    m["selection_differs"] = float((high ^ high_rollout).sum() / max(high.sum(), 1))
    m["tokens"] = int(lm.sum())
    m["sample_s"] = sample_s
    return m


def main(argv=None):
    args = _parse(argv)
    rows = []
    for name in [m for m in args.models.split(",") if m]:
        if name == "toy":
            folder, texts, _ = _toy()
            size = dict(prompts=args.prompts, group=args.group, max_new=args.max_new)
        elif name == "smollm2":
            folder, texts, _ = _smollm2(args.data)
            size = dict(prompts=args.smollm2_prompts, group=args.smollm2_group, max_new=args.smollm2_max_new)
        else:
            raise SystemExit(f"--models: unknown model {name!r} (toy, smollm2)")
        for dtype in ("float32", "bfloat16"):
            m = measure(folder, texts, top_p=args.top_p, dtype=dtype, **size)
            rows.append({"model": name, "sampler": dtype, "trainer": "float32", **m})
            print(f"{name}: {dtype} sampler, {m['tokens']} response tokens, {m['sample_s']:.1f}s to sample", flush=True)
    header = "| model | sampler/trainer | set | k1 KL | k3 KL | chi2 token | chi2 seq | max abs log-ratio |"
    print("\n" + header + "\n|" + "---|" * 8)
    for row in rows:
        for sub in SUBSETS:
            name = sub.rstrip("_") or "all"
            vals = [row.get(sub + c) for c in COLUMNS]
            cells = " | ".join("" if v is None else f"{v:.3g}" for v in vals)
            short = {"float32": "fp32", "bfloat16": "bf16"}[row["sampler"]]
            print(f"| {row['model']} | {short}/fp32 | {name} | {cells} |")
    print("\nSTARE's selection with the sampler's log-probs vs the trainer's (|A xor B| / |A|):")
    for row in rows:
        print(f"  {row['model']} {row['sampler']}: {row['selection_differs']:.3f}")
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
