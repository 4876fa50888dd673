"""Tokenizers behind one small interface: HF `tokenizer.json` folders and SentencePiece `.model` files.

`load_tokenizer(path)` returns an object with

    encode(text, add_bos=None) -> list[int]
    encode_batch(texts, add_bos=None) -> list[list[int]]
    encode_chat(messages, add_generation_prompt=True, **kwargs) -> list[int]
    decode(ids, skip_special_tokens=True) -> str
    batch_encode(texts, padding_side="left", max_length=None, pad_to_multiple_of=None, ...) -> (ids_BxT, mask_BxT)
    apply_chat_template(messages, add_generation_prompt=True, **kwargs) -> str
    bos_id, eos_id, pad_id, eos_ids, vocab_size, chat_template

HF folders are read with the `tokenizers` library (never `transformers`), reproducing what transformers 5's
`AutoTokenizer` does with the same folder (tests compare against it):

* special tokens (`bos_token`, `eos_token`, `pad_token`, `unk_token`, ...) come from tokenizer_config.json; a legacy
  special_tokens_map.json overrides them unless tokenizer_config.json has `added_tokens_decoder` (transformers 5 rule);
* `encode(text)` (add_bos=None) applies the tokenizer.json post-processor, like HF `encode(text)` with
  `add_special_tokens=True` (Llama-3 adds `<|begin_of_text|>`, Qwen2.5/SmolLM2 add nothing).
  `add_bos=False` encodes without any added special tokens (HF `add_special_tokens=False`; use it for rendered
  chat templates, which already contain their special tokens, exactly as HF `apply_chat_template(tokenize=True)`
  does). `add_bos=True` encodes without the post-processor and prepends `bos_id`;
* the chat template comes from chat_template.jinja if present (it has priority in transformers 5), else from
  the `chat_template` entry of tokenizer_config.json; it is rendered like HF's `apply_chat_template`
  (ImmutableSandboxedEnvironment with trim_blocks/lstrip_blocks and loopcontrols, `raise_exception`, a `tojson`
  that does not escape HTML, `strftime_now`, and the special-token strings `bos_token`, `eos_token`, ... as
  variables);
* `decode` calls the tokenizers decoder; `clean_up_tokenization_spaces` from tokenizer_config.json is honoured
  except for BPE models (transformers 5 skips it for BPE because it corrupts output).

Padding id: `pad_id` is the configured pad token (tokenizer_config/special_tokens_map, then generation_config's
`pad_token_id`), `None` when absent, as in HF (Llama-3 has none; Qwen2.5 sets `<|endoftext|>`; SmolLM2 sets
`<|im_end|>`). `padding_id` is what `batch_encode` writes into padded slots: `pad_id`, else `eos_id` (the same
fallback HF `generate` uses when pad is unset), else 0. Padded slots are always marked 0 in the mask, so the
value never matters to a correctly masked model.

`eos_ids`: every id that ends generation: `eos_id` plus generation_config.json's `eos_token_id` (int or list),
e.g. Llama-3-Instruct's `<|eot_id|>`, `<|end_of_text|>` and `<|eom_id|>`.

`vocab_size`: number of ids the tokenizer can produce (base vocab + added tokens, HF `len(tokenizer)`). A model's
embedding table may be larger (padded), never smaller.

SentencePiece (`.model` file, or a folder with tokenizer.model and no tokenizer.json): ids from the model's own
unk/bos/eos/pad ids (-1 -> None); an optional tokenizer_config.json in the folder supplies a chat template and may
name special tokens (e.g. `eos_token: "<|im_end|>"` for a user-defined symbol). `encode(text)` (add_bos=None)
prepends BOS when the model has one (HF LlamaTokenizer default) unless tokenizer_config.json says
`add_bos_token: false`. `train_sentencepiece` trains a small model deterministically (single thread, fixed seed,
no sentence sampling/shuffling).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import numpy as np
import sentencepiece as spm
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer

__all__ = [
    "HFTokenizer",
    "SentencePieceTokenizer",
    "load_tokenizer",
    "pad_sequences",
    "render_chat_template",
    "train_sentencepiece",
]

_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


# ----------------------------------------------------------------------------------------------------------------
# File helpers
# ----------------------------------------------------------------------------------------------------------------


def _read_json(path: pathlib.Path, required: bool = False) -> dict | None:
    """Parse a JSON object file; None when optional and absent. Errors name the file."""
    if not path.is_file():
        if required:
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"unreadable JSON in {path}: {e}") from e
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data


def _token_str(value: Any, where: str) -> str | None:
    """A special-token entry is a string, an AddedToken dict ({"content": ...}) or null."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"bad special token entry in {where}: {value!r}")


