"""Multi-turn tool-use rollouts: sample, run the model's code in the sandbox, append the output, continue.

For each of the G samples of each prompt the rollout engine samples until the model closes a tool call (the
closing tag's token is a stop token) or ends its answer (an EOS id). The loop is event-driven: the engine runs one
scheduler round at a time (`Engine.advance`: admit, prefill, decode a chunk), and each row whose turn ended in that
round is handled at once - its call parsed (calls.parse_call) and a good call's code submitted to the SandboxPool
- while the engine goes on decoding the other rows (the waiting row gives its decode slot back and keeps its KV
pages). When a call's future completes, its rendered observation (calls.observation, tokenized with the model's
own tokenizer) is appended to that row with `Engine.extend(..., wait=False)` (only the appended tokens are
prefilled; the turn gets what is left of the row's token budget) and the row rejoins decoding at the next round.
A refused call, or a stop token that closed no call, is answered in the same way without the sandbox. With no row
left to decode and calls in flight, the loop blocks on the first call to finish (concurrent.futures.wait), never
spins. So a row that stops early does not idle until the slowest row of its turn, and sandbox time overlaps decode
time. The tokens do not depend on the order the calls finish in (every draw is keyed by seed, prompt, sample and
response position): `overlap=False`, the lock-step loop (a turn's calls are submitted once every row's turn
ended, awaited together, and every observation appended together), gives the same rows. A response ends on EOS or
at its budget; a call past `tool.max_turns` (like any malformed call) is not run but answered with an observation saying
so, and counted. Budget: `max_new_tokens` counts every response token, the model's
and the observations'. An observation that does not leave room for one more sampled token ends the response inside
it (cut at the budget, `end == "budget"`, counted).

Output per row (ToolRow): the response tokens in order, model_mask (1 sampled, 0 observation: the loss mask),
log-probs (NaN on observations), the calls' statuses, turns and the text after the last observation (what the
verifier scores). `tool_counts` / `tool_metrics` sum and rate them for the step record; `tool_reward_shaping` is the
optional ReTool-style bonus and format penalty.

Stop tokens: a closing tag that the tokenizer encodes as one token (Qwen2.5's </tool_call>; the tiny test
tokenizers) stops exactly there. A closing tag of several tokens (SmolLM2 splits </tool_call> into `</ tool _ call
>`) stops on its last token (`>`); a row that stopped there without a complete call continues sampling (an extend
with nothing appended). That holds while the model writes the tag's last token on its own: a merged token (say
`>\n`) is not a stop, and the call is then not seen.

Multi-process runs: every process runs the same rollout on the same host data (the engine's scheduler is
replicated), lock-step (which call finishes first differs between hosts, so the event-driven order would diverge):
a turn's sandbox calls run on process 0 only and their results are broadcast to the others
(`run_on_process0`), so every process appends the same observation tokens.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from stare_jax import distributed
from stare_jax.sampling.params import SamplingParams
from stare_jax.tools.calls import (
    CallFormat,
    CallStatus,
    ObservationFormat,
    ToolCall,
    ends_inside_call,
    observation,
    observation_format_from_template,
    parse_call,
    result_status,
    status_counts,
    stop_strings,
)
from stare_jax.tools.config import ToolConfig
from stare_jax.tools.pool import SandboxPool
from stare_jax.tools.sandbox import ExecResult

if TYPE_CHECKING:
    from stare_jax.sampling.engine import Conversation

__all__ = [
    "MALFORMED",
    "ToolRow",
    "call_stop_ids",
    "final_text",
    "observation_wrapper",
    "rows_to_arrays",
    "run_on_process0",
    "tool_counts",
    "tool_metrics",
    "tool_reward_shaping",
    "tool_rollouts",
]

MALFORMED = (
    CallStatus.INVALID_JSON,
    CallStatus.UNKNOWN_TOOL,
    CallStatus.BAD_ARGUMENTS,
    CallStatus.EMPTY_CODE,
    CallStatus.MAX_TURNS,
)


@dataclasses.dataclass
class ToolRow:
    """One multi-turn response (sample `sample` of the call's prompt `prompt_pos`).

    tokens: every response token in order (sampled and observation). model_mask: 1 sampled, 0 observation.
    logprobs: the sampler's temperature-1 log-probs, NaN on observation tokens. statuses: one per call the model
    closed (parse refusals and run outcomes). turns: sampled turns. final_start: response index where the text after
    the last observation starts. end: "eos" (the model ended its answer), "length" (the budget ran out while
    sampling) or "budget" (the budget ran out inside an observation, which was cut)."""

    prompt_pos: int
    sample: int
    tokens: list[int]
    model_mask: list[int]
    logprobs: list[float]
    statuses: list[CallStatus]
    turns: int
    final_start: int
    end: str

    @property
    def model_tokens(self) -> int:
        return int(sum(self.model_mask))

    @property
    def observation_tokens(self) -> int:
        return len(self.tokens) - self.model_tokens

    @property
    def used_tool(self) -> bool:
        """At least one call whose code ran."""
        return any(s.ran for s in self.statuses)


@dataclasses.dataclass
class _RowState:
    statuses: list[CallStatus] = dataclasses.field(default_factory=list)
    turns: int = 0
    seg_start: int = 0  # response index after the last observation
    lead: str = ""  # text before the first segment: a prompt that ends inside a call the model is to finish
    cut: list[int] = dataclasses.field(default_factory=list)  # observation tokens kept past the budget's end
    end: str = ""


def call_stop_ids(tokenizer, fmt: CallFormat) -> tuple[int, ...]:
    """The token ids a turn stops on for a tool call: the last token of each closing tag's encoding."""
    ids = []
    for s in stop_strings(fmt):
        enc = tokenizer.encode(s, add_bos=False)
        if not enc:
            raise ValueError(f"the tokenizer encodes the tool-call stop string {s!r} to no tokens")
        ids.append(int(enc[-1]))
    return tuple(dict.fromkeys(ids))


def observation_wrapper(tokenizer, fmt: CallFormat) -> ObservationFormat | None:
    """hermes: the wrapper the model's own chat template puts around a tool message; None (the format's default,
    Qwen2.5's tool turn) when the tokenizer has no template or its template cannot render a tool turn after an
    assistant turn. retool: None (its own <interpreter> tags)."""
    if fmt != "hermes" or not getattr(tokenizer, "chat_template", None):
        return None
    try:
        return observation_format_from_template(lambda m, g: tokenizer.apply_chat_template(m, g))
    except (ValueError, TypeError):  # the template's own errors (it may refuse a tool role)
        return None


def _turn_end(c: Conversation, end_ids: Sequence[int], call_ids: Sequence[int]) -> str:
    """How the turn just sampled ended: "eos", "call" (on a closing tag's stop token) or "length"."""
    last = c.turn_tokens[-1] if c.turn_tokens else None
    if c.finished_eos and last in end_ids:
        return "eos"
    if c.finished_eos and last in call_ids:
        return "call"
    return "length"


def _segment_text(tokenizer, c: Conversation, st: _RowState) -> str:
    """The model's text since the last observation (after the prompt's open call, if any), special tokens kept
    (the tags may be special tokens)."""
    return st.lead + tokenizer.decode(c.response_tokens[st.seg_start :], skip_special_tokens=False)


def _prompt_lead(tokenizer, prompt: Sequence[int], fmt: CallFormat) -> str:
    """The prompt's text when it ends inside an unclosed call (the model finishes that call), else ""."""
    text = tokenizer.decode(list(prompt), skip_special_tokens=False)
    return text if ends_inside_call(text, fmt) else ""


def _observation_ids(
    tokenizer, call: ToolCall, result: ExecResult | None, cfg: ToolConfig, wrapper: ObservationFormat | None
) -> list[int]:
    text = observation(call, result, cfg.format, wrapper=wrapper, timeout_s=cfg.timeout_s)
    return [int(t) for t in tokenizer.encode(text, add_bos=False)]


@dataclasses.dataclass(frozen=True)
class _Protocol:
    """What every row's turns share: how a turn ends, how a call is parsed and its observation rendered."""

    tokenizer: Any
    cfg: ToolConfig
    max_new_tokens: int
    end_ids: tuple[int, ...]
    call_ids: tuple[int, ...]
    wrapper: ObservationFormat | None

    def call_of_turn(self, c: Conversation, st: _RowState) -> tuple[bool, ToolCall | None]:
        """Count the turn that just ended; (False, None) when it ends the response (EOS, the budget), else (True,
        the parsed call: None for a stop token that closed no call, so sampling just goes on)."""
        st.turns += 1
        how = _turn_end(c, self.end_ids, self.call_ids)
        if how != "call" or c.step >= self.max_new_tokens:
            st.end = "eos" if how == "eos" else "length"
            return False, None
        return True, parse_call(
            _segment_text(self.tokenizer, c, st),
            self.cfg.format,
            calls_so_far=len(st.statuses),
            max_turns=self.cfg.max_turns,
        )

    def observe(
        self, c: Conversation, st: _RowState, call: ToolCall | None, result: ExecResult | None
    ) -> list[int] | None:
        """Record the call's outcome and render its observation: the tokens to append before the next turn, or
        None when the observation leaves no room for one more sampled token (the response ends cut inside it)."""
        obs: list[int] = []
        if call is not None:
            st.statuses.append(result_status(result) if result is not None else call.status)
            obs = _observation_ids(self.tokenizer, call, result, self.cfg, self.wrapper)
        room = self.max_new_tokens - c.step
        if len(obs) >= room:
            st.cut, st.end = obs[:room], "budget"
            return None
        if obs:
            st.seg_start, st.lead = c.step + len(obs), ""
        return obs


def tool_rollouts(
    engine,
    prompts: Sequence[Sequence[int]],
    *,
    group_size: int,
    tool_cfg: ToolConfig,
    tokenizer,
    pool: SandboxPool,
    max_new_tokens: int,
    sampling: SamplingParams = SamplingParams(),
    prompt_index: Sequence[int] | None = None,
    wrapper: ObservationFormat | None = None,
    overlap: bool = True,
) -> list[ToolRow]:
    """G multi-turn responses per prompt (prompt-major, row p * G + g) with the code interpreter (module doc).

    engine: a rollout Engine (start / advance / extend / close); max_new_tokens: the token budget of a whole
    response (sampled + observation tokens); sampling: the draw options, whose stop ids are replaced by the
    tokenizer's EOS ids and the call format's closing tags; prompt_index: the prompts' global indices (their draws),
    default 0..P-1; wrapper: the observation's wrapper (calls.observation_format_from_template of the model's
    template), default the format's own. overlap=False is the lock-step reference: every row's turn ends before
    the turn's calls are submitted, all are awaited, then all observations are appended (the same rows)."""
    overlap = overlap and not distributed.is_multiprocess()  # several processes: lock-step (module doc)
    end_ids = tuple(int(t) for t in tokenizer.eos_ids)
    call_ids = tuple(t for t in call_stop_ids(tokenizer, tool_cfg.format) if t not in end_ids)
    proto = _Protocol(tokenizer, tool_cfg, max_new_tokens, end_ids, call_ids, wrapper)
    sampling = sampling.replace(eos_ids=end_ids + call_ids)
    convs = engine.start(
        prompts,
        max_new_tokens=max_new_tokens,
        num_samples=group_size,
        sampling=sampling,
        keep=True,
        prompt_index=prompt_index,
        wait=False,
    )
    leads = [_prompt_lead(tokenizer, p, tool_cfg.format) for p in prompts]
    states = [_RowState(lead=leads[c.index // group_size]) for c in convs]
    inflight: dict[Future[ExecResult], tuple[int, ToolCall]] = {}
    try:
        ended: list[Conversation] = []  # turns ended, their calls not yet submitted (lock-step: the turn's so far)
        answered: list[tuple[int, ToolCall | None, ExecResult | None]] = []  # rows whose observation is ready
        while engine.running or inflight or answered:
            ended += engine.advance()
            if overlap or not engine.running:
                runs: list[tuple[int, ToolCall, str]] = []  # (row, call, its code)
                for c in ended:
                    goes_on, call = proto.call_of_turn(c, states[c.index])
                    if goes_on and call is not None and call.code is not None:
                        runs.append((c.index, call, call.code))
                    elif goes_on:  # a refused call or no call: answered at once
                        answered.append((c.index, call, None))
                ended = []
                if overlap:
                    inflight.update({pool.submit(code): (i, call) for i, call, code in runs})
                elif runs:  # lock-step: the turn's calls at once (on process 0 only in a multi-process run)
                    results = run_on_process0(pool, [code for _, _, code in runs])
                    answered += [(i, call, r) for (i, call, _), r in zip(runs, results)]
            if inflight and not engine.running and not answered:  # nothing to decode: block, no spinning
                wait(inflight, return_when=FIRST_COMPLETED)
            for fut in [f for f in inflight if f.done()]:
                i, call = inflight.pop(fut)
                answered.append((i, call, fut.result()))
            if answered and (overlap or not inflight):
                _continue_rows(engine, convs, states, sorted(answered, key=lambda a: a[0]), proto, sampling)
                answered = []
    finally:
        for fut in inflight:
            fut.cancel()  # queued calls of a failed rollout (running ones end by their own timeout)
        engine.close(convs)
    return [_finish_row(c, st, group_size) for c, st in zip(convs, states)]


def _continue_rows(engine, convs, states, answered, proto: _Protocol, sampling: SamplingParams) -> None:
    """Append each answered row's observation and queue its next turn (Engine.extend, wait=False: it joins the
    rows still decoding), each with what is left of its budget; a row cut inside its observation ends."""
    rows, appended, limits = [], [], []
    for i, call, result in answered:
        obs = proto.observe(convs[i], states[i], call, result)
        if obs is not None:
            rows.append(convs[i])
            appended.append(obs)
            limits.append(proto.max_new_tokens - convs[i].step - len(obs))
    if rows:
        engine.extend(rows, appended, max_new_tokens=limits, sampling=sampling, keep=True, wait=False)


def _finish_row(c: Conversation, st: _RowState, group_size: int) -> ToolRow:
    nan = float("nan")
    return ToolRow(
        prompt_pos=c.index // group_size,
        sample=c.sample,
        tokens=c.response_tokens + st.cut,
        model_mask=c.response_mask + [1] * len(c.turn_tokens) + [0] * len(st.cut),
        logprobs=c.response_logprobs + list(c.turn_logprobs) + [nan] * len(st.cut),
        statuses=list(st.statuses),
        turns=st.turns,
        final_start=st.seg_start,
        end=st.end,
    )


def final_text(tokenizer, row: ToolRow) -> str:
    """The text after the last observation: what the verifier scores."""
    return tokenizer.decode(row.tokens[row.final_start :])


def rows_to_arrays(
    rows: Sequence[ToolRow], num_prompts: int, group_size: int, width: int, pad_id: int
) -> dict[str, np.ndarray]:
    """Rows laid out prompt-major: tokens_PxGxN (pad_id after the end), model_mask_PxGxN, logprobs_PxGxN (NaN on
    observations and padding), lengths_PxG (all response tokens) and model_lengths_PxG (sampled ones)."""
    P, G, N = num_prompts, group_size, width
    out = dict(
        tokens_PxGxN=np.full((P, G, N), pad_id, np.int32),
        model_mask_PxGxN=np.zeros((P, G, N), np.int32),
        logprobs_PxGxN=np.full((P, G, N), np.nan, np.float32),
        lengths_PxG=np.zeros((P, G), np.int32),
        model_lengths_PxG=np.zeros((P, G), np.int32),
    )
    for r in rows:
        n = len(r.tokens)
        if n > N:
            raise ValueError(f"a response of {n} tokens does not fit width {N}")
        p, g = r.prompt_pos, r.sample
        out["tokens_PxGxN"][p, g, :n] = r.tokens
        out["model_mask_PxGxN"][p, g, :n] = r.model_mask
        out["logprobs_PxGxN"][p, g, :n] = r.logprobs
        out["lengths_PxG"][p, g], out["model_lengths_PxG"][p, g] = n, r.model_tokens
    return out


def tool_counts(rows: Sequence[ToolRow], correct: Sequence[float]) -> dict[str, int]:
    """Summable counts of a batch of rows (add them over generation batches, then `tool_metrics`)."""
    statuses = [s for r in rows for s in r.statuses]
    with_tool = [bool(r.used_tool) for r in rows]
    ok = [bool(x > 0) for x in correct]
    return {
        "n_responses": len(rows),
        **status_counts(statuses),
        "turns": sum(r.turns for r in rows),
        "observation_tokens": sum(r.observation_tokens for r in rows),
        "model_tokens": sum(r.model_tokens for r in rows),
        "n_budget_cut": sum(r.end == "budget" for r in rows),
        "n_with_tool": sum(with_tool),
        "n_correct_with_tool": sum(w and o for w, o in zip(with_tool, ok)),
        "n_without_tool": sum(not w for w in with_tool),
        "n_correct_without_tool": sum(o and not w for w, o in zip(with_tool, ok)),
    }


def _rate(num: float, den: float) -> float:
    return float(num) / den if den else math.nan


def tool_metrics(counts: dict[str, int]) -> dict[str, float]:
    """The step record's tool entries: calls per response, the fractions of calls that errored (non-zero exit
    or sandbox failure), timed out or were malformed (refused unrun), the observation-token fraction of all
    response tokens, turns per response, responses cut inside an observation, and accuracy with and without tool
    use (NaN when no response falls in the group)."""
    n, calls = counts["n_responses"], counts["tool_calls"]
    errored = counts["tool_calls_error"] + counts["tool_calls_sandbox_error"]
    malformed = sum(counts[f"tool_calls_{s.value}"] for s in MALFORMED)
    return {
        "tool/calls_per_response": _rate(calls, n),
        "tool/turns_per_response": _rate(counts["turns"], n),
        "tool/errored_call_frac": _rate(errored, calls),
        "tool/timeout_call_frac": _rate(counts["tool_calls_timeout"], calls),
        "tool/malformed_call_frac": _rate(malformed, calls),
        "tool/observation_token_frac": _rate(
            counts["observation_tokens"], counts["observation_tokens"] + counts["model_tokens"]
        ),
        "tool/budget_cut_frac": _rate(counts["n_budget_cut"], n),
        "tool/with_tool_frac": _rate(counts["n_with_tool"], n),
        "tool/accuracy_with_tool": _rate(counts["n_correct_with_tool"], counts["n_with_tool"]),
        "tool/accuracy_without_tool": _rate(counts["n_correct_without_tool"], counts["n_without_tool"]),
        "tool/calls": float(calls),
        "tool/errored_calls": float(errored),
        "tool/timeout_calls": float(counts["tool_calls_timeout"]),
    }


def tool_reward_shaping(
    rows: Sequence[ToolRow], correct: Sequence[float], *, tool_bonus: float, format_penalty: float
) -> np.ndarray:
    """ReTool-style reward addends per row: +tool_bonus for a correct answer that used the tool (a call whose
    code ran), -format_penalty for a response with a malformed or refused call (MALFORMED). Zero when both are 0."""
    bonus = np.asarray([tool_bonus * float(c > 0 and r.used_tool) for r, c in zip(rows, correct)], np.float32)
    penalty = np.asarray([format_penalty * float(any(s in MALFORMED for s in r.statuses)) for r in rows], np.float32)
    return bonus - penalty


def run_on_process0(pool: SandboxPool, codes: Sequence[str]) -> list[ExecResult]:
    """The ExecResults of `codes` (in order) on every process of a run: process 0 runs them all in its pool (all
    submitted, then awaited: concurrently, as SandboxPool.map) and broadcasts them
    (distributed.broadcast_from_process0); the other processes never run code. A multi-process tool rollout thus
    appends the same observations on every host (each host running its own calls could diverge: timeouts depend
    on its load). Every process must call it with the same codes at the same point. One process: pool.map."""
    if not distributed.is_multiprocess():
        return pool.map(codes)
    results = pool.map(codes) if jax.process_index() == 0 else []
    payload = distributed.broadcast_from_process0([dataclasses.asdict(r) for r in results])
    if len(payload) != len(codes):
        raise RuntimeError(
            f"run_on_process0: process 0 returned {len(payload)} results for {len(codes)} calls "
            "(the processes' tool rounds diverged)"
        )
    return [ExecResult(**r) for r in payload]
