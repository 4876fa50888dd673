"""Tool calls in model text: the stop condition, the parse, and the observation text - pure functions.

Two formats (ToolConfig.format):

hermes (Qwen2.5's default tool format):
    ...<tool_call>
    {"name": "code_interpreter", "arguments": {"code": "print(1)"}}
    </tool_call>
  the reply goes back as a tool message, which Qwen2.5's chat template renders as a user turn:
    <|im_end|>\\n<|im_start|>user\\n<tool_response>\\n{output}\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n
  (`observation_format_from_template` derives that wrapper from any model's own chat template).
retool (ReTool's format):
    ...<code>
    ```python
    print(1)
    ```
    </code>
  answered by  \\n<interpreter>\\n{output}\\n</interpreter>\\n  (the fences inside <code> are optional).

The rollout stops a row on `stop_strings(fmt)`; `ends_with_call(text, fmt)` says whether the text now ends with a
complete call, `parse_call` extracts it (the last one), `observation` renders what goes back. Bad input is never an
exception: invalid JSON, an unknown tool name, missing or non-string code, empty code and a call past max_turns
each get a CallStatus (counted by `status_counts`) and an observation text saying what was wrong; the code is then
not run. Model text is only parsed here, never evaluated.
"""

from __future__ import annotations

import enum
import json
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from stare_jax.tools.sandbox import ExecResult

__all__ = [
    "CallFormat",
    "CallStatus",
    "ToolCall",
    "ObservationFormat",
    "HERMES_QWEN25",
    "RETOOL",
    "call_tags",
    "ends_inside_call",
    "stop_strings",
    "ends_with_call",
    "parse_call",
    "result_status",
    "observation",
    "observation_content",
    "observation_format_from_template",
    "status_counts",
    "CODE_TOOL",
    "CODE_TOOL_SCHEMA",
]

CallFormat = Literal["hermes", "retool"]
CODE_TOOL = "code_interpreter"
_TAGS = {"hermes": ("<tool_call>", "</tool_call>"), "retool": ("<code>", "</code>")}
_FENCE = re.compile(r"\A\s*```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)\n?[ \t]*```\s*\Z", re.DOTALL | re.IGNORECASE)


CODE_TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": CODE_TOOL,
        "description": "Runs Python code in a sandbox and returns what it prints (stdout, then stderr).",
        "parameters": {
            "type": "object",
            "properties": {
                "code": {"type": "string", "description": "The Python code to run; print what you need to see."}
            },
            "required": ["code"],
        },
    },
}


class CallStatus(str, enum.Enum):
    """What became of one tool call. The parse statuses (the code is not run) come from parse_call; the run
    statuses from result_status."""

    OK = "ok"  # parsed, ran, exit status 0
    INVALID_JSON = "invalid_json"  # hermes: the call's body is not a JSON object
    UNKNOWN_TOOL = "unknown_tool"  # hermes: "name" is not a known tool
    BAD_ARGUMENTS = "bad_arguments"  # hermes: no "arguments" mapping with a string "code"
    EMPTY_CODE = "empty_code"  # the code is empty or only whitespace
    MAX_TURNS = "max_turns"  # the response already made max_turns calls
    ERROR = "error"  # ran, non-zero exit status (exception, syntax error, killed)
    TIMEOUT = "timeout"  # ran, stopped by the wall timeout or the CPU limit
    SANDBOX_ERROR = "sandbox_error"  # the sandbox (or its HTTP backend) failed; the code may not have run

    @property
    def ran(self) -> bool:
        return self in (CallStatus.OK, CallStatus.ERROR, CallStatus.TIMEOUT, CallStatus.SANDBOX_ERROR)


@dataclass(frozen=True)
class ToolCall:
    """One parsed call. `code` is set only when status is OK (the code is to be run); `problem` says what was
    wrong otherwise; `start` / `end` are the call's span in the text (opening tag to closing tag)."""

    status: CallStatus
    code: str | None
    name: str | None
    problem: str | None
    start: int
    end: int


