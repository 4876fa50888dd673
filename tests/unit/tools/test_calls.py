"""Tool calls in model text (stare_jax.tools.calls): the stop condition, the parse in both formats, the observation
text, and bad input (invalid JSON, unknown tool, bad arguments, empty code, past max_turns) as defined statuses
and observations, never exceptions. The hermes wrapper is checked against the real Qwen2.5-Instruct chat template
(rendered by stare_jax.data.tokenizer), and one end-to-end call runs the parsed code in the real sandbox."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings, strategies as st

from stare_jax.data.tokenizer import render_chat_template
from stare_jax.tools import ExecResult, run_python, sandbox_capabilities
from stare_jax.tools.calls import (
    HERMES_QWEN25,
    RETOOL,
    CallStatus,
    ObservationFormat,
    ToolCall,
    ends_with_call,
    observation,
    observation_content,
    observation_format_from_template,
    parse_call,
    result_status,
    status_counts,
    stop_strings,
)


def hermes(obj) -> str:
    body = obj if isinstance(obj, str) else json.dumps(obj)
    return f"Let me compute.\n<tool_call>\n{body}\n</tool_call>"


def call(code: str) -> dict:
    return {"name": "code_interpreter", "arguments": {"code": code}}


def ok_result(stdout="", stderr="", exit_code=0, **kw) -> ExecResult:
    return ExecResult(stdout, stderr, exit_code, kw.pop("timed_out", False), kw.pop("truncated", False), **kw)


# ------------------------------------------------------------------------------------------------ stop condition
def test_stop_strings():
    assert stop_strings("hermes") == ("</tool_call>",)
    assert stop_strings("retool") == ("</code>",)


@pytest.mark.parametrize(
    "text, fmt, expected",
    [
        (hermes(call("print(1)")), "hermes", True),
        (hermes(call("print(1)")) + "\n  \n", "hermes", True),  # trailing whitespace
        ("<tool_call>{}</tool_call>", "hermes", True),  # complete, if empty: the parse reports the problem
        ("text </tool_call>", "hermes", False),  # no opening tag
        ('<tool_call>{"name": "code_interpreter", "arg', "hermes", False),  # still generating
        (hermes(call("print(1)")) + " and then some prose", "hermes", False),  # the call is not at the end
        ("The answer is \\boxed{3}.", "hermes", False),
        ("<code>\n```python\nprint(1)\n```\n</code>", "retool", True),
        ("<code>print(1)", "retool", False),
        (hermes(call("print(1)")), "retool", False),
        ("<code>x</code>", "hermes", False),
    ],
)
def test_ends_with_call(text, fmt, expected):
    assert ends_with_call(text, fmt) is expected
    assert (parse_call(text, fmt, calls_so_far=0, max_turns=4) is not None) is expected


# ------------------------------------------------------------------------------------------------ parsing
def test_hermes_call_parsed():
    text = hermes(call("x = 2 ** 10\nprint(x)"))
    c = parse_call(text, "hermes", calls_so_far=0, max_turns=4)
    assert c == ToolCall(
        CallStatus.OK, "x = 2 ** 10\nprint(x)", "code_interpreter", None, text.index("<tool_call>"), len(text)
    )
    assert text[c.start : c.end].startswith("<tool_call>") and text[c.start : c.end].endswith("</tool_call>")


def test_hermes_lenient_forms():
    # raw newlines and tabs inside the JSON string (how models write code), arguments given as a JSON string
    raw = '{"name": "code_interpreter", "arguments": {"code": "for i in range(2):\n\tprint(i)"}}'
    assert parse_call(hermes(raw), "hermes", calls_so_far=0, max_turns=1).code == "for i in range(2):\n\tprint(i)"
    as_string = {"name": "code_interpreter", "arguments": json.dumps({"code": "print(3)"})}
    assert parse_call(hermes(as_string), "hermes", calls_so_far=0, max_turns=1).code == "print(3)"
    # two calls in the text: the last one (the one the text ends with) is the call
    two = hermes(call("print('first')")) + "\nand\n" + hermes(call("print('second')"))
    assert parse_call(two, "hermes", calls_so_far=1, max_turns=4).code == "print('second')"


@pytest.mark.parametrize(
    "body, status, words",
    [
        ('{"name": "code_interpreter", "arguments": {"code": "print(1)"', CallStatus.INVALID_JSON, "not valid JSON"),
        ("print(1)", CallStatus.INVALID_JSON, "not valid JSON"),
        ('["code_interpreter", "print(1)"]', CallStatus.INVALID_JSON, "must be a JSON object, got list"),
        (
            '{"name": "web_search", "arguments": {"query": "x"}}',
            CallStatus.UNKNOWN_TOOL,
            "unknown tool 'web_search'; available tools: code_interpreter",
        ),
        ('{"arguments": {"code": "print(1)"}}', CallStatus.UNKNOWN_TOOL, "unknown tool None"),
        ('{"name": "code_interpreter"}', CallStatus.BAD_ARGUMENTS, '"arguments": {"code": "<python source>"}'),
        ('{"name": "code_interpreter", "arguments": {"code": 42}}', CallStatus.BAD_ARGUMENTS, "needs"),
        ('{"name": "code_interpreter", "arguments": "not json"}', CallStatus.BAD_ARGUMENTS, "needs"),
        ('{"name": "code_interpreter", "arguments": {"code": "  \\n "}}', CallStatus.EMPTY_CODE, "the code is empty"),
    ],
)
def test_hermes_bad_calls(body, status, words):
    c = parse_call(hermes(body), "hermes", calls_so_far=0, max_turns=4)
    assert c.status is status and c.code is None and words in c.problem
    obs = observation(c, None, "hermes")
    assert obs == HERMES_QWEN25.wrap(f"Error: {c.problem}.")


def test_past_max_turns():
    good = hermes(call("print(1)"))
    assert parse_call(good, "hermes", calls_so_far=3, max_turns=4).status is CallStatus.OK
    for calls_so_far, max_turns in ((4, 4), (7, 4), (0, 0)):
        c = parse_call(good, "hermes", calls_so_far=calls_so_far, max_turns=max_turns)
        assert c.status is CallStatus.MAX_TURNS and c.code is None
        assert observation_content(c) == (
            f"Error: the limit of {max_turns} tool calls per response is reached; the code was not run."
        )
    retool = parse_call("<code>print(1)</code>", "retool", calls_so_far=2, max_turns=2)
    assert retool.status is CallStatus.MAX_TURNS


@pytest.mark.parametrize(
    "body, code",
    [
        ("\n```python\nprint(1)\nprint(2)\n```\n", "print(1)\nprint(2)"),
        ("```py\nx = 1\n```", "x = 1"),
        ("\n```\nx = 1\n```\n", "x = 1"),
        ("\nprint('no fences')\n", "print('no fences')"),
        ("\n```Python3\nimport math\nprint(math.pi)\n```", "import math\nprint(math.pi)"),
    ],
)
def test_retool_call_parsed(body, code):
    text = f"I will check this numerically.\n<code>{body}</code>\n"
    c = parse_call(text, "retool", calls_so_far=0, max_turns=4)
    assert c.status is CallStatus.OK and c.code == code and c.name == "code_interpreter"
    assert text[c.start : c.end] == f"<code>{body}</code>"


@pytest.mark.parametrize("body", ["", "\n\n", "\n```python\n\n```\n"])
def test_retool_empty_code(body):
    c = parse_call(f"<code>{body}</code>", "retool", calls_so_far=0, max_turns=4)
    assert c.status is CallStatus.EMPTY_CODE and c.code is None
    assert observation(c, None, "retool") == RETOOL.wrap("Error: the code is empty; nothing was run.")


PIECES = list('<>/{}":,\\ \n`abcdeotlnmpr_[]0123456789') + [
    "<tool_call>",
    "</tool_call>",
    "<code>",
    "</code>",
    '"code"',
    '"name"',
    '"arguments"',
    "code_interpreter",
    "```",
]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(PIECES), max_size=40).map("".join),
    st.sampled_from(["hermes", "retool"]),
    st.integers(0, 5),
    st.integers(0, 5),
)
def test_any_text_gives_a_defined_outcome(text, fmt, calls_so_far, max_turns):
    """Whatever the model writes: None (no call) or a ToolCall with a status, and an observation; no exception."""
    c = parse_call(text, fmt, calls_so_far=calls_so_far, max_turns=max_turns)
    assert (c is not None) == ends_with_call(text, fmt)
    if c is None:
        return
    assert isinstance(c.status, CallStatus) and (c.code is not None) == (c.status is CallStatus.OK)
    assert (c.problem is None) == (c.status is CallStatus.OK)
    res = ok_result("out\n") if c.status is CallStatus.OK else None
    assert isinstance(observation(c, res, fmt), str)


# ------------------------------------------------------------------------------------------------ observations
def test_observation_formats():
    c = parse_call(hermes(call("print(2 + 2)")), "hermes", calls_so_far=0, max_turns=4)
    assert observation(c, ok_result("4\n"), "hermes") == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n4\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )
    r = parse_call("<code>print(4)</code>", "retool", calls_so_far=0, max_turns=4)
    assert observation(r, ok_result("4\n"), "retool") == "\n<interpreter>\n4\n</interpreter>\n"
    custom = ObservationFormat("[[", "]]")
    assert observation(r, ok_result("4\n"), "retool", wrapper=custom) == "[[4]]"


def test_observation_content_of_results():
    c = parse_call("<code>x</code>", "retool", calls_so_far=0, max_turns=4)
    assert observation_content(c, ok_result("")) == "(no output)"
    assert observation_content(c, ok_result(""), empty="") == ""
    tb = "Traceback (most recent call last):\n  ...\nZeroDivisionError: division by zero\n"
    assert observation_content(c, ok_result("partial\n", tb, exit_code=1)) == "partial\n" + tb.rstrip("\n")
    assert observation_content(c, ok_result("x" * 5, truncated=True)) == "xxxxx\n[output truncated]"
    assert (
        observation_content(c, ok_result("so far\n", exit_code=-9, timed_out=True, killed_by="timeout"), timeout_s=5.0)
        == "so far\n[timed out after 5 s: the code was stopped]"
    )
    assert observation_content(c, ok_result("", exit_code=-24, timed_out=True, killed_by="cpu_limit")) == (
        "[CPU time limit reached: the code was stopped]"
    )
    assert observation_content(c, ok_result("y" * 3, exit_code=-9, truncated=True, killed_by="output_limit")) == (
        "yyy\n[output truncated]\n[too much output: the code was stopped]"
    )
    err = ExecResult("", "", None, False, False, error="sandbox_fusion: HTTP 500 from http://x/run_code: boom")
    assert observation_content(c, err) == "[sandbox error: sandbox_fusion: HTTP 500 from http://x/run_code: boom]"
    with pytest.raises(ValueError, match="needs its ExecResult"):
        observation_content(c, None)


def test_result_status():
    assert result_status(ok_result("1\n")) is CallStatus.OK
    assert result_status(ok_result("", "Traceback", exit_code=1)) is CallStatus.ERROR
    assert result_status(ok_result("", exit_code=-11)) is CallStatus.ERROR
    assert result_status(ok_result("", exit_code=-9, timed_out=True)) is CallStatus.TIMEOUT
    assert result_status(ExecResult("", "", None, False, False, error="x")) is CallStatus.SANDBOX_ERROR
    assert [s.ran for s in (CallStatus.OK, CallStatus.TIMEOUT, CallStatus.INVALID_JSON, CallStatus.MAX_TURNS)] == [
        True,
        True,
        False,
        False,
    ]


def test_status_counts():
    counts = status_counts([CallStatus.OK, CallStatus.OK, "invalid_json", CallStatus.TIMEOUT])
    assert counts["tool_calls"] == 4 and counts["tool_calls_ok"] == 2
    assert counts["tool_calls_invalid_json"] == 1 and counts["tool_calls_timeout"] == 1
    assert set(counts) == {"tool_calls"} | {f"tool_calls_{s.value}" for s in CallStatus}
    assert status_counts([])["tool_calls_max_turns"] == 0


def test_wrapper_from_the_real_qwen25_template():
    """The Qwen2.5-Instruct chat template (the real one, kept in tests/support/tokenizers.py) renders a tool message
    exactly as HERMES_QWEN25 wraps it."""
    from support.tokenizers import QWEN25_TEMPLATE as template

    fmt = observation_format_from_template(
        lambda messages, gen: render_chat_template(template, messages, add_generation_prompt=gen)
    )
    assert fmt == HERMES_QWEN25
    assert observation_format_from_template(lambda m, g: "x".join(msg["content"] for msg in m)) == (
        ObservationFormat("x", "")
    )
    with pytest.raises(ValueError, match="in order"):
        observation_format_from_template(lambda m, g: "nothing rendered")


def test_retool_wrapper_is_the_interpreter_tags():
    assert RETOOL.wrap("7") == "\n<interpreter>\n7\n</interpreter>\n"


# ------------------------------------------------------------------------------------------------ end to end
def test_parsed_call_runs_in_the_sandbox():
    """A hermes call parsed from model text, run in the real sandbox (never in this process), and its observation;
    then a failing one."""
    if sandbox_capabilities()["isolation"] == "refused":
        pytest.skip("no sandbox here: " + "; ".join(sandbox_capabilities()["reasons"]))
    statuses = []
    for code, expect in (
        ("import math\nprint(math.factorial(10))", "3628800"),
        ("print(1 / 0)", "ZeroDivisionError: division by zero"),
    ):
        c = parse_call(hermes(call(code)), "hermes", calls_so_far=len(statuses), max_turns=4)
        res = run_python(c.code, timeout_s=5.0, memory_mb=512, max_output_bytes=4096)
        statuses.append(result_status(res))
        obs = observation(c, res, "hermes", timeout_s=5.0)
        assert obs.startswith(HERMES_QWEN25.prefix) and obs.endswith(HERMES_QWEN25.suffix) and expect in obs
    assert statuses == [CallStatus.OK, CallStatus.ERROR]
    assert status_counts(statuses)["tool_calls_error"] == 1