def _special_tokens(config: dict, config_path: pathlib.Path, stm: dict | None, stm_path: pathlib.Path) -> dict:
    """Named special-token strings, following transformers 5's precedence rules."""
    tokens = {name: _token_str(config.get(name), str(config_path)) for name in _SPECIAL_NAMES}
    if stm is not None and "added_tokens_decoder" not in config:
        for name in _SPECIAL_NAMES:
            if name in stm:
                tokens[name] = _token_str(stm[name], str(stm_path))
    return {k: v for k, v in tokens.items() if v is not None}


def _chat_template(folder: pathlib.Path, config: dict, config_path: pathlib.Path) -> tuple[Any, str | None]:
    """(template, source file). chat_template.jinja wins over tokenizer_config.json (as in transformers 5).

    The template is a string, or a dict name -> string for the legacy list-of-{name, template} format."""
    jinja_path = folder / "chat_template.jinja"
    if jinja_path.is_file():
        try:
            return jinja_path.read_text(encoding="utf-8"), str(jinja_path)
        except UnicodeDecodeError as e:
            raise ValueError(f"unreadable chat template {jinja_path}: {e}") from e
    template = config.get("chat_template")
    if template is None:
        return None, None
    if isinstance(template, list):
        try:
            template = {t["name"]: t["template"] for t in template}
        except (KeyError, TypeError) as e:
            raise ValueError(f"bad chat_template list in {config_path}: {e}") from e
    elif not isinstance(template, str):
        raise ValueError(f"chat_template in {config_path} must be a string or a list, got {type(template).__name__}")
    return template, str(config_path)


def _generation_eos(gen_config: dict | None) -> list[int]:
    if not gen_config:
        return []
    eos = gen_config.get("eos_token_id")
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, list) else [eos])]


