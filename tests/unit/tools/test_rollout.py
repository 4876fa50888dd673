"""Multi-turn tool rollouts (stare_jax.tools.rollout) through the real rollout engine, tokenizer and sandbox pool.

The model is the real stare_jax Qwen2 model with crafted weights that make it a deterministic bigram model (its
layers add nothing, so the next token depends on the current one only): after `}` it closes a hermes call, after `)`
a ReTool call, after anything else it ends its answer. Prompts end inside a call (the model finishes it), so every
tool-call outcome is reached exactly: a good call, invalid JSON, an unknown tool, a call past max_turns, a timeout,
a response whose budget ends inside the observation. Expected observations are written out by hand.
The masks are then followed into training: the collect stage's train batch has loss mask 0 on observation tokens,
and the real train step ignores them (loss, update, omega on model tokens and the gate's entropy do not change
when they do; the entropy is the mean over model tokens only).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import shutil
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx

from stare_jax.config.loader import Config, ConfigError, RLConfig, SamplingConfig, load_config
from stare_jax.data.prompts import PAPER_INSTRUCTION, PromptRow
from stare_jax.models import init_model, save_pretrained
from stare_jax.rewards.reward_fn import RewardFn
from stare_jax.rl.losses import policy_loss
from stare_jax.rl.stare import StareConfig, init_stare_state
from stare_jax.rl.step import OptimizerConfig, TrainStepConfig, init_train_state, make_train_step
from stare_jax.sampling import SamplingParams
from stare_jax.sampling.engine import Engine, EngineConfig
from stare_jax.tools import CallStatus, SandboxPool, ToolConfig
from stare_jax.tools.calls import CODE_TOOL_SCHEMA, HERMES_QWEN25, ObservationFormat
from stare_jax.tools.pool import LocalBackend
from stare_jax.tools.rollout import (
    ToolRow,
    call_stop_ids,
    final_text,
    observation_wrapper,
    rows_to_arrays,
    tool_counts,
    tool_metrics,
    tool_reward_shaping,
    tool_rollouts,
)
from stare_jax.tools.sandbox import ExecResult
from stare_jax.training.collect import Rollouts, collect_batch, train_batch_from_rollouts
from stare_jax.training.metrics import read_metrics
from stare_jax.training.setup import TrainingError, encode_rows, make_tool_pool
from support.cli import cli_env
from support.rl import TINY_STEP_MODEL, random_train_batch
from support.tools import CALL, TEMPLATE, _bigram_model, _make_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """With a Qwen2.5-like chat template (its tool turn is Qwen2.5's)."""
    return _make_tokenizer(tmp_path_factory.mktemp("tool_tok"), TEMPLATE)


REPO = pathlib.Path(__file__).resolve().parents[3]
HERMES_42 = "<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
RETOOL_42 = "\n<interpreter>\n42\n</interpreter>\n"


def test_observation_wrapper_comes_from_the_chat_template(tokenizer, tmp_path):
    assert observation_wrapper(tokenizer, "hermes") == HERMES_QWEN25
    assert observation_wrapper(tokenizer, "retool") is None
    other = _make_tokenizer(tmp_path / "a", TEMPLATE.replace("user\\n<tool_response>", "tool"))
    assert observation_wrapper(other, "hermes") == ObservationFormat(
        "<|im_end|>\n<|im_start|>tool\n", "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    assert observation_wrapper(_make_tokenizer(tmp_path / "b", None), "hermes") is None
    refusing = (
        "{%- for m in messages %}{%- if m.role == 'tool' %}{{ raise_exception('no tools') }}{%- endif %}{%- endfor %}"
    )
    assert observation_wrapper(_make_tokenizer(tmp_path / "c", refusing), "hermes") is None


def test_prompts_give_the_chat_template_the_code_interpreter_schema(tmp_path):
    """tool.enabled (hermes): the chat template is rendered with tools=[CODE_TOOL_SCHEMA] (Qwen2.5's template
    writes its hermes tool-use system prompt from it); without it, or for ReTool, nothing changes."""
    listing = (
        "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n' }}{%- for t in tools %}{{- t | tojson }}"
        "{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}"
    )
    tok = _make_tokenizer(tmp_path / "t", listing + TEMPLATE)
    rows = [PromptRow("1", "What is 2+3?", "5", "x:1")]

    def prompt(*overrides):
        cfg = load_config(None, ["data.prompt_template=chat", "data.max_prompt_len=4000", *overrides])
        (ids,), _ = encode_rows(rows, tok, cfg)
        return tok.decode(ids, skip_special_tokens=False)

    with_tool = prompt("tool.enabled=true")
    assert with_tool.startswith("<|im_start|>system\n# Tools\n" + json.dumps(CODE_TOOL_SCHEMA))
    assert with_tool.endswith("What is 2+3?\n" + PAPER_INSTRUCTION + "<|im_end|>\n<|im_start|>assistant\n")
    plain = prompt()
    assert "# Tools" not in plain and with_tool.endswith(plain)
    assert prompt("tool.enabled=true", "tool.format=retool") == plain


@pytest.fixture(scope="module")
def engine(tokenizer):
    model = _bigram_model(tokenizer, {"}": "</tool_call>", ")": "</code>"}, default="<|im_end|>")
    return Engine(
        model, config=EngineConfig(max_slots=8, page_size=8, decode_chunk=8, prefill_chunk=64), pad_id=tokenizer.pad_id
    )


@pytest.fixture(scope="module")
def pool():
    with SandboxPool(8, timeout_s=1.0, memory_mb=512) as p:
        yield p


def _enc(tokenizer, text):
    return tokenizer.encode(text, add_bos=False)


def _run(engine, tokenizer, pool, prompts, *, G=2, budget=96, **tool):
    cfg = ToolConfig(enabled=True, timeout_s=1.0, **tool)
    return tool_rollouts(
        engine,
        [_enc(tokenizer, p) for p in prompts],
        group_size=G,
        tool_cfg=cfg,
        tokenizer=tokenizer,
        pool=pool,
        max_new_tokens=budget,
        sampling=SamplingParams(seed=1),
    )


def _check_row_invariants(row: ToolRow):
    assert len(row.tokens) == len(row.model_mask) == len(row.logprobs)
    lp = np.asarray(row.logprobs)
    mask = np.asarray(row.model_mask, bool)
    assert np.all(np.isnan(lp[~mask])) and np.all(np.isfinite(lp[mask]))


def test_stop_ids_are_the_closing_tags(tokenizer):
    assert call_stop_ids(tokenizer, "hermes") == (tokenizer.token_to_id("</tool_call>"),)
    assert call_stop_ids(tokenizer, "retool") == (tokenizer.token_to_id("</code>"),)


def test_good_call_runs_and_observation_is_appended_with_mask_0(engine, tokenizer, pool):
    prompts = [CALL.format(name="code_interpreter", code="print(6 * 7)")]
    rows = _run(engine, tokenizer, pool, prompts)
    close, eos = tokenizer.token_to_id("</tool_call>"), tokenizer.token_to_id("<|im_end|>")
    obs = _enc(tokenizer, HERMES_42)
    for g, row in enumerate(rows):
        _check_row_invariants(row)
        assert (row.prompt_pos, row.sample) == (0, g)
        assert row.statuses == [CallStatus.OK]
        # the model closes the call, the observation follows (mask 0), the model answers (EOS after "\n")
        assert row.tokens == [close] + obs + [eos]
        assert row.model_mask == [1] + [0] * len(obs) + [1]
        assert row.turns == 2 and row.end == "eos" and row.final_start == 1 + len(obs)
        assert row.observation_tokens == len(obs) and row.model_tokens == 2 and row.used_tool
    assert final_text(tokenizer, rows[0]) == ""
    assert engine.pool.all_free()  # every conversation closed


def test_retool_format(engine, tokenizer, pool):
    prompt = "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<code>\nprint(6 * 7)"
    rows = _run(engine, tokenizer, pool, [prompt], G=1, format="retool")
    obs = _enc(tokenizer, RETOOL_42)
    (row,) = rows
    assert row.statuses == [CallStatus.OK]
    # ")" -> </code>; the observation ends in "\n" -> EOS
    assert row.tokens == [tokenizer.token_to_id("</code>")] + obs + [tokenizer.token_to_id("<|im_end|>")]
    assert row.model_mask == [1] + [0] * len(obs) + [1]


def test_bad_calls_get_observations_and_are_counted(engine, tokenizer, pool):
    prompts = [
        CALL.format(name="code_interpreter", code="print(1)")[:-1],  # one brace short: invalid JSON
        CALL.format(name="web_search", code="print(1)"),
        CALL.format(name="code_interpreter", code="while True: pass"),
        CALL.format(name="code_interpreter", code="print(6 * 7)"),
        "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n",
    ]  # no call: the model answers at once
    rows = _run(engine, tokenizer, pool, prompts, G=1, budget=120)
    for row in rows:
        _check_row_invariants(row)
    statuses = [r.statuses for r in rows]
    assert statuses == [[CallStatus.INVALID_JSON], [CallStatus.UNKNOWN_TOOL], [CallStatus.TIMEOUT], [CallStatus.OK], []]
    texts = [
        tokenizer.decode([t for t, m in zip(r.tokens, r.model_mask) if not m], skip_special_tokens=False) for r in rows
    ]
    assert "Error: the tool call is not valid JSON" in texts[0]
    assert "Error: unknown tool 'web_search'; available tools: code_interpreter." in texts[1]
    assert "[timed out after 1 s: the code was stopped]" in texts[2]
    assert texts[3] == HERMES_42 and texts[4] == ""
    assert rows[4].tokens == [tokenizer.token_to_id("<|im_end|>")] and rows[4].turns == 1
    counts = tool_counts(rows, [0, 0, 0, 1, 1])
    assert counts["tool_calls"] == 4 and counts["tool_calls_invalid_json"] == 1
    assert counts["tool_calls_unknown_tool"] == 1 and counts["tool_calls_timeout"] == 1
    m = tool_metrics(counts)
    assert m["tool/calls_per_response"] == pytest.approx(4 / 5)
    assert m["tool/timeout_call_frac"] == pytest.approx(1 / 4)
    assert m["tool/malformed_call_frac"] == pytest.approx(2 / 4)
    assert m["tool/errored_call_frac"] == 0.0
    # used the tool (code ran): the timeout row and the good row; correct with tool 1/2, without 1/3
    assert m["tool/accuracy_with_tool"] == pytest.approx(0.5)
    assert m["tool/accuracy_without_tool"] == pytest.approx(1 / 3)
    obs = sum(r.observation_tokens for r in rows)
    assert m["tool/observation_token_frac"] == pytest.approx(obs / sum(len(r.tokens) for r in rows))


def test_call_past_max_turns_is_refused_not_run(engine, tokenizer, pool):
    rows = _run(engine, tokenizer, pool, [CALL.format(name="code_interpreter", code="print(6 * 7)")], G=1, max_turns=0)
    (row,) = rows
    assert row.statuses == [CallStatus.MAX_TURNS] and not row.used_tool
    text = tokenizer.decode([t for t, m in zip(row.tokens, row.model_mask) if not m], skip_special_tokens=False)
    assert "the limit of 0 tool calls per response is reached; the code was not run" in text
    assert "42" not in text


def test_several_calls_then_max_turns_until_the_budget(tokenizer, pool):
    """A model that answers every observation with another call (<code>7</code>): two calls run, every later one
    is refused (max_turns=2) with an observation saying so, until the budget ends the response; the outcome equals
    a hand simulation of the protocol."""
    model = _bigram_model(
        tokenizer, {")": "</code>", "\n": "<code>", "<code>": "7", "7": "</code>"}, default="<|im_end|>"
    )
    engine = Engine(
        model, config=EngineConfig(max_slots=4, page_size=8, decode_chunk=8, prefill_chunk=64), pad_id=tokenizer.pad_id
    )
    prompt = "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<code>\nprint(6 * 7)"
    budget = 150
    (row,) = _run(engine, tokenizer, pool, [prompt], G=1, budget=budget, format="retool", max_turns=2)
    tid = tokenizer.token_to_id
    call = [tid("<code>"), *_enc(tokenizer, "7"), tid("</code>")]
    refused = "Error: the limit of 2 tool calls per response is reached; the code was not run."
    outputs = iter(["42", "(no output)"] + [refused] * 100)
    seq, mask, n_calls, end = [tid("</code>")], [1], 0, ""
    while not end:  # the protocol by hand: observation, then the model's next call, within the budget
        n_calls += 1
        obs = _enc(tokenizer, f"\n<interpreter>\n{next(outputs)}\n</interpreter>\n")
        room = budget - len(seq)
        if len(obs) >= room:
            seq, mask, end = seq + obs[:room], mask + [0] * room, "budget"
            break
        seq, mask = seq + obs, mask + [0] * len(obs)
        room = budget - len(seq)
        seq, mask = seq + call[:room], mask + [1] * min(room, 3)
        end = "length" if len(seq) == budget else ""
    assert row.tokens == seq and row.model_mask == mask and row.end == end
    assert row.statuses == [CallStatus.OK, CallStatus.OK] + [CallStatus.MAX_TURNS] * (n_calls - 2)
    assert n_calls > 3 and row.turns == n_calls + (end == "length")
    _check_row_invariants(row)


def test_budget_ending_inside_the_observation_cuts_the_response(engine, tokenizer, pool):
    obs = _enc(tokenizer, HERMES_42)
    budget = 1 + len(obs) // 2
    rows = _run(
        engine, tokenizer, pool, [CALL.format(name="code_interpreter", code="print(6 * 7)")], G=2, budget=budget
    )
    for row in rows:
        assert row.end == "budget" and len(row.tokens) == budget
        assert row.tokens[1:] == obs[: budget - 1] and row.model_mask == [1] + [0] * (budget - 1)
        _check_row_invariants(row)
    assert tool_counts(rows, [0, 0])["n_budget_cut"] == 2
    # an observation that exactly fills the budget also ends the response (no room to sample after it)
    (row,) = _run(
        engine, tokenizer, pool, [CALL.format(name="code_interpreter", code="print(6 * 7)")], G=1, budget=1 + len(obs)
    )
    assert row.end == "budget" and row.tokens[1:] == obs


class _TimedBackend(LocalBackend):
    """LocalBackend that records each run's (start, end) on the trainer's monotonic clock."""

    def __init__(self, **limits):
        super().__init__(**limits)
        self.spans: list[tuple[float, float]] = []

    def run(self, code):
        t0 = time.monotonic()
        res = super().run(code)
        self.spans.append((t0, time.monotonic()))
        return res


def test_calls_of_a_batch_run_concurrently(engine, tokenizer):
    """The 6 calls one turn produced are all in flight at one moment (every start precedes every end): a
    load-independent check, unlike a wall-time bound (which failed on a slow CI machine)."""
    code = "import time; time.sleep(1.0); print(6 * 7)"
    prompts = [CALL.format(name="code_interpreter", code=code)] * 3
    backend = _TimedBackend(timeout_s=8.0, memory_mb=512)
    with SandboxPool(6, backend=backend) as pool:
        rows = _run(engine, tokenizer, pool, prompts, G=2)
    assert [r.statuses for r in rows] == [[CallStatus.OK]] * 6
    starts, ends = zip(*backend.spans)
    assert len(starts) == 6
    assert max(starts) < min(ends), f"the calls did not overlap: spans {backend.spans}"


class _ScrambledBackend:
    """Answers each call with a deterministic output of its code after a delay taken, in submission order, from
    `delays` (so calls finish in another order than they were submitted); records the order they finished in."""

    def __init__(self, delays):
        self.delays, self.lock = delays, threading.Lock()
        self.submitted: list[str] = []
        self.finished: list[int] = []

    def run(self, code):
        with self.lock:
            i = len(self.submitted)
            self.submitted.append(code)
        time.sleep(self.delays[i % len(self.delays)])
        with self.lock:
            self.finished.append(i)
        return ExecResult(f"{sum(map(ord, code)) % 97}\n", "", 0, False, False)


def _assert_same_rows(a: list[ToolRow], b: list[ToolRow]):
    for x, y in zip(a, b, strict=True):
        assert (x.prompt_pos, x.sample, x.tokens, x.model_mask) == (y.prompt_pos, y.sample, y.tokens, y.model_mask)
        assert (x.statuses, x.turns, x.final_start, x.end) == (y.statuses, y.turns, y.final_start, y.end)
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)  # NaN at the same places


def test_overlapped_rows_equal_lock_step_whatever_order_calls_finish(tokenizer):
    """A model that answers each observation with another call (<code>D</code>, D one of 9 digits) or ends, each
    half the time: rows make 1 to many calls (3 run, later ones refused) and end on EOS or cut inside an
    observation. The event-driven rollout (each call submitted when its row stops, its observation appended when
    it returns, while the other rows decode) gives exactly the lock-step rollout's rows, whatever order the
    calls finish in (delays scrambled in submission order)."""
    digits = tuple("123456789")
    model = _bigram_model(
        tokenizer,
        {")": "</code>", "\n": ("<code>", "<|im_end|>"), "<code>": digits, **{d: "</code>" for d in digits}},
        default="<|im_end|>",
    )
    engine = Engine(
        model, config=EngineConfig(max_slots=4, page_size=8, decode_chunk=4, prefill_chunk=64), pad_id=tokenizer.pad_id
    )
    prompts = [f"<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<code>\nprint({x})" for x in (1, 22, 333)]
    runs = {}
    for name, delays, overlap in [
        ("lock-step", [0.0], False),
        ("overlap", [0.0], True),
        ("overlap-scrambled", [0.2, 0.0, 0.1, 0.05, 0.0, 0.15], True),
        ("lock-step-scrambled", [0.0, 0.1, 0.05], False),
    ]:
        backend = _ScrambledBackend(delays)
        with SandboxPool(8, backend=backend) as pool:
            cfg = ToolConfig(enabled=True, format="retool", max_turns=3)
            runs[name] = tool_rollouts(
                engine,
                [_enc(tokenizer, p) for p in prompts],
                group_size=4,
                tool_cfg=cfg,
                tokenizer=tokenizer,
                pool=pool,
                max_new_tokens=80,
                sampling=SamplingParams(seed=3),
                overlap=overlap,
            )
        runs[name + "/finished"] = backend.finished
        assert engine.pool.all_free() and not engine.running
    ref = runs["lock-step"]
    for name in ("overlap", "overlap-scrambled", "lock-step-scrambled"):
        _assert_same_rows(runs[name], ref)
    # the workload is varied: different numbers of turns, every way a response ends, refused calls
    assert len({r.turns for r in ref}) >= 3 and {r.end for r in ref} >= {"eos", "budget"}
    assert any(CallStatus.MAX_TURNS in r.statuses for r in ref)
    for r in ref:
        _check_row_invariants(r)
    assert runs["overlap-scrambled/finished"] != sorted(runs["overlap-scrambled/finished"])


class _GatedBackend:
    """Logs when each call starts and ends into a shared event log; a call returns only once `release` is set."""

    def __init__(self, log, lock):
        self.log, self.lock, self.release = log, lock, threading.Event()

    def run(self, code):
        with self.lock:
            self.log.append(("call_start", code))
        self.release.wait(timeout=60)
        with self.lock:
            self.log.append(("call_end", code))
        return ExecResult("42\n", "", 0, False, False)


def _logged_rollout(tokenizer, prompts, *, overlap: bool, gate: bool):
    """tool_rollouts with an engine whose decode rounds and ended turns go into the backend's event log; with
    `gate`, a call returns only after a decode round ran while it was in flight (no clocks: the order of events)."""
    model = _bigram_model(tokenizer, {"}": "</tool_call>", "a": "a"}, default="<|im_end|>")
    engine = Engine(
        model, config=EngineConfig(max_slots=4, page_size=8, decode_chunk=8, prefill_chunk=64), pad_id=tokenizer.pad_id
    )
    log, lock = [], threading.Lock()
    backend = _GatedBackend(log, lock)
    if not gate:
        backend.release.set()
    decode, advance = engine.scheduler._decode_round, engine.advance

    def logged_decode(*args):
        ran = decode(*args)
        with lock:
            starts = sum(e[0] == "call_start" for e in log)
            if ran:
                log.append(("decode", starts - sum(e[0] == "call_end" for e in log)))
            if ran and starts > sum(e[0] == "call_end" for e in log):
                backend.release.set()  # a decode round ran while a call was in flight
        return ran

    def logged_advance():
        ended = advance()
        with lock:
            log.extend(("ended", c.index) for c in ended)
        return ended

    engine.scheduler._decode_round, engine.advance = logged_decode, logged_advance
    with SandboxPool(2, backend=backend) as pool:
        rows = tool_rollouts(
            engine,
            [_enc(tokenizer, p) for p in prompts],
            group_size=1,
            tool_cfg=ToolConfig(enabled=True),
            tokenizer=tokenizer,
            pool=pool,
            max_new_tokens=160,
            sampling=SamplingParams(seed=1),
            overlap=overlap,
        )
    return rows, log


def test_sandbox_calls_overlap_the_decoding_of_other_rows(tokenizer):
    """Row 0 closes a call at its first token; row 1 writes 'a' until its budget (20 decode rounds). Event-driven:
    row 0's call is submitted before row 1's turn ends and decode rounds run while it is in flight (the call
    returns only after one did); lock-step: the call starts only after row 1 stopped and no decode round runs
    during it. Both give the same rows."""
    prompts = [
        CALL.format(name="code_interpreter", code="print(6 * 7)"),
        "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\na",
    ]
    rows, log = _logged_rollout(tokenizer, prompts, overlap=True, gate=True)
    start, end = log.index(("call_start", "print(6 * 7)")), log.index(("call_end", "print(6 * 7)"))
    assert start < log.index(("ended", 1)), log  # submitted before the last row of the turn stopped
    assert any(e[0] == "decode" and start < k < end for k, e in enumerate(log)), log  # decoding while in flight
    assert rows[0].statuses == [CallStatus.OK] and rows[0].end == "eos" and rows[1].end == "length"
    assert len(rows[1].tokens) == 160 and rows[1].turns == 1
    ref, ref_log = _logged_rollout(tokenizer, prompts, overlap=False, gate=False)
    _assert_same_rows(rows, ref)
    start, end = ref_log.index(("call_start", "print(6 * 7)")), ref_log.index(("call_end", "print(6 * 7)"))
    assert ref_log.index(("ended", 1)) < start and not any(e[0] == "decode" for e in ref_log[start:end])


def test_rows_to_arrays_and_reward_shaping(engine, tokenizer, pool):
    prompts = [CALL.format(name="code_interpreter", code="print(6 * 7)"), CALL.format(name="x", code="1")]
    rows = _run(engine, tokenizer, pool, prompts, G=2)
    arr = rows_to_arrays(rows, 2, 2, 96, pad_id=0)
    for r in rows:
        n = len(r.tokens)
        assert arr["tokens_PxGxN"][r.prompt_pos, r.sample, :n].tolist() == r.tokens
        assert arr["model_mask_PxGxN"][r.prompt_pos, r.sample].tolist() == r.model_mask + [0] * (96 - n)
        assert arr["lengths_PxG"][r.prompt_pos, r.sample] == n
        assert arr["model_lengths_PxG"][r.prompt_pos, r.sample] == sum(r.model_mask)
    shaped = tool_reward_shaping(rows, [1, 0, 1, 0], tool_bonus=0.1, format_penalty=0.5)
    np.testing.assert_allclose(shaped, [0.1, 0.0, -0.5, -0.5])
    assert np.all(tool_reward_shaping(rows, [1, 0, 1, 0], tool_bonus=0.0, format_penalty=0.0) == 0)


# ------------------------------------------------------------------------------------------------ config


def test_tool_section_in_the_run_config(tmp_path):
    cfg = load_config(None, ["tool.enabled=true", "tool.format=retool", "tool.tool_bonus=0.1"])
    assert isinstance(cfg, Config) and cfg.tool.enabled and cfg.tool.format == "retool"
    assert cfg.tool.tool_bonus == 0.1 and cfg.tool.format_penalty == 0.0
    with pytest.raises(ConfigError, match="tool.format_penalty"):
        load_config(None, ["tool.format_penalty=-1"])
    with pytest.raises(ConfigError, match="tool.max_turn"):
        load_config(None, ["tool.max_turn=3"])


# ------------------------------------------------------------------------------------------------ into training


class _Row:
    def __init__(self, answer):
        self.answer = answer


def test_collect_stage_lays_out_observations_with_loss_mask_0(engine, tokenizer, pool):
    prompts = [
        CALL.format(name="code_interpreter", code="print(6 * 7)"),
        "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n",
    ]
    rows = [_Row("42"), _Row("7")]
    ids = {id(r): _enc(tokenizer, p) for r, p in zip(rows, prompts)}
    rl = RLConfig(train_batch_size=2, group_size=2, gen_batch_size=2, dynamic_sampling=False)
    sampling = SamplingConfig(max_new_tokens=96)
    tool = ToolConfig(enabled=True, timeout_s=1.0, tool_bonus=0.5)
    reward = RewardFn()
    try:
        got = collect_batch(
            engine,
            iter([rows]),
            lambda r: ids[id(r)],
            rl=rl,
            sampling=sampling,
            tokenizer=tokenizer,
            reward_fn=reward,
            prompt_len=96,
            seed=0,
            step=0,
            tool=tool,
            tool_pool=pool,
        )
    finally:
        reward.close()
    b = got.batch
    obs = _enc(tokenizer, HERMES_42)
    T = 96
    for row in range(2):  # prompt 0: close, observation, EOS
        resp = b["input_ids_BxT"][row, T:]
        assert resp[1 : 1 + len(obs)].tolist() == obs
        assert b["attention_mask_BxT"][row, T : T + 2 + len(obs)].tolist() == [1] * (2 + len(obs))
        assert b["response_mask_BxT"][row, T:].tolist() == [1] + [0] * len(obs) + [1] + [0] * (94 - len(obs))
    for row in range(2, 4):  # prompt 1: EOS at once
        assert b["response_mask_BxT"][row, T:].tolist() == [1] + [0] * 95
    m = got.metrics()
    assert m["response_len_mean"] == pytest.approx(2 * 2 / 4 + 1 * 2 / 4)  # model tokens only
    assert m["tool/calls_per_response"] == pytest.approx(0.5)
    assert m["tool/observation_token_frac"] == pytest.approx(2 * len(obs) / (2 * len(obs) + 6))
    assert m["tool/with_tool_frac"] == pytest.approx(0.5)
    assert m["accuracy"] == 0.0 and math.isnan(m["tool/accuracy_with_tool"]) is False
    np.testing.assert_allclose(got.kept.reward_bonus_PxG, 0.0)  # a bonus only for correct answers


MODEL = TINY_STEP_MODEL
STEP = TrainStepConfig(
    optimizer=OptimizerConfig(lr=1e-3),
    logprob_chunk_size=8,
    debug_outputs=True,
    stare=StareConfig(enabled=True, variant="O1", w=1.5, target_entropy=50.0),
)


def _obs_batch(seed=0, k=4):
    """A train batch whose last k response tokens of each row are tool observation (attended, loss mask 0)."""
    b = random_train_batch(MODEL.vocab_size, 16, 20, seed)
    b["response_mask_BxT"] = b["response_mask_BxT"].copy()
    b["response_mask_BxT"][:, -k:] = 0
    return b


@pytest.fixture(scope="module")
def step_and_state():
    model = init_model(MODEL, seed=0)
    graphdef, ts = init_train_state(model, STEP)
    return graphdef, ts, make_train_step(graphdef, STEP, donate=False)


def _flat(tree):
    return np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(tree)])


