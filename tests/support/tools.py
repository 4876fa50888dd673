"""A fake SandboxFusion server for the tests: answers POST /run_code in SandboxFusion's documented response format
from canned outputs (the clients under test are real; this server is not)."""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
import time

import jax.numpy as jnp
import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from stare_jax.data.tokenizer import HFTokenizer
from stare_jax.models import ModelConfig, init_model

CANNED_STDOUT = {
    "print(6 * 7)": "42\n",
    "print('é' * 20)": "é" * 20 + "\n",
    "print(1)": "1\n",
    "print(2)": "2\n",
    "print(5)": "5\n",
}


class FakeSandboxFusion(http.server.BaseHTTPRequestHandler):
    """Answers POST /run_code the way SandboxFusion documents it (a fake server; the client under test is real)."""

    requests: list[dict] = []

    def log_message(self, *args):
        pass

    def _send(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append({"path": self.path, **req})
        code = req["code"]
        if self.path != "/run_code":
            return self._send(404, b'{"detail": "Not Found"}')
        if code == "http500":
            return self._send(500, b"Internal Server Error")
        if code == "garbage":
            return self._send(200, b"<html>not json</html>")
        if code == "sandbox_error":
            return self._send(
                200, json.dumps({"status": "SandboxError", "message": "no executor", "run_result": None}).encode()
            )
        if code == "slow":
            time.sleep(2.0)
        run = {"status": "Finished", "execution_time": 0.01, "return_code": 0, "stdout": "", "stderr": ""}
        status = "Success"
        if code in CANNED_STDOUT:
            run["stdout"] = CANNED_STDOUT[code]
        elif code == "raise":
            run.update(status="Error", return_code=1, stderr="Traceback ...\nValueError: x\n")
            status = "Failed"
        elif code == "loop":
            run.update(status="TimeLimitExceeded", return_code=None, stdout="partial")
            status = "Failed"
        self._send(
            200,
            json.dumps(
                {
                    "status": status,
                    "message": "",
                    "compile_result": None,
                    "run_result": run,
                    "executor_pod_name": None,
                    "files": {},
                }
            ).encode(),
        )


@contextlib.contextmanager
def fake_sandbox_fusion_server():
    """Yields the base URL of a FakeSandboxFusion on 127.0.0.1 (its requests recorded in FakeSandboxFusion.requests)."""
    FakeSandboxFusion.requests = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeSandboxFusion)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


# the tool-rollout tests' tokenizer and bigram model
V = 272


TAGS = [
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<code>",
    "</code>",
    "<interpreter>",
    "</interpreter>",
]


SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


TEMPLATE = (
    "{%- for m in messages %}{%- if m.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


CALL = (
    '<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{{"name": "{name}", "arguments": '
    '{{"code": "{code}"}}}}'
)


def _make_tokenizer(folder, template):
    """A byte-level tokenizer (one token per byte, no merges) with the chat and tool tags as single tokens."""
    folder.mkdir(exist_ok=True)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    tok.add_tokens(TAGS)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None, "chat_template": template}
        )
    )
    t = HFTokenizer(folder)
    assert t.vocab_size <= V
    return t


def _bigram_model(tokenizer, rules: dict[str, str | tuple[str, ...]], default: str):
    """The real Qwen2 model whose next token is a function of the current token only: rules[char] after that
    character (a tuple: one of its tokens, each as likely), `default` after any other token (layers zeroed so the
    residual stream is the token's embedding)."""
    cfg = ModelConfig(
        vocab_size=V,
        hidden_size=32,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=64,
        max_position_embeddings=256,
        qkv_bias=True,
        tie_word_embeddings=False,
        initializer_range=0.1,
        eos_token_id=None,
        pad_token_id=0,
    )
    model = init_model(cfg, seed=0)
    targets = [default] + sorted(set(rules.values()) - {default}, key=str)
    dim = {t: i for i, t in enumerate(targets)}
    embed = np.zeros((V, 32), np.float32)
    embed[:, dim[default]] = 1.0
    for src, dst in rules.items():
        (i,) = tokenizer.encode(src, add_bos=False)
        embed[i] = 0.0
        embed[i, dim[dst]] = 1.0
    head = np.zeros((V, 32), np.float32)
    for t, d in dim.items():
        for tok in (t,) if isinstance(t, str) else t:
            head[tokenizer.token_to_id(tok), d] = 20.0
    model.embed_tokens[...] = jnp.asarray(embed)
    model.lm_head[...] = jnp.asarray(head)
    model.norm.weight[...] = jnp.ones((32,))
    for layer in model.layers:
        layer.self_attn.o_proj.kernel[...] = 0.0
        layer.mlp.down_proj.kernel[...] = 0.0
    return model
