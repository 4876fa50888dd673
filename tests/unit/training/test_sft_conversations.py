"""Cold-start SFT for tool use (stare_jax/data/conversations.py + stare_jax/training/sft.py + `stare-jax sft`).

The assistant-token mask is checked against an independent reference: transformers' AutoTokenizer rendering the
real Qwen2.5-Instruct chat template (hermes <tool_call> JSON, <tool_response> inside a user turn) on the same
tokenizer folder, with assistant spans located by re-rendering message prefixes at the token level. Then a tiny
SFT run through the CLI whose loss drops and whose output folder loads, and the bad inputs (file and line named).
"""

from __future__ import annotations

import json
import pathlib
import shutil

import numpy as np
import pytest

from stare_jax import models
from stare_jax.cli import main
from stare_jax.config.options import ConfigError
from stare_jax.data.conversations import (
    Conversation,
    RenderedConversation,
    check_messages,
    read_conversations,
    render_conversation,
    truncate,
)
from stare_jax.data.prompts import DataError
from stare_jax.data.tokenizer import load_tokenizer
from stare_jax.tools.calls import CODE_TOOL_SCHEMA
from stare_jax.training import policy, sft
from stare_jax.training.sft import load_sft_config, with_end_of_turn_eos
from support.conversations import CONVERSATIONS, _call, _tiny_model

transformers = pytest.importorskip("transformers")


def _reference_ids_and_mask(ref, messages, tools):
    """transformers' token ids of the conversation, and the mask built by re-rendering prefixes token-wise: the
    tokens of messages[:i+1] after those of messages[:i] + generation prompt, up to and including <|im_end|>."""

    def ids(msgs, gen):
        return list(
            ref.apply_chat_template(msgs, tools=tools, tokenize=True, add_generation_prompt=gen, return_dict=False)
        )

    full = ids(messages, False)
    mask = [0] * len(full)
    end = ref.convert_tokens_to_ids("<|im_end|>")
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        a, b = ids(messages[:i], True), ids(messages[: i + 1], False)
        assert full[: len(a)] == a and full[: len(b)] == b
        stop = max(j for j in range(len(a), len(b)) if b[j] == end) + 1
        mask[len(a) : stop] = [1] * (stop - len(a))
    return full, mask


@pytest.mark.parametrize("tools", [None, [CODE_TOOL_SCHEMA]])
@pytest.mark.parametrize("n", range(len(CONVERSATIONS)))
def test_assistant_mask_matches_transformers_reference(qwen_sft_dir, n, tools):
    ours = load_tokenizer(qwen_sft_dir)
    ref = transformers.AutoTokenizer.from_pretrained(str(qwen_sft_dir))
    messages = check_messages(CONVERSATIONS[n], "x:1")  # arguments parsed to objects, None content -> ''
    got = render_conversation(ours, Conversation(messages, None, "x:1"), tools)
    ids, mask = _reference_ids_and_mask(ref, messages, tools)
    assert got.ids.tolist() == ids
    assert got.mask.tolist() == mask
    # what is trained, in words: assistant text, tool-call JSON and <|im_end|>; never a role header or a tool reply
    trained = ref.decode([t for t, m in zip(ids, mask) if m])
    untrained = ref.decode([t for t, m in zip(ids, mask) if not m])
    assert "<|im_end|>" in trained and "<tool_response>" not in trained and "user" not in trained
    if any(m.get("tool_calls") for m in messages):
        assert '<tool_call>\n{"name": "code_interpreter", "arguments": {"code": ' in trained
        assert "<tool_response>" in untrained and '<tool_call>\n{"name": "code_interpreter"' not in untrained
    assert sum(mask) < len(mask)


def test_truncation_rule():
    r = RenderedConversation(np.arange(10, dtype=np.int32), np.array([0, 0, 0, 0, 0, 0, 1, 1, 1, 1], np.int32), "f:1")
    assert truncate(r, 10, "error") is r
    kept = truncate(r, 8, "right")
    assert kept.ids.tolist() == list(range(8)) and kept.mask.tolist() == [0] * 6 + [1, 1]
    assert truncate(r, 6, "right") is None  # nothing trained would remain
    assert truncate(r, 8, "drop") is None
    with pytest.raises(DataError, match=r"f:1: the conversation has 10 tokens > max_len 8"):
        truncate(r, 8, "error")