@dataclass(frozen=True)
class ObservationFormat:
    """The text around an observation's content: appended after the model's closing tag."""

    prefix: str
    suffix: str

    def wrap(self, content: str) -> str:
        return self.prefix + content + self.suffix


HERMES_QWEN25 = ObservationFormat(
    "<|im_end|>\n<|im_start|>user\n<tool_response>\n", "\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
)
RETOOL = ObservationFormat("\n<interpreter>\n", "\n</interpreter>\n")
_DEFAULT_FORMATS = {"hermes": HERMES_QWEN25, "retool": RETOOL}


def call_tags(fmt: CallFormat) -> tuple[str, str]:
    """(opening tag, closing tag) of a call in the format."""
    return _TAGS[fmt]


def ends_inside_call(text: str, fmt: CallFormat) -> bool:
    """True when `text` has an opening tag after its last closing tag (e.g. a prompt that starts a call for the
    model to finish)."""
    open_tag, close_tag = _TAGS[fmt]
    return text.rfind(open_tag) > text.rfind(close_tag)


def stop_strings(fmt: CallFormat) -> tuple[str, ...]:
    """Where generation pauses for the tool: the closing tag of a call."""
    return (_TAGS[fmt][1],)


def _last_call_span(text: str, fmt: CallFormat) -> tuple[int, int, int, int] | None:
    """(start of the opening tag, start of the body, end of the body, end of the closing tag) of the call the
    text ends with (trailing whitespace allowed), or None."""
    open_tag, close_tag = _TAGS[fmt]
    stripped = text.rstrip()
    if not stripped.endswith(close_tag):
        return None
    body_end = len(stripped) - len(close_tag)
    start = stripped.rfind(open_tag, 0, body_end)
    if start < 0:
        return None
    return start, start + len(open_tag), body_end, len(stripped)


def ends_with_call(text: str, fmt: CallFormat) -> bool:
    """True when `text` ends (up to whitespace) with a complete call: an opening tag, then the closing tag."""
    return _last_call_span(text, fmt) is not None


def _parse_hermes(body: str, tools: Sequence[str]) -> tuple[CallStatus, str | None, str | None, str | None]:
    """(status, name, code, problem) of a hermes call body. JSON strings may hold raw newlines and tabs (models
    write code that way): the body is parsed with strict=False."""
    try:
        obj = json.loads(body, strict=False)
    except ValueError as e:
        return CallStatus.INVALID_JSON, None, None, f"the tool call is not valid JSON ({e})"
    if not isinstance(obj, dict):
        return CallStatus.INVALID_JSON, None, None, f"the tool call must be a JSON object, got {type(obj).__name__}"
    name = obj.get("name")
    if name not in tools:
        known = ", ".join(tools)
        return CallStatus.UNKNOWN_TOOL, None, None, f"unknown tool {name!r}; available tools: {known}"
    args = obj.get("arguments", obj.get("parameters"))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args, strict=False)
        except ValueError:
            pass
    code = args.get("code") if isinstance(args, dict) else None
    if not isinstance(code, str):
        return (
            CallStatus.BAD_ARGUMENTS,
            name,
            None,
            f'the {name} call needs "arguments": {{"code": "<python source>"}}',
        )
    return CallStatus.OK, name, code, None


def _strip_fences(body: str) -> str:
    m = _FENCE.match(body)
    return m.group(1) if m else body.strip("\n")


def parse_call(
    text: str, fmt: CallFormat, *, calls_so_far: int, max_turns: int, tools: Sequence[str] = (CODE_TOOL,)
) -> ToolCall | None:
    """The call `text` ends with (None when it ends with none). `calls_so_far`: calls this response already made
    (parsed ones, good or bad); at max_turns or more the call is refused (MAX_TURNS) whatever it holds."""
    span = _last_call_span(text, fmt)
    if span is None:
        return None
    start, body_start, body_end, end = span
    body = text[body_start:body_end]
    if calls_so_far >= max_turns:
        return ToolCall(
            CallStatus.MAX_TURNS,
            None,
            None,
            f"the limit of {max_turns} tool calls per response is reached; the code was not run",
            start,
            end,
        )
    if fmt == "hermes":
        status, name, code, problem = _parse_hermes(body, tools)
    else:
        status, name, code, problem = CallStatus.OK, CODE_TOOL, _strip_fences(body), None
    if status is CallStatus.OK and not (code or "").strip():
        status, code, problem = CallStatus.EMPTY_CODE, None, "the code is empty; nothing was run"
    return ToolCall(status, code if status is CallStatus.OK else None, name, problem, start, end)