def test_observation_tokens_change_nothing_in_the_train_step(step_and_state):
    graphdef, ts, step = step_and_state
    b = _obs_batch()
    other = dict(b, input_ids_BxT=b["input_ids_BxT"].copy())
    rng = np.random.default_rng(1)
    other["input_ids_BxT"][:, -4:] = rng.integers(0, MODEL.vocab_size, (16, 4))  # other observation tokens
    assert not np.array_equal(other["input_ids_BxT"], b["input_ids_BxT"])
    ts1, ss1, m1 = step(ts, b, init_stare_state(STEP.stare))
    ts2, ss2, m2 = step(ts, other, init_stare_state(STEP.stare))
    lm = b["response_mask_BxT"][:, 1:] > 0
    assert float(m1["stare/frac_reweighted"]) > 0  # omega is not trivially 1
    np.testing.assert_array_equal(np.asarray(m1["debug/omega"])[lm], np.asarray(m2["debug/omega"])[lm])
    for k in ("loss", "entropy", "grad_norm"):
        assert float(m1[k]) == pytest.approx(float(m2[k]), rel=1e-6, abs=1e-7), k
    np.testing.assert_allclose(_flat(ts1.params), _flat(ts2.params), rtol=0, atol=1e-7)
    assert float(ss1.w) == float(ss2.w) and bool(ss1.gate_on) == bool(ss2.gate_on)