BAD_ROWS = [
    ('"just text"', r"bad.jsonl:2: expected a non-empty list of messages, got str"),
    ('{"conversation": []}', r"bad.jsonl:2: expected \{\"messages\": \[...\]\}"),
    ('{"messages": []}', r"bad.jsonl:2: expected a non-empty list of messages"),
    ('[{"role": "robot", "content": "x"}]', r"bad.jsonl:2: message 0 has unknown role 'robot'"),
    (
        '[{"role": "user", "content": "q"}, {"role": "tool", "content": "1"}, {"role": "assistant", "content": "a"}]',
        r"bad.jsonl:2: message 1 is a tool reply with no preceding assistant tool call",
    ),
    (
        '[{"role": "user", "content": "q"}, {"role": "user", "content": "again"}]',
        r"bad.jsonl:2: the conversation has no assistant message",
    ),
    (
        '[{"role": "user", "content": 3}, {"role": "assistant", "content": "a"}]',
        r"bad.jsonl:2: message 0 \(user\) needs string 'content'",
    ),
    (
        '[{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [{"function": '
        '{"name": "code_interpreter", "arguments": "{not json"}}]}]',
        r"bad.jsonl:2: message 1 tool_calls\[0\]: "
        r"'arguments' is a string that is not JSON",
    ),
    (
        '{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}',
        r"bad.jsonl:2: invalid JSON",
    ),
]


@pytest.mark.parametrize("row,message", BAD_ROWS)
def test_bad_rows_name_file_and_line(tmp_path, row, message):
    good = json.dumps({"messages": CONVERSATIONS[0]})
    path = tmp_path / "bad.jsonl"
    path.write_text(good + "\n" + row + "\n")
    with pytest.raises(DataError, match=message):
        read_conversations(path)


def test_second_tool_reply_needs_a_second_call():
    msgs = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "", "tool_calls": [_call("1")]},
        {"role": "tool", "content": "1"},
        {"role": "tool", "content": "2"},
    ]
    with pytest.raises(DataError, match="w:3: message 3 is a tool reply with no preceding"):
        check_messages(msgs, "w:3")


def test_sft_cli_loss_drops_and_writes_an_hf_folder(qwen_sft_dir, tmp_path, capsys):
    model_dir = tmp_path / "base"
    shutil.copytree(qwen_sft_dir, model_dir)
    tok = load_tokenizer(model_dir)
    _tiny_model(model_dir, tok.vocab_size)
    data = tmp_path / "retool_sft.jsonl"
    data.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    cfg = tmp_path / "sft.yaml"
    # on the 8 fake devices (fsdp 2 x tensor 4), 2 micro-batches of one conversation per data shard; no tool
    # schema in the system prompt (tools: none), so the padded length is 385 instead of 1025 (3x faster)
    cfg.write_text(
        f"model: {{path: {model_dir}}}\ntrain_path: {data}\nout_dir: {tmp_path / 'out'}\nsteps: 30\n"
        f"batch_size: 4\nmicro_batch_size: 1\nlr: 3.0e-3\nmax_len: 1024\nchunk_size: 128\n"
        f"mesh: {{data: 1, fsdp: 2, tensor: 4}}\ntools: none\n"
    )
    assert main(["sft", "--config", str(cfg)]) == 0
    bar = capsys.readouterr().err  # per-step progress, as train's: step, loss, tokens/s
    assert "30/30" in bar and "step=30 loss=" in bar and "tok/s=" in bar, bar[-500:]
    out = tmp_path / "out"
    losses = [json.loads(line)["loss"] for line in (out / "sft_log.jsonl").read_text().splitlines()]
    assert len(losses) == 30 and np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5]), losses
    summary = json.loads((out / "sft_summary.json").read_text())
    assert summary["conversations"] == 3 and summary["assistant_tokens"] > 0
    assert summary["mesh"] == {"data": 1, "fsdp": 2, "tensor": 4} and summary["micro_batches"] == 2
    # the RL run's model.path: an HF folder with weights, config and the tokenizer + chat template
    reloaded = models.from_pretrained(out)
    assert reloaded.config.vocab_size == tok.vocab_size
    out_tok = load_tokenizer(out)
    assert out_tok.apply_chat_template(CONVERSATIONS[2][:1]).endswith("<|im_start|>assistant\n")
    assert out_tok.token_to_id("<|im_end|>") in out_tok.eos_ids  # the RL rollout stops where SFT ended turns
    # bad input through the CLI: one line naming the file and line, exit status 2
    (tmp_path / "bad.jsonl").write_text('[{"role": "robot", "content": "x"}]\n')
    assert (
        main(["sft", "--config", str(cfg), f"train_path={tmp_path / 'bad.jsonl'}", f"out_dir={tmp_path / 'out2'}"]) == 2
    )
    assert "bad.jsonl:1: message 0 has unknown role 'robot'" in capsys.readouterr().err