def result_status(result: ExecResult) -> CallStatus:
    """The run status of an executed call."""
    if result.error is not None:
        return CallStatus.SANDBOX_ERROR
    if result.timed_out:
        return CallStatus.TIMEOUT
    return CallStatus.OK if result.exit_code == 0 else CallStatus.ERROR


def observation_content(
    call: ToolCall, result: ExecResult | None = None, *, empty: str = "(no output)", timeout_s: float | None = None
) -> str:
    """What the interpreter says back, before wrapping: the output (stdout, then stderr), with a line for a
    timeout, a cut output or a sandbox failure; for a refused call, the problem."""
    if call.status is not CallStatus.OK:
        return f"Error: {call.problem}."
    if result is None:
        raise ValueError("observation_content: a call with status OK needs its ExecResult")
    parts = [p for p in (result.stdout, result.stderr) if p]
    text = "\n".join(p.rstrip("\n") for p in parts)
    notes = []
    if result.truncated:
        notes.append("[output truncated]")
    if result.timed_out:
        limit = f" after {timeout_s:g} s" if timeout_s is not None else ""
        notes.append(
            f"[timed out{limit}: the code was stopped]"
            if result.killed_by != "cpu_limit"
            else "[CPU time limit reached: the code was stopped]"
        )
    elif result.killed_by == "output_limit":
        notes.append("[too much output: the code was stopped]")
    if result.error is not None:
        notes.append(f"[sandbox error: {result.error}]")
    text = "\n".join([t for t in [text] if t] + notes)
    return text or empty


def observation(
    call: ToolCall,
    result: ExecResult | None,
    fmt: CallFormat,
    *,
    wrapper: ObservationFormat | None = None,
    empty: str = "(no output)",
    timeout_s: float | None = None,
) -> str:
    """The observation text appended after the call: the content wrapped for the format (hermes: the default
    Qwen2.5 tool turn, or `wrapper` from observation_format_from_template; retool: <interpreter> tags)."""
    return (wrapper or _DEFAULT_FORMATS[fmt]).wrap(observation_content(call, result, empty=empty, timeout_s=timeout_s))


def observation_format_from_template(render: Callable[[list[dict[str, Any]], bool], str]) -> ObservationFormat:
    """The wrapper a chat template puts around a tool message between an assistant turn (that stopped after its
    call) and the next assistant turn: `render(messages, add_generation_prompt)` renders a conversation with the
    model's own template (e.g. `lambda m, g: tokenizer.apply_chat_template(m, add_generation_prompt=g)`)."""
    reply, tool = "\x00assistant-sentinel\x00", "\x00tool-sentinel\x00"
    text = render(
        [
            {"role": "user", "content": "question"},
            {"role": "assistant", "content": reply},
            {"role": "tool", "content": tool},
        ],
        True,
    )
    i, j = text.find(reply), text.find(tool)
    if i < 0 or j < i:
        raise ValueError(
            "observation_format_from_template: the template did not render the assistant and tool messages in order"
        )
    return ObservationFormat(text[i + len(reply) : j], text[j + len(tool) :])


def status_counts(statuses: Iterable[CallStatus | str]) -> dict[str, int]:
    """{"tool_calls": n, "tool_calls_<status>": n for every status (zeros included)} for the metrics."""
    counts = {f"tool_calls_{s.value}": 0 for s in CallStatus}
    n = 0
    for s in statuses:
        counts[f"tool_calls_{CallStatus(s).value}"] += 1
        n += 1
    return {"tool_calls": n, **counts}