def test_gate_entropy_is_the_mean_over_model_tokens(step_and_state):
    graphdef, ts, step = step_and_state
    b = _obs_batch(seed=2)
    _, _, met = step(ts, b, init_stare_state(STEP.stare))
    model = nnx.merge(graphdef, ts.params, ts.rest)
    logits = np.asarray(
        model(jnp.asarray(b["input_ids_BxT"]), attention_mask=jnp.asarray(b["attention_mask_BxT"])), np.float64
    )[:, :-1]
    logp = logits - logits.max(-1, keepdims=True)
    logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
    ent = -(np.exp(logp) * logp).sum(-1)
    model_tok = b["response_mask_BxT"][:, 1:] * b["attention_mask_BxT"][:, 1:]
    with_obs = model_tok.copy()
    with_obs[:, -4:] = 1
    ref = (ent * model_tok).sum() / model_tok.sum()
    np.testing.assert_allclose(float(met["entropy"]), ref, rtol=1e-5)
    assert abs(ref - (ent * with_obs).sum() / with_obs.sum()) > 1e-4  # the observation tokens would change it


def test_loss_gradient_through_observation_log_probs_is_zero():
    rng = np.random.default_rng(0)
    lp = jnp.asarray(rng.normal(-2, 0.5, (4, 10)), jnp.float32)
    old = lp + 0.05 * jnp.asarray(rng.normal(size=(4, 10)), jnp.float32)
    adv = jnp.asarray([1.0, -1.0, 0.5, -0.5])
    mask = np.ones((4, 10), np.float32)
    mask[:, 3:6] = 0  # observation tokens
    g = jax.grad(lambda x: policy_loss(x, old, adv, jnp.asarray(mask))[0])(lp)
    assert np.all(np.asarray(g)[mask == 0] == 0) and np.any(np.asarray(g)[mask > 0] != 0)