def test_end_of_turn_joins_a_base_models_eos_list():
    """Qwen2.5-7B-Base: eos <|endoftext|> (151643); after SFT its turns end with <|im_end|> (151645)."""
    assert with_end_of_turn_eos({"eos_token_id": 151643, "bos_token_id": 151643}, [151645]) == {
        "eos_token_id": [151643, 151645],
        "bos_token_id": 151643,
    }
    assert with_end_of_turn_eos({"eos_token_id": [151645, 151643]}, [151645])["eos_token_id"] == [151645, 151643]
    assert with_end_of_turn_eos({}, [7])["eos_token_id"] == [7]


def test_shipped_config_loads_and_tokenizer_files_agree():
    cfg = load_sft_config(pathlib.Path(__file__).resolve().parents[3] / "configs" / "sft_tool_cold_start.yaml")
    assert (cfg.max_len, cfg.tools) == (8192, "code_interpreter")
    assert sft.TOKENIZER_FILES == policy.TOKENIZER_FILES


def test_sft_config_errors(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("model: {path: m}\ntrain_path: t\nout_dir: o\nstep: 3\n")
    with pytest.raises(ConfigError, match=r"s.yaml: unknown key 'sft.step'; did you mean 'sft.steps'"):
        load_sft_config(path)
    path.write_text("model: {path: m}\ntrain_path: t\nout_dir: o\n")
    with pytest.raises(ConfigError, match=r"override 'truncation=left'.*'sft.truncation' = 'left' is not accepted"):
        load_sft_config(path, ["truncation=left"])
    with pytest.raises(ConfigError, match=r"'sft.max_len' = 1 is out of range"):
        load_sft_config(path, ["sft.max_len=1"])
    with pytest.raises(ConfigError, match=r"override 'mesh.fsdp=0'.*'sft.mesh.fsdp' = 0 is not accepted"):
        load_sft_config(path, ["mesh.fsdp=0"])
    with pytest.raises(ConfigError, match=r"unknown key 'sft.model.pth'; did you mean 'sft.model.path'"):
        load_sft_config(path, ["sft.model.pth=x"])
    path.write_text("train_path: t\nout_dir: o\n")
    with pytest.raises(ConfigError, match=r"'sft.model.path' is required"):
        load_sft_config(path)


@pytest.mark.parametrize(
    "template,message",
    [
        # a template that drops assistant turns: nothing to train on
        (
            "{% for m in messages %}{% if m.role != 'assistant' %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
            "{% endif %}{% endfor %}",
            r"c.jsonl:4: the rendered conversation has no assistant token",
        ),
        # a template whose rendering of a prefix is not a prefix of the whole (the last message is rendered first)
        (
            "{% for m in messages|reverse %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
            r"c.jsonl:4: the chat template's rendering"
            r" of messages 0..0 \+ generation prompt",
        ),
    ],
)
def test_templates_the_mask_cannot_use(qwen_sft_dir, tmp_path, template, message):
    folder = tmp_path / "tok"
    shutil.copytree(qwen_sft_dir, folder)
    (folder / "chat_template.jinja").write_text(template)  # wins over tokenizer_config.json's template
    msgs = check_messages([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "c.jsonl:4")
    with pytest.raises(DataError, match=message):
        render_conversation(load_tokenizer(folder), Conversation(msgs, None, "c.jsonl:4"))


def test_sft_cli_wrong_inputs_are_one_line(tmp_path, capsys):
    assert main(["sft"]) == 2
    assert "--config FILE is required" in capsys.readouterr().err
    assert main(["sft", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "config file not found" in capsys.readouterr().err
    cfg = tmp_path / "s.yaml"
    cfg.write_text(f"model: {{path: {tmp_path}}}\ntrain_path: {tmp_path / 'c.jsonl'}\nout_dir: {tmp_path}\n")
    assert main(["sft", "--config", str(cfg)]) == 2  # out_dir exists and is not empty
    assert "exists and is not empty" in capsys.readouterr().err
    assert main(["sft", "--config", str(cfg), "lr=-1"]) == 2
    assert "'sft.lr' = -1.0 is out of range" in capsys.readouterr().err
    assert main(["sft", "--config", str(cfg), "mesh.fsdp=3", f"out_dir={tmp_path / 'new'}"]) == 2  # 8 devices
    assert "sft.mesh: mesh {'data': 1, 'fsdp': 3, 'tensor': 1} has 3 devices" in capsys.readouterr().err
