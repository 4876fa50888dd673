"""Rollouts: sample G responses per prompt with the sampler's array API, decode them and score them.

Shared by the RL loop (train.py) and evaluation (eval/runner.py). Verification of model output is the RewardFn of
stare_jax.rewards (re-exported here): toy tasks are pure string checks in-process; math answers go through the
sandboxed RewardPool (model output is untrusted)."""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from stare_jax import distributed
from stare_jax.rewards.reward_fn import RewardFn

__all__ = ["REWARD_COUNTERS", "RewardFn", "Rollouts", "add_counts", "generate_rollouts", "left_pad"]


def left_pad(prompts: Sequence[Sequence[int]], length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.full((len(prompts), length), pad_id, np.int32)
    mask = np.zeros((len(prompts), length), np.int32)
    for r, p in enumerate(prompts):
        ids[r, length - len(p):] = p
        mask[r, length - len(p):] = 1
    return ids, mask


@dataclasses.dataclass
class Rollouts:
    """One generation batch, prompt-major: arrays with leading prompt axis P (and group axis G)."""

    prompt_ids_PxT: np.ndarray
    prompt_mask_PxT: np.ndarray
    tokens_PxGxN: np.ndarray
    lengths_PxG: np.ndarray
    correct_PxG: np.ndarray


REWARD_COUNTERS = ("n_items", "n_ok", "n_correct", "n_timeout", "n_crash", "n_error", "n_restarts")


def add_counts(total: dict, stats: dict) -> dict:
    """Adds the numeric n_* counters of reward stats (timeouts, crashes, ... of the sandboxed pool) into total."""
    for k, v in stats.items():
        if k.startswith("n_") and isinstance(v, (int, float)):
            total[k] = total.get(k, 0) + v
    return total


def generate_rollouts(sampler, prompts: Sequence[Sequence[int]], answers: Sequence[str], *, tokenizer,
                      reward_fn: RewardFn, prompt_len: int, max_new_tokens: int, num_samples: int,
                      temperature: float, top_p: float, top_k: int, seed: int, index_offset: int = 0,
                      max_prompts_per_call: int = 0):
    """Sample num_samples responses per prompt and score them; returns (Rollouts, texts, reward stats).

    max_prompts_per_call > 0 splits the prompts into sampler calls of at most that many prompts (bounding the KV
    cache); every prompt's randomness is keyed by its index (index_offset + position), so each prompt's samples
    use the same random draws as in one call.

    Multi-process: every process passes the same global prompts; the sampler shards the batch over the devices
    of all processes, the tokens come back to every host, each process decodes and scores its own share of the
    responses (texts holds that share only), and the scores and reward-pool counters are gathered, so the
    returned Rollouts and stats are the global ones, equal on every process and to a single-process run."""
    step = max_prompts_per_call if max_prompts_per_call > 0 else max(len(prompts), 1)
    parts = [_generate_call(sampler, prompts[i:i + step], answers[i:i + step], tokenizer=tokenizer,
                            reward_fn=reward_fn, prompt_len=prompt_len, max_new_tokens=max_new_tokens,
                            num_samples=num_samples, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                            index_offset=index_offset + i)
             for i in range(0, len(prompts), step)]
    if len(parts) == 1:
        return parts[0]
    fields = [f.name for f in dataclasses.fields(Rollouts)]
    merged = Rollouts(**{f: np.concatenate([getattr(r, f) for r, _, _ in parts]) for f in fields})
    stats = {}
    for _, _, st in parts:
        add_counts(stats, st)
    return merged, [t for _, texts, _ in parts for t in texts], stats


def _generate_call(sampler, prompts, answers, *, tokenizer, reward_fn: RewardFn, prompt_len: int,
                   max_new_tokens: int, num_samples: int, temperature: float, top_p: float, top_k: int, seed: int,
                   index_offset: int):
    """One sampler call of generate_rollouts."""
    P = len(prompts)
    P_pad = sampler.batch_bucket(P)
    ids, mask = left_pad(list(prompts) + [[tokenizer.bos_id if tokenizer.bos_id is not None else 0]] * (P_pad - P),
                         prompt_len, sampler.pad_id)
    active = np.arange(P_pad) < P
    out = sampler.generate_arrays(ids, mask, max_new_tokens=max_new_tokens, num_samples=num_samples,
                                  temperature=temperature, top_p=top_p, top_k=top_k, eos_ids=tokenizer.eos_ids,
                                  seed=seed, prompt_index_P=np.arange(P_pad, dtype=np.int32) + index_offset,
                                  active_P=active)
    # the sampler's log-probs are not fetched: the train step recomputes them (old log-probs) in its own layout
    tokens, lengths = distributed.fetch_global((out.tokens_BxN, out.lengths_B))
    G, N = num_samples, tokens.shape[1]
    tokens = tokens[: P * G].reshape(P, G, N)
    lengths = lengths[: P * G].reshape(P, G)
    lo, hi = distributed.process_share(P * G)  # the responses this process decodes and scores
    texts = [tokenizer.decode(tokens[b // G, b % G, : lengths[b // G, b % G]].tolist()) for b in range(lo, hi)]
    correct_share, stats = reward_fn(texts, [answers[b // G] for b in range(lo, hi)])
    correct = distributed.gather_shares(np.asarray(correct_share, np.float32), P * G)
    if reward_fn.task == "math":
        stats = {**stats, **distributed.sum_across_processes(stats, REWARD_COUNTERS)}
    return Rollouts(ids[:P], mask[:P], tokens, lengths, correct.reshape(P, G)), texts, stats