def test_train_batch_from_rollouts_model_mask():
    prompt = np.array([[0, 5, 6]], np.int32)
    r = Rollouts(
        prompt,
        (prompt > 0).astype(np.int32),
        np.array([[[7, 8, 9, 0]]], np.int32),
        np.array([[3]]),
        np.zeros((1, 1), np.float32),
    )
    plain = train_batch_from_rollouts(r, np.ones((1, 1)))
    assert plain["response_mask_BxT"].tolist() == [[0, 0, 0, 1, 1, 1, 0]]
    tool = train_batch_from_rollouts(
        dataclasses.replace(r, model_mask_PxGxN=np.array([[[1, 0, 1, 0]]])), np.ones((1, 1))
    )
    assert tool["response_mask_BxT"].tolist() == [[0, 0, 0, 1, 0, 1, 0]]
    assert tool["attention_mask_BxT"].tolist() == plain["attention_mask_BxT"].tolist() == [[0, 1, 1, 1, 1, 1, 0]]


def test_rl_loop_collects_tool_rollouts_and_records_tool_metrics(tmp_path):
    """`stare-jax train` on the tiny toy with tool.enabled: the collect stage runs tool_rollouts through the
    engine and the sandbox pool, and every step record has the tool metrics (the toy model makes no calls)."""
    run = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "stare_jax.cli",
        "train",
        "--config",
        str(REPO / "configs/tiny_cpu_stare.yaml"),
        "--run-dir",
        str(run),
        f"toy.cache_dir={tmp_path / 'toy'}",
        "total_steps=2",
        "toy.hidden_size=32",
        "toy.num_layers=2",
        "toy.sft_steps=5",
        "toy.num_train=200",
        "toy.num_eval=8",
        "rl.train_batch_size=4",
        "rl.group_size=4",
        "rl.gen_batch_size=8",
        "rl.micro_batch_size=8",
        "rl.dynamic_sampling=false",
        "logging.eval_every_steps=0",
        "logging.tensorboard=false",
        "logging.progress_bar=false",
        "checkpoint.every_steps=0",
        "sampling.engine.enabled=true",
        "tool.enabled=true",
        "tool.max_turns=2",
    ]
    env = cli_env()
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    recs = read_metrics(run, drop_timing=False)
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:
        assert r["tool/calls_per_response"] >= 0 and 0 <= r["tool/observation_token_frac"] <= 1
        assert r["tool/turns_per_response"] >= 1 and r["response_len_mean"] > 0
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert cfg["tool"]["enabled"] is True


