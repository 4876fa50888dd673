"""stare_jax.data.tokenizer against independent references: transformers' AutoTokenizer on the same HF folder, and the
sentencepiece library itself (plus transformers' LlamaTokenizer where its conversion is faithful).

The HF folders are built here: a small byte-level BPE trained with the `tokenizers` library, saved beside a
tokenizer_config.json holding the real Qwen2.5-Instruct / Llama-3-Instruct chat templates."""

import json
import shutil

import numpy as np
import pytest

from stare_jax.data.tokenizer import (
    HFTokenizer,
    SentencePieceTokenizer,
    load_tokenizer,
    pad_sequences,
    render_chat_template,
    train_sentencepiece,
)
from support.tokenizers import QWEN25_TEMPLATE, QWEN_PATTERN, _added_tokens_decoder, _corpus, _train_bpe

transformers = pytest.importorskip("transformers")

# ---------------------------------------------------------------------------------------------------------------
# Real chat templates (Qwen2.5-Instruct, Llama-3-Instruct) and a template exercising HF's jinja extras.
# ---------------------------------------------------------------------------------------------------------------


LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

# Llama-3.2-style extras: strftime_now, namespace, loop controls, raise_exception, custom kwargs, tojson(indent).
EXTRAS_TEMPLATE = """{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = strftime_now("%d %b %Y") %}{%- endif %}
{%- set ns = namespace(n_user=0) %}
{{- "Today: " + date_string + "\\n" }}
{%- for message in messages %}
    {%- if message['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('bad role ' + message['role']) }}
    {%- endif %}
    {%- if message['role'] == 'system' %}{% continue %}{% endif %}
    {%- if message['role'] == 'user' %}{% set ns.n_user = ns.n_user + 1 %}{% endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] + eos_token }}
{%- endfor %}
{{- "users=" ~ ns.n_user }}
{%- if meta is defined %}{{- meta | tojson(indent=2) }}{% endif %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""

CONVERSATIONS = [
    [{"role": "user", "content": "What is 12 + 30?"}],
    [
        {"role": "system", "content": "You are a careful math tutor."},
        {"role": "user", "content": "Solve: x² = 49, x > 0.\nShow work."},
        {"role": "assistant", "content": "  x = 7 \n"},
        {"role": "user", "content": "Thanks! 東京 café 🙂"},
    ],
]

STRINGS = [
    "Hello world!",
    "The answer is 12345 + 678 = 13023.",
    "  leading and trailing spaces  ",
    "tabs\tand\nnew\n\nlines\r\n",
    "unicode: café naïve Ünïcödé 東京 数学 🙂🚀 ß",
    "don't I'm we've they're it's",
    "x=1; y = [1, 2, 3] # comment",
    "",
    " ",
]

# ---------------------------------------------------------------------------------------------------------------
# Fixtures: byte-level BPE folders
# ---------------------------------------------------------------------------------------------------------------

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    """Qwen2.5-Instruct-style folder: no BOS, eos <|im_end|>, pad <|endoftext|>, generation eos list."""
    folder = tmp_path_factory.mktemp("qwen_style")
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = _train_bpe(QWEN_PATTERN, specials)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "add_prefix_space": False,
        "added_tokens_decoder": _added_tokens_decoder(tok, specials),
        "bos_token": None,
        "chat_template": QWEN25_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2))
    gen = {
        "bos_token_id": tok.token_to_id("<|endoftext|>"),
        "pad_token_id": tok.token_to_id("<|endoftext|>"),
        "eos_token_id": [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")],
    }
    (folder / "generation_config.json").write_text(json.dumps(gen))
    return folder


@pytest.fixture(scope="module")
def llama3_dir(tmp_path_factory):
    """Llama-3-Instruct-style folder: post-processor adds <|begin_of_text|>, eos <|eot_id|>, no pad token,
    clean_up_tokenization_spaces=True (ignored for BPE), chat template in chat_template.jinja."""
    from tokenizers import processors

    folder = tmp_path_factory.mktemp("llama3_style")
    specials = [
        "<|begin_of_text|>",
        "<|end_of_text|>",
        "<|start_header_id|>",
        "<|end_header_id|>",
        "<|eot_id|>",
        "<|eom_id|>",
    ]
    tok = _train_bpe(LLAMA3_PATTERN, specials)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A",
        pair="<|begin_of_text|> $A <|begin_of_text|> $B:1",
        special_tokens=[("<|begin_of_text|>", bos)],
    )
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "added_tokens_decoder": _added_tokens_decoder(tok, specials),
        "bos_token": "<|begin_of_text|>",
        "clean_up_tokenization_spaces": True,
        "eos_token": "<|eot_id|>",
        "model_input_names": ["input_ids", "attention_mask"],
        "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (folder / "chat_template.jinja").write_text(LLAMA3_TEMPLATE)
    ids = [tok.token_to_id(t) for t in ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")]
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": bos, "eos_token_id": ids}))
    return folder


@pytest.fixture(scope="module", params=["qwen", "llama3"])
def pair(request, qwen_dir, llama3_dir):
    folder = {"qwen": qwen_dir, "llama3": llama3_dir}[request.param]
    return request.param, load_tokenizer(folder), transformers.AutoTokenizer.from_pretrained(str(folder))


# ---------------------------------------------------------------------------------------------------------------
# HF folders vs transformers
# ---------------------------------------------------------------------------------------------------------------


def _with_specials(kind):
    if kind == "qwen":
        return ["<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n", "a<|endoftext|>b"]
    return ["<|start_header_id|>user<|end_header_id|>\n\n12 apples<|eot_id|>", "<|begin_of_text|>x"]


def test_encode_decode_match_transformers(pair):
    kind, ours, ref = pair
    for s in STRINGS + _with_specials(kind):
        ids = ours.encode(s)
        assert ids == ref.encode(s), s
        assert ours.encode(s, add_bos=False) == ref.encode(s, add_special_tokens=False), s
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True), s
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False), s
    assert ours.encode_batch(STRINGS) == [ref.encode(s) for s in STRINGS]
    assert ours.encode_batch(STRINGS, add_bos=False) == [ref.encode(s, add_special_tokens=False) for s in STRINGS]
    if ours.bos_id is not None:
        assert ours.encode_batch(STRINGS, add_bos=True) == [ours.encode(s, add_bos=True) for s in STRINGS]
    with pytest.raises(ValueError, match="negative"):
        ours.decode([-1])
    # byte-level BPE round-trips text exactly
    for s in STRINGS:
        assert ours.decode(ours.encode(s)) == s


def test_special_ids_match_transformers(pair):
    kind, ours, ref = pair
    assert ours.bos_id == ref.bos_token_id
    assert ours.eos_id == ref.eos_token_id
    assert ours.pad_id == ref.pad_token_id
    assert ours.vocab_size == len(ref)
    if kind == "qwen":
        assert ours.bos_id is None and ours.pad_id == ours.token_to_id("<|endoftext|>")
        assert ours.eos_ids == (ours.token_to_id("<|im_end|>"), ours.token_to_id("<|endoftext|>"))
        assert ours.padding_id == ours.pad_id
        assert ours.encode("hi") == ours.encode("hi", add_bos=False)  # no BOS from the post-processor
        with pytest.raises(ValueError, match="no bos_token"):
            ours.encode("hi", add_bos=True)
    else:
        assert ours.pad_id is None and ours.padding_id == ours.eos_id  # HF generate's pad fallback
        eot, eom, end = (ours.token_to_id(t) for t in ("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>"))
        assert ours.eos_ids[0] == eot and set(ours.eos_ids) == {eot, eom, end}
        assert ours.encode("hi")[0] == ours.bos_id
        assert ours.encode("hi", add_bos=True) == ours.encode("hi")


@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("gen_prompt", [True, False])
def test_chat_template_matches_transformers(pair, conv, gen_prompt):
    kind, ours, ref = pair
    messages = CONVERSATIONS[conv]
    text = ours.apply_chat_template(messages, add_generation_prompt=gen_prompt)
    assert text == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen_prompt)
    # tokenized chat: HF encodes the rendering with add_special_tokens=False
    ref_ids = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen_prompt, return_dict=False)
    assert ours.encode(text, add_bos=False) == list(ref_ids)
    assert ours.encode_chat(messages, add_generation_prompt=gen_prompt) == list(ref_ids)
    if kind == "llama3":
        assert text.startswith("<|begin_of_text|>")


def test_qwen_tools_and_tojson(qwen_dir):
    ours = load_tokenizer(qwen_dir)
    ref = transformers.AutoTokenizer.from_pretrained(str(qwen_dir))
    params = {"type": "object", "properties": {"a": {"type": "number"}}}
    tools = [
        {
            "type": "function",
            "function": {"name": "add", "description": "Add two numbers → sum (ü)", "parameters": params},
        }
    ]
    call = {"function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
    messages = [
        {"role": "user", "content": "add 2 and 3"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": "5"},
    ]
    ours_text = ours.apply_chat_template(messages, tools=tools)
    assert ours_text == ref.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert "Add two numbers → sum (ü)" in ours_text  # tojson does not escape non-ASCII


def test_extras_template_matches_transformers(qwen_dir, tmp_path):
    folder = tmp_path / "extras"
    shutil.copytree(qwen_dir, folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = EXTRAS_TEMPLATE
    config["bos_token"] = "<|endoftext|>"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    ours = load_tokenizer(folder)
    ref = transformers.AutoTokenizer.from_pretrained(str(folder))
    messages = CONVERSATIONS[1]
    for kwargs in ({}, {"date_string": "26 Jul 2024", "meta": {"k": [1, "ü"]}}):
        for gen in (True, False):
            text = ours.apply_chat_template(messages, add_generation_prompt=gen, **kwargs)
            assert text == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen, **kwargs)
    assert "users=2" in text and '"ü"' in text and text.startswith("<|endoftext|>")
    # raise_exception inside the template -> ValueError naming the file
    with pytest.raises(ValueError, match="tokenizer_config.json.*bad role robot"):
        ours.apply_chat_template([{"role": "robot", "content": "x"}])


def test_batch_encode_matches_transformers_padding(qwen_dir):
    ours = load_tokenizer(qwen_dir)
    ref = transformers.AutoTokenizer.from_pretrained(str(qwen_dir))
    texts = ["short", "a much longer sentence with 123 numbers", "", "mid length text"]
    for side in ("left", "right"):
        ids, mask = ours.batch_encode(texts, padding_side=side)
        ref_out = ref(texts, padding=True, padding_side=side, return_tensors="np")
        np.testing.assert_array_equal(ids, ref_out["input_ids"])
        np.testing.assert_array_equal(mask, ref_out["attention_mask"])
        assert ids.dtype == np.int32 and mask.dtype == np.int32
        for b, t in enumerate(texts):
            row = ids[b][mask[b] == 1].tolist()
            assert row == ours.encode(t)
            n = len(row)
            if side == "left":
                assert mask[b].tolist() == [0] * (ids.shape[1] - n) + [1] * n
            else:
                assert mask[b].tolist() == [1] * n + [0] * (ids.shape[1] - n)
        assert (ids[mask == 0] == ours.pad_id).all()


def test_batch_encode_lengths_and_truncation(llama3_dir):
    tok = load_tokenizer(llama3_dir)
    texts = ["one two three four five six", "one"]
    n0, n1 = len(tok.encode(texts[0])), len(tok.encode(texts[1]))
    ids, mask = tok.batch_encode(texts, pad_to_multiple_of=8)
    assert ids.shape == (2, -(-n0 // 8) * 8) and mask.sum(1).tolist() == [n0, n1]
    assert (ids[mask == 0] == tok.eos_id).all()  # no pad token: padded with eos, masked out
    ids, mask = tok.batch_encode(texts, max_length=n0 + 3, padding="max_length", padding_side="right")
    assert ids.shape == (2, n0 + 3) and mask[:, 0].tolist() == [1, 1] and mask[1].sum() == n1
    with pytest.raises(ValueError, match="sequence 0 has .* tokens > max_length=3"):
        tok.batch_encode(texts, max_length=3)
    full = tok.encode(texts[0])
    ids, mask = tok.batch_encode(texts, max_length=3, truncation=True)  # default keeps the end (left truncation)
    assert ids[0].tolist() == full[-3:]
    ids, mask = tok.batch_encode(texts, max_length=3, truncation=True, truncation_side="right")
    assert ids[0].tolist() == full[:3]
    with pytest.raises(TypeError):
        tok.batch_encode("not a list")
    with pytest.raises(ValueError, match="padding_side"):
        tok.batch_encode(texts, padding_side="middle")


def test_pad_sequences_edge_cases():
    ids, mask = pad_sequences([[], []], pad_id=9)
    assert ids.shape == (2, 0)
    ids, mask = pad_sequences([[], [5]], pad_id=9, pad_to_multiple_of=4, padding_side="left")
    assert ids.tolist() == [[9, 9, 9, 9], [9, 9, 9, 5]] and mask.tolist() == [[0, 0, 0, 0], [0, 0, 0, 1]]
    with pytest.raises(ValueError, match="needs max_length"):
        pad_sequences([[1]], 0, padding="max_length")
    with pytest.raises(ValueError, match="at least one"):
        pad_sequences([], 0)


# ---------------------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------------------


def test_errors_name_the_file(qwen_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_tokenizer(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json or tokenizer.model"):
        load_tokenizer(tmp_path)
    bad = tmp_path / "bad_json"
    shutil.copytree(qwen_dir, bad)
    (bad / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"unreadable JSON in .*bad_json/tokenizer_config.json"):
        load_tokenizer(bad)
    bad_tok = tmp_path / "bad_tok"
    shutil.copytree(qwen_dir, bad_tok)
    (bad_tok / "tokenizer.json").write_text('{"model": 3}')
    with pytest.raises(ValueError, match=r"bad_tok/tokenizer.json"):
        load_tokenizer(bad_tok)
    bad_tpl = tmp_path / "bad_tpl"
    shutil.copytree(qwen_dir, bad_tpl)
    (bad_tpl / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")
    tok = load_tokenizer(bad_tpl)  # chat_template.jinja has priority over tokenizer_config.json
    with pytest.raises(ValueError, match=r"bad_tpl/chat_template.jinja does not compile"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(TypeError, match="message 0"):
        load_tokenizer(qwen_dir).apply_chat_template(["just a string"])
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        render_chat_template("{{ raise_exception('boom') }}", [], source="x/tokenizer_config.json")


def test_no_chat_template(tmp_path, qwen_dir):
    folder = tmp_path / "plain"
    folder.mkdir()
    shutil.copy(qwen_dir / "tokenizer.json", folder / "tokenizer.json")
    tok = load_tokenizer(folder)  # tokenizer.json alone: no special tokens, no template
    assert tok.bos_id is None and tok.eos_id is None and tok.pad_id is None and tok.eos_ids == ()
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    text = tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template="{{ messages[0].content }}!")
    assert text == "x!"
    assert isinstance(load_tokenizer(folder / "tokenizer.json"), HFTokenizer)


# ---------------------------------------------------------------------------------------------------------------
# SentencePiece
# ---------------------------------------------------------------------------------------------------------------

SP_SPECIALS = ["<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("sp")
    return train_sentencepiece(_corpus(300, seed=1), 400, out / "tiny", user_defined_symbols=SP_SPECIALS)


def test_train_sentencepiece_is_deterministic(sp_model, tmp_path):
    import sentencepiece as spm

    again = train_sentencepiece(_corpus(300, seed=1), 400, tmp_path / "tiny", user_defined_symbols=SP_SPECIALS)
    a, b = spm.SentencePieceProcessor(model_file=str(sp_model)), spm.SentencePieceProcessor(model_file=str(again))
    pieces = lambda p: [(p.id_to_piece(i), p.get_score(i)) for i in range(p.get_piece_size())]  # noqa: E731
    assert pieces(a) == pieces(b)
    same = [train_sentencepiece(_corpus(300, seed=1), 400, tmp_path / "same" / "m").read_bytes() for _ in range(2)]
    assert same[0] == same[1]  # byte-identical for the same prefix
    assert a.get_piece_size() == 400
    assert [a.unk_id(), a.bos_id(), a.eos_id(), a.pad_id()] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="failed"):
        train_sentencepiece(["tiny corpus"], 100000, tmp_path / "too_big", byte_fallback=False, hard_vocab_limit=True)


def test_sentencepiece_matches_sentencepiece(sp_model):
    import sentencepiece as spm

    ref = spm.SentencePieceProcessor(model_file=str(sp_model))
    tok = load_tokenizer(sp_model)
    assert isinstance(tok, SentencePieceTokenizer)
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.unk_id, tok.vocab_size) == (1, 2, 3, 0, 400)
    assert tok.eos_ids == (2,)
    for s in STRINGS + ["<|im_start|>user\nhi<|im_end|>", "rare ✈ glyph"]:
        raw = ref.encode(s)
        assert tok.encode(s, add_bos=False) == raw, s
        assert tok.encode(s) == [1] + raw, s  # BOS by default (HF LlamaTokenizer convention)
        assert tok.decode(tok.encode(s)) == ref.decode(raw), s
        assert tok.decode(tok.encode(s)) == s, s  # identity normalisation + byte fallback: exact round trip
    ids = [1] + ref.encode("hello") + [2]
    assert tok.decode(ids, skip_special_tokens=False) == "<s>" + ref.decode(ids[1:-1]) + "</s>"
    assert len(tok.encode("<|im_start|>", add_bos=False)) <= 2  # user-defined symbol is one piece (+ dummy prefix)
    with pytest.raises(ValueError, match="out of range"):
        tok.decode([400])


def test_sentencepiece_matches_transformers_llama(sp_model, tmp_path):
    """transformers 5's LlamaTokenizer rebuilds the SP model as a `tokenizers` BPE; it agrees with sentencepiece on
    ordinary text (it differs on leading whitespace and on user-defined symbols at the start, where sentencepiece
    is the reference)."""
    shutil.copy(sp_model, tmp_path / "tokenizer.model")
    ours = load_tokenizer(tmp_path)
    ref = transformers.LlamaTokenizer.from_pretrained(str(tmp_path))
    for s in ["Hello world!", "The answer is 12345.", "café 東京 🙂", "don't stop", "a\nb"]:
        assert ours.encode(s, add_bos=False) == ref.encode(s, add_special_tokens=False), s


def test_sentencepiece_folder_with_chat_template(sp_model, tmp_path):
    shutil.copy(sp_model, tmp_path / "tokenizer.model")
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    config = {"chat_template": template, "eos_token": "<|im_end|>", "add_bos_token": False}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2]}))
    tok = load_tokenizer(tmp_path)
    im_end = tok.token_to_id("<|im_end|>")
    assert tok.eos_id == im_end and tok.eos_ids == (im_end, 2)
    text = tok.apply_chat_template([{"role": "user", "content": "12 + 30?"}])
    assert text == "<|im_start|>user\n12 + 30?<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode(text)
    assert ids[0] != tok.bos_id  # add_bos_token: false
    assert im_end in ids and tok.token_to_id("<|im_start|>") in ids
    assert "<|im_end|>" not in tok.decode(ids) and "<|im_end|>" in tok.decode(ids, skip_special_tokens=False)
    ids_BxT, mask_BxT = tok.batch_encode(["a", "a b c"], padding_side="left")
    assert (ids_BxT[mask_BxT == 0] == 3).all()
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<not_a_piece>"}))
    with pytest.raises(ValueError, match="not a piece"):
        load_tokenizer(tmp_path)
