"""\\boxed{...} answers in LaTeX text: the argument of the last well-formed \\boxed / \\fbox (nested braces, escapes
skipped), the one rule the math judge (stare_jax.rewards.math) scores responses with and `stare-jax data prepare`
(stare_jax.data.prepare) takes reference answers from solutions with. Plain string scanning, no imports: the
sandboxed reward workers load it."""

from __future__ import annotations

__all__ = ["MAX_BOX_TRIES", "box_content", "last_boxed", "scan_braced"]

# How many earlier \boxed candidates to try when the last one is malformed (each try is a linear scan).
MAX_BOX_TRIES = 3


def scan_braced(text: str, open_pos: int) -> int:
    """Index just past the '}' matching the '{' at open_pos, or -1 if unbalanced.  Linear; skips \\x escapes."""
    depth = 0
    i = open_pos
    n = len(text)
    while i < n:
        ch = text[i]
        if ch == "\\":
            i += 2
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return -1


def box_content(text: str, cmd_end: int) -> str | None:
    """Argument of a \\boxed / \\fbox whose name ends at cmd_end: `{...}` (nested) or a bare `\\boxed 5` token."""
    n = len(text)
    if cmd_end < n and text[cmd_end].isalpha():
        return None  # a different control word, e.g. \boxedfoo
    i = cmd_end
    while i < n and text[i] in " \t":
        i += 1
    if i >= n:
        return None
    if text[i] == "{":
        end = scan_braced(text, i)
        if end < 0:
            return None
        return text[i + 1 : end - 1]
    if i == cmd_end and not text[i].isdigit():
        return None  # `\boxed` followed directly by punctuation: not an argument
    j = i
    while j < n and not text[j].isspace() and text[j] != "$":
        j += 1
    return text[i:j] if j > i else None


def last_boxed(text: str) -> str | None:
    """Content of the last well-formed \\boxed{...} / \\fbox{...} / \\boxed x in text, else None."""
    tries = 0
    hi = len(text)
    while tries < MAX_BOX_TRIES:
        pos_b = text.rfind("\\boxed", 0, hi)
        pos_f = text.rfind("\\fbox", 0, hi)
        pos = max(pos_b, pos_f)
        if pos < 0:
            return None
        cmd_len = len("\\boxed") if pos == pos_b else len("\\fbox")
        content = box_content(text, pos + cmd_len)
        if content is not None and content.strip():
            return content.strip()
        hi = pos
        tries += 1
    return None
