"""Rollouts: sample G responses per prompt with the sampler's array API, decode them and score them; and the RL
loop's first stage, `collect_batch`: sample -> score -> dynamic sampling -> rewards -> advantages -> train batch.

generate_rollouts is shared by the RL loop (training/loop.py) and evaluation (eval/runner.py). Verification of model
output is the RewardFn of stare_jax.rewards (re-exported here; `reward_fn_for(task)` picks it for a run's
data.task): toy tasks are pure string checks in-process; math answers go through the sandboxed RewardPool (model
output is untrusted)."""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Iterator, Sequence

import jax.numpy as jnp
import numpy as np

from stare_jax import distributed
from stare_jax.config.loader import RLConfig, SamplingConfig
from stare_jax.rewards import rollout_rewards
from stare_jax.rewards.reward_fn import RewardFn
from stare_jax.rl.advantages import DynamicSamplingAccumulator, dynamic_sampling_keep_mask, outcome_advantages
from stare_jax.rl.packing import PADDED_ROLLOUT_LOGPROBS_KEY
from stare_jax.sampling import SamplingParams
from stare_jax.tasks import get_task
from stare_jax.tools.config import ToolConfig
from stare_jax.tools.pool import SandboxPool
from stare_jax.tools.rollout import (
    final_text,
    observation_wrapper,
    rows_to_arrays,
    tool_counts,
    tool_metrics,
    tool_reward_shaping,
    tool_rollouts,
)

__all__ = [
    "REWARD_COUNTERS",
    "CollectedBatch",
    "RewardFn",
    "Rollouts",
    "add_counts",
    "batch_seed",
    "collect_batch",
    "generate_any_rollouts",
    "generate_rollouts",
    "generate_tool_rollouts",
    "left_pad",
    "reward_fn_for",
    "train_batch_from_rollouts",
]


def reward_fn_for(task: str, **pool_options) -> RewardFn:
    """The verifier of a run's data.task: "math" -> the sandboxed math verifier pool (pool_options: num_workers,
    timeout_s); a toy task (stare_jax.tasks) -> its in-process string check. A ValueError naming the accepted
    names for any other."""
    return RewardFn(**pool_options) if task == "math" else RewardFn(score=get_task(task).score)


