"""Multi-turn tool-use rollouts: sample, run the model's code in the sandbox, append the output, continue.

For each of the G samples of each prompt the rollout engine samples until the model closes a tool call (the
closing tag's token is a stop token) or ends its answer (an EOS id). The call is parsed (calls.parse_call); a good
call's code goes to the SandboxPool - every call a turn produced is submitted before any result is awaited, so the
calls of a batch run concurrently - and the rendered observation (calls.observation, tokenized with the model's own
tokenizer) is appended with `Engine.extend`: one extend round per turn over every row that made a call, each row
with what is left of its token budget; the conversation is never re-prefilled. A response ends on EOS or at its
budget; a call past `tool.max_turns` (like any malformed call) is not run but answered with an observation saying
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
replicated); the sandbox calls of a round run on process 0 only and their results are broadcast to the others
(tools.pool.run_on_process0), so every process appends the same observation tokens.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from stare_jax.tools.calls import (CallFormat, CallStatus, ObservationFormat, ToolCall, ends_inside_call, observation,
                                   observation_format_from_template, parse_call, result_status, status_counts,
                                   stop_strings)
from stare_jax.tools.config import ToolConfig
from stare_jax.tools.pool import SandboxPool, run_on_process0
from stare_jax.tools.sandbox import ExecResult

if TYPE_CHECKING:
    from stare_jax.sampling.engine import Conversation

__all__ = ["MALFORMED", "ToolRow", "call_stop_ids", "final_text", "observation_wrapper", "rows_to_arrays",
           "tool_counts", "tool_metrics", "tool_reward_shaping", "tool_rollouts"]

MALFORMED = (CallStatus.INVALID_JSON, CallStatus.UNKNOWN_TOOL, CallStatus.BAD_ARGUMENTS, CallStatus.EMPTY_CODE,
             CallStatus.MAX_TURNS)


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
    return st.lead + tokenizer.decode(c.response_tokens[st.seg_start:], skip_special_tokens=False)


def _prompt_lead(tokenizer, prompt: Sequence[int], fmt: CallFormat) -> str:
    """The prompt's text when it ends inside an unclosed call (the model finishes that call), else ""."""
    text = tokenizer.decode(list(prompt), skip_special_tokens=False)
    return text if ends_inside_call(text, fmt) else ""


def _observation_ids(tokenizer, call: ToolCall, result: ExecResult | None, cfg: ToolConfig,
                     wrapper: ObservationFormat | None) -> list[int]:
    text = observation(call, result, cfg.format, wrapper=wrapper, timeout_s=cfg.timeout_s)
    return [int(t) for t in tokenizer.encode(text, add_bos=False)]