def test_tool_rollouts_need_the_engine(tmp_path):
    cfg = load_config(None, ["tool.enabled=true"])
    with pytest.raises(TrainingError, match="sampling.engine.enabled=true"):
        make_tool_pool(cfg, object())
    assert make_tool_pool(load_config(None, []), object()) is None


@pytest.mark.slow
def test_smollm2_gsm8k_tool_rollouts_two_steps(tmp_path):
    """SmolLM2-135M-Instruct on GSM8K rows with tool.enabled (hermes format; its tokenizer splits </tool_call>
    into several tokens, so the stop-on-last-token path runs): two STARE steps log finite metrics and the tool
    entries. Prints the step times."""
    pytest.importorskip("transformers")
    model_dir = REPO / ".cache" / "smollm2-135m-instruct-hf"
    data = REPO.parent / "shared" / "data" / "math" / "gsm8k_test.jsonl"
    if not (model_dir / "config.json").is_file() or not data.is_file():
        pytest.skip(f"needs {model_dir} (stare-jax smollm2 {model_dir}) and {data}")
    run = tmp_path / "smol"
    env = cli_env()
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "stare_jax.cli",
            "train",
            "--config",
            str(REPO / "configs/smollm2_gsm8k_smoke.yaml"),
            "--run-dir",
            str(run),
            f"model.path={model_dir}",
            f"data.train_path={data}",
            "logging.progress_bar=false",
            "sampling.engine.enabled=true",
            "tool.enabled=true",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    recs = read_metrics(run, drop_timing=False)
    assert [r["step"] for r in recs] == [1, 2]
    for r in recs:
        assert np.isfinite(r["entropy"]) and r["tool/turns_per_response"] >= 1
        print(
            f"step {r['step']}: {r['step_time_s']:.1f} s (generation {r['gen_time_s']:.1f} s), "
            f"tool calls/response {r['tool/calls_per_response']:.2f}, "
            f"observation-token fraction {r['tool/observation_token_frac']:.3f}"
        )