# ----------------------------------------------------------------------------------------------------------------
# Chat templates
# ----------------------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=32)
def _compile_chat_template(template: str):
    """Compile like transformers' `_compile_jinja_template` (sandboxed, trim/lstrip blocks, HF globals)."""

    class _GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` (assistant-mask markers in some templates): renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)


def _plain(value: Any) -> Any:
    """Deep copy into plain JSON-like types (the template never sees caller objects or mutates caller messages)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return f"<{type(value).__name__}>"


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    source: str = "<chat_template>",
    special_tokens: Mapping[str, str] | None = None,
    **kwargs,
) -> str:
    """Render one conversation with a chat template string; errors name `source` (the file it came from)."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise TypeError(f"messages must be a list of dicts, got {type(messages).__name__}")
    chat = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TypeError(f"message {i} must be a dict with 'role' and 'content', got {m!r}")
        m = _plain(m)
        # transformers 5 copies a message's reasoning under the names templates read.
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        chat.append(m)
    try:
        compiled = _compile_chat_template(template)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"chat template from {source} does not compile (line {e.lineno}): {e.message}") from e
    variables = {**dict(special_tokens or {}), **_plain(kwargs)}
    variables.setdefault("tools", None)
    variables.setdefault("documents", None)
    try:
        return compiled.render(messages=chat, add_generation_prompt=add_generation_prompt, **variables)
    except jinja2.TemplateError as e:
        raise ValueError(f"chat template from {source} failed to render: {e}") from e


# ----------------------------------------------------------------------------------------------------------------
# Padding
# ----------------------------------------------------------------------------------------------------------------


def pad_sequences(
    seqs: Sequence[Sequence[int]],
    pad_id: int,
    *,
    padding_side: str = "left",
    max_length: int | None = None,
    pad_to_multiple_of: int | None = None,
    padding: str = "longest",
    truncation: bool = False,
    truncation_side: str = "left",
) -> tuple[np.ndarray, np.ndarray]:
    """Pad token-id lists into (ids_BxT int32, mask_BxT int32; 1 = real token).

    T is the longest sequence (padding="longest") or max_length (padding="max_length"), rounded up to
    pad_to_multiple_of. A sequence longer than max_length raises ValueError unless truncation=True, which drops
    tokens from `truncation_side` ("left" keeps the end of a prompt, "right" keeps its start)."""
    if padding_side not in ("left", "right"):
        raise ValueError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
    if truncation_side not in ("left", "right"):
        raise ValueError(f"truncation_side must be 'left' or 'right', got {truncation_side!r}")
    if padding not in ("longest", "max_length"):
        raise ValueError(f"padding must be 'longest' or 'max_length', got {padding!r}")
    if padding == "max_length" and max_length is None:
        raise ValueError("padding='max_length' needs max_length")
    if max_length is not None and max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    if pad_to_multiple_of is not None and pad_to_multiple_of < 1:
        raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
    if len(seqs) == 0:
        raise ValueError("pad_sequences needs at least one sequence")
    rows = []
    for i, s in enumerate(seqs):
        s = list(s)
        if max_length is not None and len(s) > max_length:
            if not truncation:
                raise ValueError(
                    f"sequence {i} has {len(s)} tokens > max_length={max_length} (pass truncation=True to cut it)"
                )
            s = s[len(s) - max_length :] if truncation_side == "left" else s[:max_length]
        rows.append(s)
    if padding == "max_length":
        assert max_length is not None  # checked above
        T = max_length
    else:
        T = max(len(s) for s in rows)
    if pad_to_multiple_of:
        T = -(-T // pad_to_multiple_of) * pad_to_multiple_of
    ids_BxT = np.full((len(rows), T), pad_id, dtype=np.int32)
    mask_BxT = np.zeros((len(rows), T), dtype=np.int32)
    for b, s in enumerate(rows):
        n = len(s)
        if n == 0:
            continue
        sl = slice(T - n, T) if padding_side == "left" else slice(0, n)
        ids_BxT[b, sl] = s
        mask_BxT[b, sl] = 1
    return ids_BxT, mask_BxT


# ----------------------------------------------------------------------------------------------------------------
# Shared interface
# ----------------------------------------------------------------------------------------------------------------


class _TokenizerBase:
    """What both backends share: chat templates, batching, eos list, padding id."""

    name_or_path: str
    bos_id: int | None
    eos_id: int | None
    pad_id: int | None
    unk_id: int | None
    eos_ids: tuple[int, ...]
    vocab_size: int
    chat_template: Any
    _chat_template_source: str | None
    special_tokens: dict[str, str]

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:  # pragma: no cover - abstract
        raise NotImplementedError

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:  # pragma: no cover
        raise NotImplementedError

    def _set_special_ids(self, ids: Mapping[str, int | None], gen: dict | None) -> None:
        """bos/eos/unk/pad ids from the named special tokens; pad falls back to generation_config's pad_token_id;
        eos_ids adds generation_config's eos list."""
        self.bos_id = ids.get("bos_token")
        self.eos_id = ids.get("eos_token")
        self.unk_id = ids.get("unk_token")
        self.pad_id = ids.get("pad_token")
        if self.pad_id is None and gen and gen.get("pad_token_id") is not None:
            self.pad_id = int(gen["pad_token_id"])
        self.eos_ids = self._finish_eos_ids(_generation_eos(gen))

    def encode_batch(self, texts: Sequence[str], add_bos: bool | None = None) -> list[list[int]]:
        """encode() of each text (the HF backend runs them in parallel in Rust)."""
        if isinstance(texts, str):
            raise TypeError("expected a list of strings, got one string")
        return [self.encode(t, add_bos=add_bos) for t in texts]

    def encode_chat(
        self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True, **kwargs
    ) -> list[int]:
        """Token ids of the rendered chat (HF `apply_chat_template(tokenize=True)`: no extra special tokens)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kwargs), add_bos=False)

    @property
    def padding_id(self) -> int:
        """Id written into padded slots: pad_id, else eos_id, else 0 (always masked out anyway)."""
        if self.pad_id is not None:
            return self.pad_id
        if self.eos_id is not None:
            return self.eos_id
        return 0

    def _finish_eos_ids(self, gen_eos: list[int]) -> tuple[int, ...]:
        ids = ([self.eos_id] if self.eos_id is not None else []) + gen_eos
        return tuple(dict.fromkeys(ids))

    def batch_encode(
        self,
        texts: Sequence[str],
        padding_side: str = "left",
        max_length: int | None = None,
        pad_to_multiple_of: int | None = None,
        *,
        add_bos: bool | None = None,
        padding: str = "longest",
        truncation: bool = False,
        truncation_side: str = "left",
    ) -> tuple[np.ndarray, np.ndarray]:
        """Encode and pad texts -> (ids_BxT int32, mask_BxT int32). See `pad_sequences` for the options."""
        seqs = self.encode_batch(texts, add_bos=add_bos)
        return pad_sequences(
            seqs,
            self.padding_id,
            padding_side=padding_side,
            max_length=max_length,
            pad_to_multiple_of=pad_to_multiple_of,
            padding=padding,
            truncation=truncation,
            truncation_side=truncation_side,
        )

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        **kwargs,
    ) -> str:
        """Render messages to a prompt string with the tokenizer's chat template (HF semantics).

        Encode the result with `encode(prompt, add_bos=False)`: the template already writes its special tokens.
        `chat_template` overrides the stored template (a template string, or a name when the tokenizer has several);
        extra kwargs (tools, enable_thinking, ...) become template variables."""
        template, source = self._select_template(chat_template)
        return render_chat_template(
            template,
            messages,
            add_generation_prompt=add_generation_prompt,
            source=source,
            special_tokens=self.special_tokens,
            **kwargs,
        )

    def _select_template(self, override: str | None) -> tuple[str, str]:
        stored, source = self.chat_template, self._chat_template_source or self.name_or_path
        if isinstance(stored, dict):
            if override is not None and override in stored:
                return stored[override], f"{source} [{override}]"
            if override is None:
                if "default" not in stored:
                    raise ValueError(f"{source} has several chat templates {sorted(stored)} and no 'default'")
                return stored["default"], f"{source} [default]"
        if override is not None:
            return override, "<chat_template argument>"
        if stored is None:
            raise ValueError(
                f"tokenizer {self.name_or_path} has no chat template (no chat_template.jinja and no "
                "'chat_template' in tokenizer_config.json); pass chat_template=..."
            )
        return stored, source

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.name_or_path!r}, vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
            f"eos_id={self.eos_id}, pad_id={self.pad_id}, eos_ids={self.eos_ids})"
        )


# ----------------------------------------------------------------------------------------------------------------
# HF tokenizer.json
# ----------------------------------------------------------------------------------------------------------------


def _clean_up_tokenization(text: str) -> str:
    """transformers' `clean_up_tokenization` (spaces before punctuation / contractions)."""
    return (
        text.replace(" .", ".")
        .replace(" ?", "?")
        .replace(" !", "!")
        .replace(" ,", ",")
        .replace(" ' ", "'")
        .replace(" n't", "n't")
        .replace(" 'm", "'m")
        .replace(" 's", "'s")
        .replace(" 've", "'ve")
        .replace(" 're", "'re")
    )


class HFTokenizer(_TokenizerBase):
    """A HF tokenizer folder (tokenizer.json + tokenizer_config.json ...) via the `tokenizers` library."""

    def __init__(self, folder: str | os.PathLike):
        folder = pathlib.Path(folder)
        self.name_or_path = str(folder)
        tok_path = folder / "tokenizer.json"
        if not tok_path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {tok_path}")
        try:
            self._tok = Tokenizer.from_file(str(tok_path))
        except Exception as e:  # tokenizers raises a bare Exception for bad JSON/unknown components
            raise ValueError(f"unreadable tokenizer file {tok_path}: {e}") from e
        self._tok.no_padding()
        self._tok.no_truncation()
        config_path = folder / "tokenizer_config.json"
        stm_path = folder / "special_tokens_map.json"
        gen_path = folder / "generation_config.json"
        self.config = _read_json(config_path) or {}
        stm = _read_json(stm_path)
        gen = _read_json(gen_path)
        self.special_tokens = _special_tokens(self.config, config_path, stm, stm_path)
        # Special tokens missing from the vocab are added (new ids at the end), as transformers does.
        missing = [t for t in self.special_tokens.values() if self._tok.token_to_id(t) is None]
        if missing:
            self._tok.add_special_tokens([AddedToken(t, special=True) for t in dict.fromkeys(missing)])
        self._set_special_ids({k: self._tok.token_to_id(v) for k, v in self.special_tokens.items()}, gen)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.chat_template, self._chat_template_source = _chat_template(folder, self.config, config_path)
        self._clean_up = bool(self.config.get("clean_up_tokenization_spaces", False)) and (
            type(self._tok.model).__name__ != "BPE"
        )

    @property
    def backend(self):
        """The underlying `tokenizers.Tokenizer`."""
        return self._tok

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`. add_bos=None: the tokenizer's post-processor (HF add_special_tokens=True);
        False: no added special tokens; True: no post-processor, BOS prepended."""
        if not isinstance(text, str):
            raise TypeError(f"encode takes a string, got {type(text).__name__}")
        ids = self._tok.encode(text, add_special_tokens=add_bos is None).ids
        if add_bos:
            if self.bos_id is None:
                raise ValueError(f"add_bos=True but tokenizer {self.name_or_path} has no bos_token")
            ids = [self.bos_id] + ids
        return ids

    def encode_batch(self, texts: Sequence[str], add_bos: bool | None = None) -> list[list[int]]:
        if isinstance(texts, str):
            raise TypeError("expected a list of strings, got one string")
        for i, t in enumerate(texts):
            if not isinstance(t, str):
                raise TypeError(f"text {i} is {type(t).__name__}, not str")
        encodings = self._tok.encode_batch(list(texts), add_special_tokens=add_bos is None)
        if not add_bos:
            return [e.ids for e in encodings]
        if self.bos_id is None:
            raise ValueError(f"add_bos=True but tokenizer {self.name_or_path} has no bos_token")
        return [[self.bos_id] + e.ids for e in encodings]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`. Ids >= vocab_size (unused rows of a padded embedding) are dropped, as transformers does."""
        ids = [int(i) for i in np.asarray(ids).reshape(-1)] if not isinstance(ids, list) else [int(i) for i in ids]
        if any(i < 0 for i in ids):
            raise ValueError(f"negative token ids in decode: {[i for i in ids if i < 0][:5]}")
        text = self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
        return _clean_up_tokenization(text) if self._clean_up else text

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, idx: int) -> str | None:
        return self._tok.id_to_token(idx)


