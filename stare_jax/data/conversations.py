"""Multi-turn conversations (OpenAI messages) for supervised fine-tuning: read, check, render, mask, truncate.

A row of a conversation jsonl is either a JSON object {"messages": [...], "tools": [...] (optional)} (the layout
ReTool-SFT and OpenAI fine-tuning files use) or a bare JSON array of messages. Roles: system, user, assistant,
tool; an assistant message may carry OpenAI `tool_calls` ([{"type": "function", "function": {"name", "arguments"}}],
`arguments` a JSON object or a JSON string, parsed here so the chat template writes it as an object, which is what
the RL rollout's hermes parser reads back: stare_jax/tools/calls.py).

`render_conversation` renders a conversation with the model's own chat template (the tokenizer's
`apply_chat_template`, HF semantics) and marks the tokens the model is trained on: every token of an assistant
turn's generated part, i.e. from the end of the generation prompt (`<|im_start|>assistant\\n` for Qwen2.5) up to
and including the turn's end-of-turn token (`<|im_end|>`), tool-call text included. System, user and tool
(`<tool_response>`) tokens and the template's text after the end-of-turn token (Qwen's "\\n", which the model never
generates) get mask 0. The spans come from re-rendering prefixes of the conversation, which works for any template
whose rendering of a prefix is a prefix of the rendering of the whole (checked: an error says so otherwise).
"""

from __future__ import annotations

import copy
import json
import pathlib
from typing import Any, Literal, Sequence

import numpy as np
from etils import epath

from stare_jax.data.jsonl import DataError, iter_jsonl_values

__all__ = [
    "ROLES",
    "Conversation",
    "RenderedConversation",
    "read_conversations",
    "check_messages",
    "render_conversation",
    "truncate",
    "assistant_char_spans",
    "end_of_turn_texts",
]

ROLES = ("system", "user", "assistant", "tool")


class Conversation:
    """One checked row: its messages (tool-call arguments parsed to objects), its own tool schemas (or None) and
    where it came from ('file:line')."""

    __slots__ = ("messages", "tools", "where")

    def __init__(self, messages: list[dict], tools: list[dict] | None, where: str):
        self.messages, self.tools, self.where = messages, tools, where


class RenderedConversation:
    """Token ids [T] and the 0/1 loss mask [T] (1 = an assistant token the model is trained to predict)."""

    __slots__ = ("ids", "mask", "where")

    def __init__(self, ids: np.ndarray, mask: np.ndarray, where: str):
        self.ids, self.mask, self.where = ids, mask, where


def _check_tool_call(call: Any, where: str, m: int, c: int) -> dict:
    """One OpenAI tool call with `arguments` parsed to a JSON object (a copy)."""
    here = f"{where}: message {m} tool_calls[{c}]"
    if not isinstance(call, dict):
        raise DataError(f"{here}: expected an object, got {type(call).__name__}")
    call = copy.deepcopy(call)
    fn = call.get("function", call)  # OpenAI nests name/arguments under "function"; accept them flat too
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise DataError(f'{here}: needs a function name ("function": {{"name": ..., "arguments": ...}})')
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise DataError(f"{here}: 'arguments' is a string that is not JSON ({e.msg})") from None
    if not isinstance(args, dict):
        raise DataError(f"{here}: 'arguments' must be a JSON object, got {type(args).__name__}")
    fn["arguments"] = args
    return call


def check_messages(messages: Any, where: str) -> list[dict]:
    """The messages of one row, checked (DataError naming `where` otherwise): a non-empty list of objects with a
    known role and string content; a tool message answers a pending call of an earlier assistant message; at least
    one assistant message. Returns copies, assistant tool-call arguments parsed, content None -> ''."""
    if not isinstance(messages, list) or not messages:
        raise DataError(
            f"{where}: expected a non-empty list of messages, got {type(messages).__name__}"
            f"{'' if messages else ' (empty)'}"
        )
    out, pending, n_assistant = [], 0, 0
    for m, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise DataError(f"{where}: message {m} is {type(msg).__name__}, not an object with 'role' and 'content'")
        role = msg.get("role")
        if role not in ROLES:
            raise DataError(f"{where}: message {m} has unknown role {role!r}; accepted: {', '.join(ROLES)}")
        msg = dict(msg)
        calls = msg.get("tool_calls") or []
        if calls and role != "assistant":
            raise DataError(f"{where}: message {m} ({role}) has tool_calls; only assistant messages may")
        if msg.get("content") is None and (role == "assistant" and calls):
            msg["content"] = ""
        if not isinstance(msg.get("content"), str):
            raise DataError(
                f"{where}: message {m} ({role}) needs string 'content', got {type(msg.get('content')).__name__}"
            )
        if role == "assistant":
            n_assistant += 1
            if not isinstance(calls, list):
                raise DataError(f"{where}: message {m} 'tool_calls' must be a list")
            msg["tool_calls"] = [_check_tool_call(c, where, m, i) for i, c in enumerate(calls)]
            if not msg["tool_calls"]:
                msg.pop("tool_calls")
            pending = len(calls)
        elif role == "tool":
            if pending == 0:
                raise DataError(
                    f"{where}: message {m} is a tool reply with no preceding assistant tool call "
                    f"(each tool message answers one entry of the previous assistant's tool_calls)"
                )
            pending -= 1
        else:
            pending = 0
        out.append(msg)
    if n_assistant == 0:
        raise DataError(f"{where}: the conversation has no assistant message (nothing to train on)")
    return out