def test_eval_cli_runs_multi_turn_with_the_tool(tokenizer, tmp_path):
    """`stare-jax eval --tool on`: the benchmark prompts go through the engine's multi-turn rollouts and the sandbox
    (the bigram model closes the call the raw prompt opens, the interpreter answers 42, the model ends its turn), and
    the output has the tool row: one call per response, none errored or timed out, two turns per response."""
    folder = tmp_path / "model"
    shutil.copytree(pathlib.Path(tokenizer.name_or_path), folder)
    model = _bigram_model(tokenizer, {"}": "</tool_call>", ")": "</code>"}, default="<|im_end|>")
    save_pretrained(model, folder)
    data = tmp_path / "data"
    data.mkdir()
    problem = CALL.format(name="code_interpreter", code="print(6 * 7)").split("assistant\n", 1)[1]
    (data / "math500.jsonl").write_text(
        "".join(json.dumps({"id": str(i), "problem": problem, "answer": "42"}) + "\n" for i in range(2))
    )
    out = tmp_path / "eval"
    cmd = [
        sys.executable,
        "-m",
        "stare_jax.cli",
        "eval",
        "--checkpoint",
        str(folder),
        "--benchmarks",
        "math500",
        "--data-dir",
        str(data),
        "--n",
        "2",
        "--max-new-tokens",
        "96",
        "--max-prompt-len",
        "128",
        "--prompt-template",
        "raw",
        "--slots",
        "4",
        "--workers",
        "1",
        "--out",
        str(out),
        "--tool",
        "on",
        "tool.timeout_s=5",
        "tool.max_turns=2",
    ]
    env = cli_env()
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "multi-turn with the code interpreter (hermes, up to 2 calls, local sandbox)" in p.stderr
    results = json.loads((out / "eval.json").read_text())
    assert results["math500"]["n_samples"] == 2
    t = results["tool"]
    assert t["tool/calls_per_response"] == 1.0 and t["tool/calls"] == 4.0
    assert t["tool/errored_calls"] == 0.0 and t["tool/timeout_calls"] == 0.0 and t["tool/turns_per_response"] == 2.0
    assert 0 < t["tool/observation_token_frac"] < 1 and t["tool/with_tool_frac"] == 1.0
    assert "| all (tool use) | 1.0000 |" in (out / "eval.md").read_text()


