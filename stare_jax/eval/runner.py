"""Evaluation runs: avg@N / pass@k / mean response length per benchmark, for `stare-jax eval` and for the periodic
evaluation inside training (the same code path).

With a ToolConfig whose `enabled` is set (and its SandboxPool), the responses are multi-turn tool rollouts
(collect.generate_tool_rollouts, the RL collection's own path): the text after the last observation is scored and
the tool counts are summed into the results' "tool" entry.

Benchmarks that share sampling settings (samples per problem, temperature, top-p) are generated together, in prompt
chunks of `batch_prompts`, so a large evaluation keeps the sampler's batch full instead of running one small
benchmark at a time.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from typing import Callable, Sequence

import numpy as np

from stare_jax.eval.benchmarks import benchmark_metrics
from stare_jax.rewards.reward_fn import RewardFn
from stare_jax.sampling import SamplingParams
from stare_jax.tools.config import ToolConfig
from stare_jax.tools.pool import SandboxPool
from stare_jax.tools.rollout import tool_metrics
from stare_jax.training.collect import generate_any_rollouts


@dataclasses.dataclass
class EvalSet:
    """One benchmark, tokenized: prompts, reference answers and its protocol."""

    name: str
    prompts: list[list[int]]
    answers: list[str]
    num_samples: int
    temperature: float = 0.7
    top_p: float = 0.95


def evaluate_sets(
    sampler,
    eval_sets: Sequence[EvalSet],
    *,
    tokenizer,
    reward_fn: RewardFn,
    prompt_len: int,
    max_new_tokens: int,
    seed: int,
    ks: Sequence[int] = (1,),
    batch_prompts: int = 256,
    tool: ToolConfig | None = None,
    tool_pool: SandboxPool | None = None,
    progress: Callable[[str, int, int, int], None] | None = None,
) -> dict:
    """{benchmark: benchmark_metrics(...)} (avg@N, pass@k for k in ks that fit N, mean_response_len); with tool
    rollouts also {"tool": tool_counts summed over every benchmark}. progress(benchmark, samples done, samples in
    all, response tokens just generated) is called for each benchmark of a prompt chunk once the chunk is scored
    (EvalProgress prints it)."""
    tool_totals: dict = {}
    correct: dict[str, list[np.ndarray]] = {es.name: [] for es in eval_sets}
    lengths: dict[str, list[np.ndarray]] = {es.name: [] for es in eval_sets}
    totals = {es.name: len(es.prompts) for es in eval_sets}
    key = lambda es: (es.num_samples, es.temperature, es.top_p)  # noqa: E731
    for (n, temp, top_p), group in itertools.groupby(sorted(eval_sets, key=key), key=key):
        items = [(es.name, p, a) for es in group for p, a in zip(es.prompts, es.answers)]
        draws = SamplingParams(temperature=temp, top_p=top_p, top_k=0, seed=seed)  # the benchmarks' protocol
        for start in range(0, len(items), batch_prompts):
            chunk = items[start : start + batch_prompts]
            prompts, answers = [p for _, p, _ in chunk], [a for _, _, a in chunk]
            r, _, model_lengths = generate_any_rollouts(
                sampler,
                prompts,
                answers,
                tokenizer=tokenizer,
                reward_fn=reward_fn,
                prompt_len=prompt_len,
                max_new_tokens=max_new_tokens,
                num_samples=n,
                sampling=draws,
                index_offset=start,
                tool=tool,
                tool_pool=tool_pool,
                tool_totals=tool_totals,
            )
            lengths_PxG = model_lengths.reshape(len(chunk), n)
            tokens: dict[str, int] = {}
            for i, (name, _, _) in enumerate(chunk):
                correct[name].append(r.correct_PxG[i])
                lengths[name].append(lengths_PxG[i])
                tokens[name] = tokens.get(name, 0) + int(lengths_PxG[i].sum())
            if progress is not None:
                for name, new_tokens in tokens.items():
                    progress(name, len(correct[name]) * n, totals[name] * n, new_tokens)
    out: dict = {
        es.name: benchmark_metrics(
            np.stack(correct[es.name]), np.stack(lengths[es.name]), ks=[k for k in ks if k <= es.num_samples]
        )
        for es in eval_sets
    }
    if tool is not None and tool.enabled:
        out["tool"] = tool_totals
    return out


class EvalProgress:
    """evaluate_sets' `progress`: one line per benchmark as its samples finish, `PREFIX math500: 96/2000 samples,
    1234 tokens/s, 35s`, for a benchmark at most every `every_s` seconds (and always when it is done). tokens/s is
    the evaluation's generation rate so far: every benchmark's response tokens over the time since this object was
    made (the compiles included); the elapsed time is counted from then too."""

    def __init__(
        self,
        write: Callable[[str], None],
        *,
        prefix: str = "eval",
        every_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.write, self.prefix, self.every_s, self.clock = write, prefix, every_s, clock
        self.t0 = clock()
        self.tokens = 0
        self._last: dict[str, float] = {}

    def __call__(self, name: str, done: int, total: int, new_tokens: int) -> None:
        now = self.clock()
        self.tokens += new_tokens
        if done < total and now - self._last.get(name, -math.inf) < self.every_s:
            return
        self._last[name] = now
        elapsed = now - self.t0
        rate = self.tokens / elapsed if elapsed > 0 else 0.0
        self.write(f"{self.prefix} {name}: {done}/{total} samples, {rate:.0f} tokens/s, {elapsed:.0f}s")


def evaluate(
    sampler,
    eval_sets: Sequence[EvalSet],
    *,
    tokenizer,
    reward_fn: RewardFn,
    prompt_len: int,
    max_new_tokens: int,
    seed: int,
    batch_prompts: int = 256,
    tool: ToolConfig | None = None,
    tool_pool: SandboxPool | None = None,
) -> dict:
    """Flat metrics for the training log: eval/<name>/accuracy (avg@N), eval/<name>/response_len_mean and their
    mean over benchmarks as eval/accuracy; with tool rollouts also eval/tool/* (tool_metrics over every
    benchmark)."""
    results = evaluate_sets(
        sampler,
        eval_sets,
        tokenizer=tokenizer,
        reward_fn=reward_fn,
        prompt_len=prompt_len,
        max_new_tokens=max_new_tokens,
        seed=seed,
        batch_prompts=batch_prompts,
        tool=tool,
        tool_pool=tool_pool,
    )
    tool_counts = results.pop("tool", None)
    out = {f"eval/{k}": v for k, v in tool_metrics(tool_counts).items()} if tool_counts else {}
    for name, m in results.items():
        out[f"eval/{name}/accuracy"] = m[f"avg@{m['n_samples']}"]
        out[f"eval/{name}/response_len_mean"] = m["mean_response_len"]
    out["eval/accuracy"] = float(np.mean([out[f"eval/{name}/accuracy"] for name in results]))
    return out