# ----------------------------------------------------------------------------------------------------------------
# SentencePiece
# ----------------------------------------------------------------------------------------------------------------


class SentencePieceTokenizer(_TokenizerBase):
    """A SentencePiece model; optional tokenizer_config.json / generation_config.json beside it (folder form)."""

    def __init__(self, model_path: str | os.PathLike, folder: str | os.PathLike | None = None):
        model_path = pathlib.Path(model_path)
        self.name_or_path = str(folder if folder is not None else model_path)
        if not model_path.is_file():
            raise FileNotFoundError(f"SentencePiece model not found: {model_path}")
        self._sp = spm.SentencePieceProcessor()
        try:
            self._sp.Load(str(model_path))
        except (OSError, RuntimeError) as e:
            raise ValueError(f"unreadable SentencePiece model {model_path}: {e}") from e
        self.vocab_size = int(self._sp.get_piece_size())
        own = {
            "unk_token": self._sp.unk_id(),
            "bos_token": self._sp.bos_id(),
            "eos_token": self._sp.eos_id(),
            "pad_token": self._sp.pad_id(),
        }
        self.special_tokens = {k: self._sp.id_to_piece(v) for k, v in own.items() if v >= 0}
        self.config, gen = {}, None
        self.chat_template, self._chat_template_source = None, None
        if folder is not None:
            folder = pathlib.Path(folder)
            config_path = folder / "tokenizer_config.json"
            stm_path = folder / "special_tokens_map.json"
            self.config = _read_json(config_path) or {}
            named = _special_tokens(self.config, config_path, _read_json(stm_path), stm_path)
            for name, piece in named.items():
                if self._sp.piece_to_id(piece) == self._sp.unk_id() and piece != self._sp.id_to_piece(
                    self._sp.unk_id()
                ):
                    raise ValueError(f"{name}={piece!r} from {config_path} is not a piece of {model_path}")
            self.special_tokens.update(named)
            gen = _read_json(folder / "generation_config.json")
            self.chat_template, self._chat_template_source = _chat_template(folder, self.config, config_path)
        ids = {k: int(self._sp.piece_to_id(v)) for k, v in self.special_tokens.items()}
        self._set_special_ids(ids, gen)
        self._add_bos_default = bool(self.config.get("add_bos_token", True)) and self.bos_id is not None
        # user-defined pieces (e.g. <|im_start|>) decode to their text; control pieces to "" in sentencepiece.
        self._control_ids = {i for i in range(self.vocab_size) if self._sp.is_control(i)}
        # ids dropped by decode(skip_special_tokens=True): control pieces and the named special tokens (not unk).
        self._special_ids = self._control_ids | {v for k, v in ids.items() if k != "unk_token"}

    @property
    def backend(self):
        """The underlying `sentencepiece.SentencePieceProcessor`."""
        return self._sp

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; add_bos=None prepends BOS when the model has one (HF LlamaTokenizer default)."""
        if not isinstance(text, str):
            raise TypeError(f"encode takes a string, got {type(text).__name__}")
        ids = list(self._sp.encode(text, out_type=int))
        if add_bos is None:
            add_bos = self._add_bos_default
        if add_bos:
            if self.bos_id is None:
                raise ValueError(f"add_bos=True but SentencePiece model {self.name_or_path} has no BOS piece")
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in np.asarray(ids).reshape(-1)] if not isinstance(ids, list) else [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} out of range [0, {self.vocab_size})")
        if skip_special_tokens:
            return self._sp.decode([i for i in ids if i not in self._special_ids])
        # keep control pieces visible (sentencepiece itself renders them as "")
        out: list[str] = []
        run: list[int] = []
        for i in ids:
            if i in self._control_ids:
                out.append(self._sp.decode(run))
                out.append(self._sp.id_to_piece(i))
                run = []
            else:
                run.append(i)
        out.append(self._sp.decode(run))
        return "".join(out)

    def token_to_id(self, token: str) -> int | None:
        i = int(self._sp.piece_to_id(token))
        return None if i == self._sp.unk_id() and token != self._sp.id_to_piece(i) else i

    def id_to_token(self, idx: int) -> str | None:
        return self._sp.id_to_piece(idx) if 0 <= idx < self.vocab_size else None


def train_sentencepiece(
    texts: Iterable[str],
    vocab_size: int,
    model_prefix: str | os.PathLike,
    *,
    model_type: str = "bpe",
    character_coverage: float = 1.0,
    user_defined_symbols: Sequence[str] = (),
    byte_fallback: bool = True,
    split_digits: bool = True,
    normalization_rule_name: str = "identity",
    add_dummy_prefix: bool = True,
    unk_id: int = 0,
    bos_id: int = 1,
    eos_id: int = 2,
    pad_id: int = 3,
    seed: int = 0,
    **extra_options,
) -> pathlib.Path:
    """Train a SentencePiece model on `texts`; returns the path of `<model_prefix>.model`.

    Deterministic: one thread, fixed random seed, every sentence used in order (no sampling/shuffling), so the
    same texts, options and model_prefix give a byte-identical model (the prefix is recorded inside it).
    Too large a vocab_size for the corpus raises ValueError (sentencepiece's hard limit; pass
    hard_vocab_limit=False to accept a smaller vocabulary). Defaults suit toy LMs: BPE, byte fallback (no unknown
    characters), digits split one per token, identity normalisation (text round-trips exactly),
    unk/bos/eos/pad = 0/1/2/3. `user_defined_symbols` (e.g. "<|im_start|>") are always single pieces."""
    texts = [t for t in texts]
    if not texts:
        raise ValueError("train_sentencepiece needs at least one text")
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise TypeError(f"text {i} is {type(t).__name__}, not str")
    if vocab_size < 4:
        raise ValueError(f"vocab_size must be >= 4, got {vocab_size}")
    prefix = pathlib.Path(model_prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    # sentencepiece reads one sentence per line; split multi-line texts so no newline ends up inside a sentence.
    lines = [line for t in texts for line in t.split("\n") if line.strip()]
    options: dict[str, Any] = dict(
        model_prefix=str(prefix),
        vocab_size=vocab_size,
        model_type=model_type,
        character_coverage=character_coverage,
        user_defined_symbols=list(user_defined_symbols),
        byte_fallback=byte_fallback,
        split_digits=split_digits,
        normalization_rule_name=normalization_rule_name,
        add_dummy_prefix=add_dummy_prefix,
        remove_extra_whitespaces=False,
        unk_id=unk_id,
        bos_id=bos_id,
        eos_id=eos_id,
        pad_id=pad_id,
        num_threads=1,
        input_sentence_size=0,
        shuffle_input_sentence=False,
        max_sentence_length=max(4192, max(len(x.encode("utf-8")) for x in lines) + 1),
        minloglevel=2,
    )
    options.update(extra_options)
    spm.set_random_generator_seed(seed)
    try:
        spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), **options)
    except RuntimeError as e:
        raise ValueError(f"SentencePiece training for {prefix} failed: {e}") from e
    return prefix.with_name(prefix.name + ".model")


# ----------------------------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------------------------


def load_tokenizer(path: str | os.PathLike) -> HFTokenizer | SentencePieceTokenizer:
    """Load a tokenizer from a HF folder (tokenizer.json), a SentencePiece .model file, or a folder holding
    tokenizer.model (and no tokenizer.json)."""
    path = pathlib.Path(path)
    if path.is_file():
        if path.name == "tokenizer.json":
            return HFTokenizer(path.parent)
        if path.suffix == ".model":
            return SentencePieceTokenizer(path)
        raise ValueError(f"{path} is neither a tokenizer folder, a tokenizer.json nor a SentencePiece .model file")
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer path not found: {path}")
    if (path / "tokenizer.json").is_file():
        return HFTokenizer(path)
    if (path / "tokenizer.model").is_file():
        return SentencePieceTokenizer(path / "tokenizer.model", folder=path)
    raise FileNotFoundError(f"no tokenizer.json or tokenizer.model in {path}")