def tool_rollouts(engine, prompts: Sequence[Sequence[int]], *, group_size: int, tool_cfg: ToolConfig, tokenizer,
                  pool: SandboxPool, max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
                  top_k: int = 0, seed: int = 0, prompt_index: Sequence[int] | None = None,
                  wrapper: ObservationFormat | None = None) -> list[ToolRow]:
    """G multi-turn responses per prompt (prompt-major, row p * G + g) with the code interpreter (module doc).

    engine: a rollout Engine (start / extend / close); max_new_tokens: the token budget of a whole response
    (sampled + observation tokens); prompt_index: the prompts' global indices (their random draws), default
    0..P-1; wrapper: the observation's wrapper (calls.observation_format_from_template of the model's template),
    default the format's own."""
    end_ids = tuple(int(t) for t in tokenizer.eos_ids)
    call_ids = tuple(t for t in call_stop_ids(tokenizer, tool_cfg.format) if t not in end_ids)
    kw: dict[str, Any] = dict(temperature=temperature, top_p=top_p, top_k=top_k, eos_ids=list(end_ids + call_ids),
                              seed=seed)
    convs = engine.start(prompts, max_new_tokens=max_new_tokens, num_samples=group_size, keep=True,
                         prompt_index=prompt_index, **kw)
    leads = [_prompt_lead(tokenizer, p, tool_cfg.format) for p in prompts]
    states = [_RowState(lead=leads[c.index // group_size]) for c in convs]
    try:
        live = list(range(len(convs)))
        while live:
            live = _tool_round(engine, convs, states, live, tool_cfg=tool_cfg, tokenizer=tokenizer, pool=pool,
                               max_new_tokens=max_new_tokens, end_ids=end_ids, call_ids=call_ids, wrapper=wrapper,
                               sampling=kw)
    finally:
        engine.close(convs)
    return [_finish_row(c, st, group_size) for c, st in zip(convs, states)]


def _tool_round(engine, convs, states, live, *, tool_cfg: ToolConfig, tokenizer, pool: SandboxPool,
                max_new_tokens: int, end_ids, call_ids, wrapper, sampling) -> list[int]:
    """One turn of every live row: parse the calls the turn closed, run them (all submitted, then awaited),
    append the observations and sample the next turn of those rows (one extend). Returns the rows still live."""
    pending: list[tuple[int, ToolCall | None]] = []
    for i in live:
        c, st = convs[i], states[i]
        st.turns += 1
        how = _turn_end(c, end_ids, call_ids)
        if how != "call" or c.step >= max_new_tokens:
            st.end = "eos" if how == "eos" else "length"
            continue
        call = parse_call(_segment_text(tokenizer, c, st), tool_cfg.format,
                          calls_so_far=len(st.statuses), max_turns=tool_cfg.max_turns)
        pending.append((i, call))
    # every call of the round runs at once; on process 0 only in a multi-process run (the same results everywhere)
    runs = [call.code for _, call in pending if call is not None and call.code is not None]
    results = iter(run_on_process0(pool, runs) if runs else [])
    rows, appended, limits = [], [], []
    for i, call in pending:
        c, st = convs[i], states[i]
        obs: list[int] = []
        if call is not None:  # None: a stop token that did not close a call; sampling just goes on
            result = next(results) if call.code is not None else None
            st.statuses.append(result_status(result) if result is not None else call.status)
            obs = _observation_ids(tokenizer, call, result, tool_cfg, wrapper)
        room = max_new_tokens - c.step
        if len(obs) >= room:  # no room left to sample after the observation: the response ends inside it
            st.cut, st.end = obs[:room], "budget"
            continue
        if obs:
            st.seg_start, st.lead = c.step + len(obs), ""
        rows.append(i)
        appended.append(obs)
        limits.append(room - len(obs))
    if rows:
        engine.extend([convs[i] for i in rows], appended, max_new_tokens=limits, **sampling)
    return rows


def _finish_row(c: Conversation, st: _RowState, group_size: int) -> ToolRow:
    nan = float("nan")
    return ToolRow(prompt_pos=c.index // group_size, sample=c.sample,
                   tokens=c.response_tokens + st.cut,
                   model_mask=c.response_mask + [1] * len(c.turn_tokens) + [0] * len(st.cut),
                   logprobs=c.response_logprobs + list(c.turn_logprobs) + [nan] * len(st.cut),
                   statuses=list(st.statuses), turns=st.turns, final_start=st.seg_start, end=st.end)


def final_text(tokenizer, row: ToolRow) -> str:
    """The text after the last observation: what the verifier scores."""
    return tokenizer.decode(row.tokens[row.final_start:])


def rows_to_arrays(rows: Sequence[ToolRow], num_prompts: int, group_size: int, width: int,
                   pad_id: int) -> dict[str, np.ndarray]:
    """Rows laid out prompt-major: tokens_PxGxN (pad_id after the end), model_mask_PxGxN, logprobs_PxGxN (NaN on
    observations and padding), lengths_PxG (all response tokens) and model_lengths_PxG (sampled ones)."""
    P, G, N = num_prompts, group_size, width
    out = dict(tokens_PxGxN=np.full((P, G, N), pad_id, np.int32), model_mask_PxGxN=np.zeros((P, G, N), np.int32),
               logprobs_PxGxN=np.full((P, G, N), np.nan, np.float32), lengths_PxG=np.zeros((P, G), np.int32),
               model_lengths_PxG=np.zeros((P, G), np.int32))
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
    return {"n_responses": len(rows), **status_counts(statuses),
            "turns": sum(r.turns for r in rows),
            "observation_tokens": sum(r.observation_tokens for r in rows),
            "model_tokens": sum(r.model_tokens for r in rows),
            "n_budget_cut": sum(r.end == "budget" for r in rows),
            "n_with_tool": sum(with_tool), "n_correct_with_tool": sum(w and o for w, o in zip(with_tool, ok)),
            "n_without_tool": sum(not w for w in with_tool),
            "n_correct_without_tool": sum(o and not w for w, o in zip(with_tool, ok))}


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
    return {"tool/calls_per_response": _rate(calls, n), "tool/turns_per_response": _rate(counts["turns"], n),
            "tool/errored_call_frac": _rate(errored, calls), "tool/timeout_call_frac": _rate(
                counts["tool_calls_timeout"], calls), "tool/malformed_call_frac": _rate(malformed, calls),
            "tool/observation_token_frac": _rate(counts["observation_tokens"],
                                                 counts["observation_tokens"] + counts["model_tokens"]),
            "tool/budget_cut_frac": _rate(counts["n_budget_cut"], n),
            "tool/with_tool_frac": _rate(counts["n_with_tool"], n),
            "tool/accuracy_with_tool": _rate(counts["n_correct_with_tool"], counts["n_with_tool"]),
            "tool/accuracy_without_tool": _rate(counts["n_correct_without_tool"], counts["n_without_tool"]),
            "tool/calls": float(calls), "tool/errored_calls": float(errored),
            "tool/timeout_calls": float(counts["tool_calls_timeout"])}


def tool_reward_shaping(rows: Sequence[ToolRow], correct: Sequence[float], *, tool_bonus: float,
                        format_penalty: float) -> np.ndarray:
    """ReTool-style reward addends per row: +tool_bonus for a correct answer that used the tool (a call whose
    code ran), -format_penalty for a response with a malformed or refused call (MALFORMED). Zero when both are 0."""
    bonus = np.asarray([tool_bonus * float(c > 0 and r.used_tool) for r, c in zip(rows, correct)], np.float32)
    penalty = np.asarray([format_penalty * float(any(s in MALFORMED for s in r.statuses)) for r in rows], np.float32)
    return bonus - penalty
