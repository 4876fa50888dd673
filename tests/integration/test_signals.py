"""Ctrl-C at any moment of a `stare-jax` command (real `python -m stare_jax.cli` processes, SIGINT sent to them):
one line on stderr, exit status 130, no traceback and no crash, from the first imports on (stare_jax.cli.signals).

- during the imports (0.5 s in: `import jax` is under way) of `config` and `plan`;
- during `eval`'s XLA compile of the sampler: a KeyboardInterrupt unwinding there crashed the process (SIGSEGV in
  xla::ifrt::SingleDeviceSharding::Create, exit status 139) after printing its line, ~1.5 s later.

Ctrl-C in the middle of a training run (the step is saved, the last line names the checkpoint, 130, and the run
resumes) is tests/integration/test_train.py::test_ctrl_c_saves_the_current_step_says_so_and_exits_130, with the
toy set-up it shares with the other training tests.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]


def _env(**extra: str) -> dict:
    env = dict(os.environ)
    for key in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR"):  # one CPU device; the compile really runs
        env.pop(key, None)
    env["JAX_PLATFORMS"] = "cpu"
    return {**env, **extra}


def _sigint_default() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


class _Command:
    """A `stare-jax` process whose stdout and stderr lines are collected as they come."""

    def __init__(self, *argv, env: dict, cwd: pathlib.Path = REPO):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "stare_jax.cli", *map(str, argv)],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            # SIGINT as at a terminal even when this test runs where it is ignored (a background job of a script)
            preexec_fn=_sigint_default if signal.getsignal(signal.SIGINT) == signal.SIG_IGN else None,
        )
        self.out: list[str] = []
        self.err: list[str] = []
        self._readers = [
            threading.Thread(target=self._read, args=(self.proc.stdout, self.out), daemon=True),
            threading.Thread(target=self._read, args=(self.proc.stderr, self.err), daemon=True),
        ]
        for t in self._readers:
            t.start()

    @staticmethod
    def _read(stream, into: list[str]) -> None:
        for line in stream:
            into.append(line.rstrip("\n"))

    def wait_for(self, text: str, timeout: float = 120.0) -> None:
        t0 = time.time()
        while not any(text in ln for ln in self.err + self.out):
            assert self.proc.poll() is None, f"exited ({self.proc.returncode}) before {text!r}: {self.err[-20:]}"
            assert time.time() - t0 < timeout, f"no {text!r} after {timeout} s: {self.err[-20:]}"
            time.sleep(0.01)

    def __enter__(self) -> "_Command":
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:  # a failed test: leave no process behind
            self.proc.kill()
            self.proc.wait()

    def interrupt(self, timeout: float = 60.0) -> tuple[int, float]:
        """Send SIGINT; (exit status, seconds from the signal to the exit)."""
        t0 = time.time()
        self.proc.send_signal(signal.SIGINT)
        code = self.proc.wait(timeout=timeout)
        took = time.time() - t0
        for t in self._readers:
            t.join(timeout=10)
        return code, took


def _assert_one_line(cmd: _Command, code: int, command: str) -> None:
    text = "\n".join(cmd.err)
    assert code == 130, (code, text[-3000:])
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    assert [ln for ln in cmd.err if ln.strip()][-1] == f"stare-jax {command}: interrupted (Ctrl-C)", text[-3000:]


@pytest.mark.parametrize("argv", [["config"], ["plan", "configs/tiny_cpu_stare.yaml"]], ids=["config", "plan"])
def test_ctrl_c_during_the_imports_is_one_line_and_130(argv):
    with _Command(*argv, env=_env()) as cmd:
        time.sleep(0.5)  # `import jax` is under way (the commands take ~2 s in all)
        assert cmd.proc.poll() is None, "the command ended before the signal: nothing was tested"
        code, _ = cmd.interrupt()
    _assert_one_line(cmd, code, argv[0])
    assert [ln for ln in cmd.err if ln.strip()] == [f"stare-jax {argv[0]}: interrupted (Ctrl-C)"]  # one line


@pytest.fixture(scope="module")
def tiny_eval(tmp_path_factory):
    """A tiny random HF folder with a byte-level tokenizer and a math500.jsonl of 4 problems."""
    from stare_jax import models
    from stare_jax.cli.smoke import byte_tokenizer

    d = tmp_path_factory.mktemp("ctrl_c_eval")
    cfg = models.ModelConfig(
        vocab_size=256,
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=64,
        max_position_embeddings=256,
        architecture="Qwen2ForCausalLM",
        qkv_bias=True,
    )
    models.save_pretrained(models.init_model(cfg, seed=0), d / "model")
    byte_tokenizer(d / "model")
    (d / "data").mkdir()
    rows = [{"id": str(i), "problem": f"{i}+1?", "answer": str(i + 1)} for i in range(4)]
    (d / "data" / "math500.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def test_ctrl_c_during_evals_compile_exits_at_once_without_a_crash(tiny_eval):
    """JAX_LOG_COMPILES says when the sampler's compile starts; 0.2 s later XLA is compiling (~3 s on 2 cores)
    in C++, where the main thread runs no Python signal handler: the watcher thread ends the process at once."""
    with _Command(
        "eval",
        "--checkpoint",
        tiny_eval / "model",
        "--data-dir",
        tiny_eval / "data",
        "--benchmarks",
        "math500",
        "--n",
        "2",
        "--max-new-tokens",
        "16",
        "--prompt-template",
        "raw",
        "--workers",
        "1",
        env=_env(JAX_LOG_COMPILES="1"),
    ) as cmd:
        cmd.wait_for("Compiling jit(_generate_core)")
        time.sleep(0.2)
        code, took = cmd.interrupt()
    _assert_one_line(cmd, code, "eval")  # not -11 (SIGSEGV)
    assert not any("Finished XLA compilation of jit(_generate_core)" in ln for ln in cmd.err), "compile had ended"
    assert took < 5.0, f"{took:.1f} s from Ctrl-C to the exit"