def left_pad(prompts: Sequence[Sequence[int]], length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    ids = np.full((len(prompts), length), pad_id, np.int32)
    mask = np.zeros((len(prompts), length), np.int32)
    for r, p in enumerate(prompts):
        ids[r, length - len(p) :] = p
        mask[r, length - len(p) :] = 1
    return ids, mask


@dataclasses.dataclass
class Rollouts:
    """One generation batch, prompt-major: arrays with leading prompt axis P (and group axis G).

    Multi-turn tool rollouts also set model_mask_PxGxN (1 sampled token, 0 tool observation: the loss mask; None =
    every response token was sampled) and reward_bonus_PxG (tool bonus / format penalty added to the reward).
    logprobs_PxGxN: the sampler's temperature-1 log-prob of each sampled token (0 after the end, NaN on tool
    observations; rl.rollout_correction's input), None when not kept."""

    prompt_ids_PxT: np.ndarray
    prompt_mask_PxT: np.ndarray
    tokens_PxGxN: np.ndarray
    lengths_PxG: np.ndarray
    correct_PxG: np.ndarray
    model_mask_PxGxN: np.ndarray | None = None
    reward_bonus_PxG: np.ndarray | None = None
    logprobs_PxGxN: np.ndarray | None = None


REWARD_COUNTERS = ("n_items", "n_ok", "n_correct", "n_timeout", "n_crash", "n_error", "n_restarts")


def add_counts_all(total: dict, counts: dict) -> dict:
    """Adds every numeric counter of `counts` into total (the tool counts)."""
    for k, v in counts.items():
        total[k] = total.get(k, 0) + v
    return total


def add_counts(total: dict, stats: dict) -> dict:
    """Adds the numeric n_* counters of reward stats (timeouts, crashes, ... of the sandboxed pool) into total."""
    for k, v in stats.items():
        if k.startswith("n_") and isinstance(v, (int, float)):
            total[k] = total.get(k, 0) + v
    return total


def generate_rollouts(
    sampler,
    prompts: Sequence[Sequence[int]],
    answers: Sequence[str],
    *,
    tokenizer,
    reward_fn: RewardFn,
    prompt_len: int,
    max_new_tokens: int,
    num_samples: int,
    sampling: SamplingParams,
    index_offset: int = 0,
    max_prompts_per_call: int = 0,
):
    """Sample num_samples responses per prompt and score them; returns (Rollouts, texts, reward stats).

    sampling: the draw options; a response stops on the tokenizer's EOS ids (they replace sampling.eos_ids).

    max_prompts_per_call > 0 splits the prompts into sampler calls of at most that many prompts (bounding the KV
    cache); every prompt's randomness is keyed by its index (index_offset + position), so each prompt's samples
    use the same random draws as in one call.

    Multi-process: every process passes the same global prompts; the sampler shards the batch over the devices
    of all processes, the tokens come back to every host, each process decodes and scores its own share of the
    responses (texts holds that share only), and the scores and reward-pool counters are gathered, so the
    returned Rollouts and stats are the global ones, equal on every process and to a single-process run."""
    step = max_prompts_per_call if max_prompts_per_call > 0 else max(len(prompts), 1)
    parts = [
        _generate_call(
            sampler,
            prompts[i : i + step],
            answers[i : i + step],
            tokenizer=tokenizer,
            reward_fn=reward_fn,
            prompt_len=prompt_len,
            max_new_tokens=max_new_tokens,
            num_samples=num_samples,
            sampling=sampling,
            index_offset=index_offset + i,
        )
        for i in range(0, len(prompts), step)
    ]
    if len(parts) == 1:
        return parts[0]
    fields = [f.name for f in dataclasses.fields(Rollouts) if getattr(parts[0][0], f.name) is not None]
    merged = Rollouts(**{f: np.concatenate([getattr(r, f) for r, _, _ in parts]) for f in fields})
    stats: dict = {}
    for _, _, st in parts:
        add_counts(stats, st)
    return merged, [t for _, texts, _ in parts for t in texts], stats


def _generate_call(
    sampler,
    prompts,
    answers,
    *,
    tokenizer,
    reward_fn: RewardFn,
    prompt_len: int,
    max_new_tokens: int,
    num_samples: int,
    sampling: SamplingParams,
    index_offset: int,
):
    """One sampler call of generate_rollouts."""
    P = len(prompts)
    P_pad = sampler.batch_bucket(P)
    ids, mask = left_pad(
        list(prompts) + [[tokenizer.bos_id if tokenizer.bos_id is not None else 0]] * (P_pad - P),
        prompt_len,
        sampler.pad_id,
    )
    active = np.arange(P_pad) < P
    out = sampler.generate_arrays(
        ids,
        mask,
        max_new_tokens=max_new_tokens,
        num_samples=num_samples,
        sampling=sampling.replace(eos_ids=tokenizer.eos_ids),
        prompt_index_P=np.arange(P_pad, dtype=np.int32) + index_offset,
        active_P=active,
    )
    # the sampler's log-probs come along for rl.rollout_correction (the step recomputes its own old log-probs)
    tokens, lengths, logprobs = distributed.fetch_global((out.tokens_BxN, out.lengths_B, out.logprobs_BxN))
    G, N = num_samples, tokens.shape[1]
    tokens = tokens[: P * G].reshape(P, G, N)
    logprobs = np.asarray(logprobs, np.float32)[: P * G].reshape(P, G, N)
    lengths = lengths[: P * G].reshape(P, G)
    lo, hi = distributed.process_share(P * G)  # the responses this process decodes and scores
    texts = [tokenizer.decode(tokens[b // G, b % G, : lengths[b // G, b % G]].tolist()) for b in range(lo, hi)]
    correct_share, stats = reward_fn(texts, [answers[b // G] for b in range(lo, hi)])
    correct = distributed.gather_shares(np.asarray(correct_share, np.float32), P * G)
    if reward_fn.is_math:
        stats = {**stats, **distributed.sum_across_processes(stats, REWARD_COUNTERS)}
    rollouts = Rollouts(ids[:P], mask[:P], tokens, lengths, correct.reshape(P, G), logprobs_PxGxN=logprobs)
    return rollouts, texts, stats


def generate_tool_rollouts(
    engine,
    prompts: Sequence[Sequence[int]],
    answers: Sequence[str],
    *,
    tokenizer,
    reward_fn: RewardFn,
    tool: ToolConfig,
    pool: SandboxPool,
    prompt_len: int,
    max_new_tokens: int,
    num_samples: int,
    sampling: SamplingParams,
    index_offset: int = 0,
):
    """generate_rollouts with the code interpreter (stare_jax.tools.rollout): G multi-turn responses per prompt,
    observations wrapped as the model's own chat template wraps a tool message (hermes), the text after each
    response's last observation scored by reward_fn. Returns (Rollouts with model_mask_PxGxN
    and reward_bonus_PxG, final texts, reward stats, tool counts (tool_counts), model-token lengths [P*G])."""
    P = len(prompts)
    rows = tool_rollouts(
        engine,
        prompts,
        group_size=num_samples,
        tool_cfg=tool,
        tokenizer=tokenizer,
        pool=pool,
        max_new_tokens=max_new_tokens,
        sampling=sampling,
        prompt_index=[index_offset + i for i in range(P)],
        wrapper=observation_wrapper(tokenizer, tool.format),
    )
    texts = [final_text(tokenizer, r) for r in rows]
    lo, hi = distributed.process_share(len(rows))  # as _generate_call: each process scores its share
    scores, stats = reward_fn(texts[lo:hi], [answers[r.prompt_pos] for r in rows[lo:hi]])
    correct = [float(x) for x in distributed.gather_shares(np.asarray(scores, np.float32), len(rows))]
    if reward_fn.is_math:
        stats = {**stats, **distributed.sum_across_processes(stats, REWARD_COUNTERS)}
    arr = rows_to_arrays(rows, P, num_samples, max_new_tokens, engine.pad_id)
    bonus = tool_reward_shaping(rows, correct, tool_bonus=tool.tool_bonus, format_penalty=tool.format_penalty)
    ids, mask = left_pad(prompts, prompt_len, engine.pad_id)
    r = Rollouts(
        ids,
        mask,
        arr["tokens_PxGxN"],
        arr["lengths_PxG"],
        np.asarray(correct, np.float32).reshape(P, num_samples),
        arr["model_mask_PxGxN"],
        bonus.reshape(P, num_samples),
        arr["logprobs_PxGxN"],
    )
    return r, texts, stats, tool_counts(rows, correct), arr["model_lengths_PxG"].reshape(-1)


def generate_any_rollouts(
    sampler,
    prompts: Sequence[Sequence[int]],
    answers: Sequence[str],
    *,
    tokenizer,
    reward_fn: RewardFn,
    prompt_len: int,
    max_new_tokens: int,
    num_samples: int,
    sampling: SamplingParams,
    index_offset: int = 0,
    tool: ToolConfig | None,
    tool_pool: SandboxPool | None,
    tool_totals: dict,
    max_prompts_per_call: int = 0,
):
    """The rollouts of the training collect and of the evaluation: generate_tool_rollouts when tool.enabled (its
    counts summed into tool_totals; sampler: a rollout Engine, tool_pool: the sandbox), else generate_rollouts.
    Returns (Rollouts, reward stats, lengths [P*G] that count the model's tokens only)."""
    common = dict(
        tokenizer=tokenizer,
        reward_fn=reward_fn,
        prompt_len=prompt_len,
        max_new_tokens=max_new_tokens,
        num_samples=num_samples,
        sampling=sampling,
        index_offset=index_offset,
    )
    if tool is not None and tool.enabled:
        if tool_pool is None:
            raise ValueError("tool.enabled needs a tool_pool (stare_jax.tools.make_pool)")
        r, _, stats, counts, model_lengths = generate_tool_rollouts(
            sampler, prompts, answers, tool=tool, pool=tool_pool, **common
        )
        add_counts_all(tool_totals, counts)
        return r, stats, model_lengths
    r, _, stats = generate_rollouts(sampler, prompts, answers, max_prompts_per_call=max_prompts_per_call, **common)
    return r, stats, r.lengths_PxG.reshape(-1)


# ----------------------------------------------------------------------------------------------------------------
# The RL loop's collection stage


def batch_seed(seed: int, step: int, j: int) -> int:
    """The sampler seed of generation batch j of RL step `step` (randomness is a pure function of these)."""
    return (seed * 1_000_003 + step * 1_009 + j) % (2**31 - 1)


def train_batch_from_rollouts(r: Rollouts, advantages_PxG: np.ndarray) -> dict:
    """[P*G, T+N] prompt + response ids with attention/response masks, response-major within each prompt. Tool
    observation tokens (model_mask 0) are attended to but have response (loss) mask 0. With the sampler's
    log-probs (r.logprobs_PxGxN) also rollout_logprobs_BxT, aligned with the ids, 0 off the response mask."""
    P, G, N = r.tokens_PxGxN.shape
    T = r.prompt_ids_PxT.shape[1]
    span = (np.arange(N)[None, None, :] < r.lengths_PxG[..., None]).astype(np.int32)
    resp_mask = span if r.model_mask_PxGxN is None else span * r.model_mask_PxGxN.astype(np.int32)
    ids = np.concatenate([np.repeat(r.prompt_ids_PxT[:, None], G, 1), r.tokens_PxGxN], axis=2)
    attn = np.concatenate([np.repeat(r.prompt_mask_PxT[:, None], G, 1), span], axis=2)
    resp = np.concatenate([np.zeros((P, G, T), np.int32), resp_mask], axis=2)
    ids = np.where(attn > 0, ids, 0)
    batch = {
        "input_ids_BxT": ids.reshape(P * G, T + N),
        "attention_mask_BxT": attn.reshape(P * G, T + N),
        "response_mask_BxT": resp.reshape(P * G, T + N),
        "advantages_B": advantages_PxG.reshape(P * G).astype(np.float32),
    }
    if r.logprobs_PxGxN is not None:
        lp = np.where(resp_mask > 0, np.nan_to_num(np.asarray(r.logprobs_PxGxN, np.float32)), 0.0)
        full = np.concatenate([np.zeros((P, G, T), np.float32), lp.astype(np.float32)], axis=2)
        batch[PADDED_ROLLOUT_LOGPROBS_KEY] = full.reshape(P * G, T + N)
    return batch


@dataclasses.dataclass
class CollectedBatch:
    """One RL step's training data and what collecting it saw."""

    batch: dict  # the train step's host batch (train_batch_from_rollouts of `kept`)
    kept: Rollouts  # exactly rl.train_batch_size prompt groups
    rewards_PxG: np.ndarray  # of the kept groups
    correct_all: np.ndarray  # every generated response, kept or not (flat)
    lengths_all: np.ndarray
    reward_stats: dict  # summed n_* counters of the reward pool
    num_groups_kept: int  # groups that passed dynamic sampling (>= the kept train_batch_size)
    num_prompts_seen: int
    num_gen_batches: int
    gen_time_s: float
    tool_counts: dict = dataclasses.field(default_factory=dict)  # summed tool_counts (tool rollouts only)

    def metrics(self) -> dict:
        """The step record's entries that describe generation and scoring (response lengths count the model's
        tokens only; tool rollouts add the tool/* entries)."""
        tool = tool_metrics(self.tool_counts) if self.tool_counts else {}
        return {
            **tool,
            "reward_mean": float(self.rewards_PxG.mean()),
            "accuracy": float(self.correct_all.mean()),
            "train_accuracy": float(self.kept.correct_PxG.mean()),
            "response_len_mean": float(self.lengths_all.mean()),
            "kept_groups_frac": self.num_groups_kept / max(self.num_prompts_seen, 1),
            "num_gen_batches": self.num_gen_batches,
            **{f"reward/{k}": v for k, v in self.reward_stats.items()},
            "gen_time_s": self.gen_time_s,
        }


def collect_batch(
    sampler,
    prompt_batches: Iterator[list],
    prompt_ids: Callable[[object], Sequence[int]],
    *,
    rl: RLConfig,
    sampling: SamplingConfig,
    tokenizer,
    reward_fn: RewardFn,
    prompt_len: int,
    seed: int,
    step: int,
    tool: ToolConfig | None = None,
    tool_pool: SandboxPool | None = None,
) -> CollectedBatch:
    """Algorithm 1's data half: generate G responses for each prompt of successive generation batches (rows
    from `prompt_batches`, token ids by `prompt_ids(row)`), score them, keep the groups whose rewards vary
    (dynamic sampling, when rl.dynamic_sampling) until rl.train_batch_size groups are kept (at most
    rl.max_num_gen_batches batches), shape the rewards and compute GRPO advantages, and lay out the train batch.
    With tool.enabled (sampler: a rollout Engine, tool_pool: the sandbox) the responses are multi-turn tool
    rollouts (generate_tool_rollouts): observation tokens get loss mask 0 and the tool bonus / format penalty
    is added to the shaped reward."""
    t0 = time.time()
    acc = DynamicSamplingAccumulator(rl.train_batch_size, rl.max_num_gen_batches if rl.dynamic_sampling else 1)
    correct: list[np.ndarray] = []
    lengths: list[np.ndarray] = []
    reward_stats: dict = {}
    tool_totals: dict = {}
    j = 0
    while not acc.ready:
        rows = next(prompt_batches)
        draws = SamplingParams(
            temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k, seed=batch_seed(seed, step, j)
        )
        prompts, answers = [prompt_ids(x) for x in rows], [x.answer for x in rows]
        r, stats, model_lengths = generate_any_rollouts(
            sampler,
            prompts,
            answers,
            tokenizer=tokenizer,
            reward_fn=reward_fn,
            prompt_len=prompt_len,
            max_new_tokens=sampling.max_new_tokens,
            num_samples=rl.group_size,
            sampling=draws,
            index_offset=j * rl.gen_batch_size,
            tool=tool,
            tool_pool=tool_pool,
            tool_totals=tool_totals,
            max_prompts_per_call=sampling.max_prompts_per_call,
        )
        lengths.append(model_lengths)
        correct.append(r.correct_PxG.reshape(-1))
        add_counts(reward_stats, stats)
        keep = (
            np.asarray(dynamic_sampling_keep_mask(r.correct_PxG))
            if rl.dynamic_sampling
            else np.ones(r.correct_PxG.shape[0], bool)
        )
        acc.add(dataclasses.asdict(r), keep)
        j += 1
    kept = Rollouts(**acc.result())
    rewards = rollout_rewards(
        kept.correct_PxG,
        kept.lengths_PxG,
        mode=rl.reward,
        max_length=sampling.max_new_tokens,
        overlong_buffer=rl.overlong_buffer,
        overlong_penalty_factor=rl.overlong_penalty,
    )
    # (tool rollouts: lengths and the overlong buffer count every response token, observations included, as the
    # budget sampling.max_new_tokens does)
    if kept.reward_bonus_PxG is not None:
        rewards = np.asarray(rewards, np.float32) + kept.reward_bonus_PxG
    adv = np.asarray(
        outcome_advantages(
            jnp.asarray(rewards),
            kept.correct_PxG,
            estimator=rl.advantage.estimator,
            norm_by_std=rl.norm_adv_by_std,
            w_reinforce_lambda=rl.advantage.w_reinforce_lambda,
        )
    )
    batch = train_batch_from_rollouts(kept, adv)
    batch["rewards_B"] = np.asarray(rewards).reshape(-1).astype(np.float32)  # the step's KL-in-reward advantage
    return CollectedBatch(
        batch,
        kept,
        rewards,
        np.concatenate(correct),
        np.concatenate(lengths),
        reward_stats,
        acc.num_kept,
        acc.num_prompts_seen,
        j,
        time.time() - t0,
        tool_totals,
    )