def test_eval_tool_section_and_bad_input(tmp_path, capsys, shared_data_dir):
    """--tool auto takes the tool section of --config (else of a run folder's config.yaml, else the defaults),
    tool.KEY=VALUE overrides on top; other overrides and --tool on without the engine are one-line errors."""
    from stare_jax import cli
    from stare_jax.cli.eval import tool_config

    def resolve(*argv, checkpoint=tmp_path):
        args = cli.build_parser().parse_args(["eval", "--checkpoint", str(checkpoint), *argv])
        return tool_config(args, checkpoint)

    assert resolve() == ToolConfig()
    paper = REPO / "configs/paper/qwen2.5-7b-tool_stare_o1.yaml"
    t = resolve("--config", str(paper), "tool.max_turns=3")
    assert t.enabled and t.max_turns == 3 and t.timeout_s == 10.0
    assert resolve("--config", str(paper), "--tool", "off") == ToolConfig()
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text("tool: {enabled: true, format: retool}\n")
    assert resolve(checkpoint=run) == ToolConfig(enabled=True, format="retool")
    assert resolve("--tool", "on").enabled
    assert (
        cli.main(
            [
                "eval",
                "--checkpoint",
                str(tmp_path),
                "--benchmarks",
                "math500",
                "--data-dir",
                str(shared_data_dir / "math"),
                "rl.lr=1",
            ]
        )
        == 2
    )
    assert "eval takes tool.KEY=VALUE overrides only, got rl.lr=1" in capsys.readouterr().err
    assert (
        cli.main(
            [
                "eval",
                "--checkpoint",
                str(tmp_path),
                "--benchmarks",
                "math500",
                "--data-dir",
                str(shared_data_dir / "math"),
                "--tool",
                "on",
                "--engine",
                "off",
            ]
        )
        == 2
    )
    assert (
        "multi-turn tool rollouts (--tool on, or tool.enabled in the tool section) need the rollout engine"
        in capsys.readouterr().err
    )