def read_conversations(path: str | pathlib.Path) -> list[Conversation]:
    """Every row of a conversation jsonl, checked; DataError naming the file and line for a bad row."""
    file = epath.Path(path)
    if not file.is_file():
        raise DataError(f"conversation file not found: {file}")
    rows = []
    for lineno, obj in iter_jsonl_values(file):
        where = f"{file}:{lineno}"
        tools = None
        if isinstance(obj, dict):
            if "messages" not in obj:
                raise DataError(
                    f'{where}: expected {{"messages": [...]}} or a list of messages; the object has '
                    f"keys {', '.join(map(str, obj)) or 'none'}"
                )
            tools = obj.get("tools")
            if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
                raise DataError(f"{where}: 'tools' must be a list of tool schemas (objects)")
            obj = obj["messages"]
        rows.append(Conversation(check_messages(obj, where), tools or None, where))
    if not rows:
        raise DataError(f"{file}: no conversations")
    return rows


def _prefix_len(full: str, part: str, where: str, what: str) -> int:
    if not full.startswith(part):
        raise DataError(
            f"{where}: the chat template's rendering of {what} is not a prefix of the whole "
            f"conversation's, so assistant turns cannot be located by re-rendering prefixes"
        )
    return len(part)


def assistant_char_spans(
    apply_template,
    messages: list[dict],
    end_texts: Sequence[str],
    where: str = "?",
) -> tuple[str, list[tuple[int, int]]]:
    """(rendered text, [start, end) character spans of the trained part of each assistant turn).

    apply_template(messages, add_generation_prompt) -> str. A turn's span starts after the rendering of the
    messages before it with the generation prompt and ends after the last end-of-turn text (`end_texts`, e.g.
    '<|im_end|>') inside the turn's own rendering (at the rendering's end when it has none)."""
    full = apply_template(messages, False)
    spans = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        start = _prefix_len(full, apply_template(messages[:i], True), where, f"messages 0..{i - 1} + generation prompt")
        stop = _prefix_len(full, apply_template(messages[: i + 1], False), where, f"messages 0..{i}")
        turn = full[start:stop]
        ends = [turn.rfind(e) + len(e) for e in end_texts if e and e in turn]
        spans.append((start, start + max(ends) if ends else stop))
    return full, spans


def end_of_turn_texts(tokenizer) -> list[str]:
    """The texts that end an assistant turn: the tokenizer's eos tokens, plus '<|im_end|>' when the vocabulary has
    it (Qwen2.5 base models' eos is <|endoftext|>, yet their chat template ends every turn with <|im_end|>)."""
    texts = [t for t in (tokenizer.id_to_token(i) for i in tokenizer.eos_ids) if t]
    if "<|im_end|>" not in texts and tokenizer.token_to_id("<|im_end|>") is not None:
        texts.append("<|im_end|>")
    return texts


def render_conversation(tokenizer, conv: Conversation, tools: Sequence[dict] | None = None) -> RenderedConversation:
    """Token ids and loss mask of one conversation under the tokenizer's chat template (HF apply_chat_template
    semantics: the rendered text is tokenized with no added special tokens). `tools` (schemas listed by the
    template; the row's own `tools` win) as in the RL prompts. A token is trained iff its first character lies in
    an assistant span (assistant_char_spans). Needs a tokenizer that reports character offsets (HF tokenizer.json)."""
    extra = {"tools": list(conv.tools or tools or [])} if (conv.tools or tools) else {}

    def apply(msgs, gen):
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=gen, **extra)

    text, spans = assistant_char_spans(apply, conv.messages, end_of_turn_texts(tokenizer), conv.where)
    backend = getattr(tokenizer, "backend", None)
    if backend is None or not hasattr(backend, "encode"):
        raise DataError(f"{conv.where}: conversation SFT needs a Hugging Face tokenizer.json (character offsets)")
    enc = backend.encode(text, add_special_tokens=False)
    ids = np.asarray(enc.ids, np.int32)
    starts = np.asarray([s for s, _ in enc.offsets], np.int64)
    mask = np.zeros(len(ids), np.int32)
    for a, b in spans:
        mask[(starts >= a) & (starts < b)] = 1
    if not mask.any():
        raise DataError(f"{conv.where}: the rendered conversation has no assistant token")
    return RenderedConversation(ids, mask, conv.where)


def truncate(
    r: RenderedConversation, max_len: int, rule: Literal["right", "drop", "error"]
) -> RenderedConversation | None:
    """The rule for a conversation longer than max_len tokens: 'right' keeps its first max_len tokens (the loss is
    on the assistant tokens that remain; None when none remain), 'drop' skips it (None), 'error' raises DataError."""
    if len(r.ids) <= max_len:
        return r
    if rule == "error":
        raise DataError(f"{r.where}: the conversation has {len(r.ids)} tokens > max_len {max_len}")
    if rule == "drop":
        return None
    kept = RenderedConversation(r.ids[:max_len], r.mask[:max_len], r.where)
    return kept if kept.mask.any() else None
