"""Every `stare-jax` subcommand turns wrong inputs into one line on stderr naming the fix, exit status 2, and no
traceback (tracebacks are for bugs); `--help` lists what --benchmarks accepts; `plot` of the demo's folder plots
its arms; `smoke` prints text as well as token ids."""

import json
import pathlib
import subprocess
import sys

import pytest

from stare_jax import cli
from stare_jax.cli.smoke import byte_tokenizer

REPO = pathlib.Path(__file__).resolve().parents[2]


def _main(capsys, *argv):
    """(exit status, stdout, stderr) of `stare-jax ARGV` run in this process (an exception would fail the test)."""
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _assert_one_line_error(result, *needles):
    code, _, err = result
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2, (code, err)
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith("stare-jax"), lines[0]
    for n in needles:
        assert n in lines[0], (n, lines[0])


@pytest.fixture(scope="module")
def small_context_model(tmp_path_factory):
    """A tiny random HF folder whose context is 64 tokens, with a byte-level tokenizer, and a math500.jsonl."""
    from stare_jax import models

    d = tmp_path_factory.mktemp("small_ctx")
    model_dir = d / "model"
    cfg = models.ModelConfig(
        vocab_size=256,
        hidden_size=32,
        num_layers=1,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=64,
        max_position_embeddings=64,
        architecture="Qwen2ForCausalLM",
        qkv_bias=True,
    )
    models.save_pretrained(models.init_model(cfg, seed=0), model_dir)
    byte_tokenizer(model_dir)
    data = d / "data"
    data.mkdir()
    (data / "math500.jsonl").write_text(
        "".join(json.dumps({"id": str(i), "problem": f"{i}+1?", "answer": str(i + 1)}) + "\n" for i in range(3))
    )
    return model_dir, data


@pytest.fixture()
def runs(tmp_path):
    """A folder like `stare-jax demo`'s: two arms as sub-runs, no metrics.jsonl of its own."""
    from stare_jax.training.metrics import MetricsWriter

    demo = tmp_path / "demo"
    for arm, w in (("grpo_ds", 1.0), ("stare_o1", 4.0)):
        with MetricsWriter(demo / arm, tensorboard=False, is_main_process=True) as wr:
            for step in range(1, 9):
                wr.log(
                    step,
                    {
                        "entropy": 1.0 / step,
                        "target_entropy": 0.7,
                        "reward_mean": 0.1 * step,
                        "accuracy": 0.1 * step,
                        "response_len_mean": 5.0,
                        "gate_on": step > 4,
                        "stare_w": w,
                        "stare_m": 0.9 if w > 1 else 1.0,
                        "stare_enabled": w > 1,
                        **({"eval_start/accuracy": 0.33} if step == 1 else {}),
                        **({"eval/accuracy": 0.05 * step} if step % 4 == 0 else {}),
                    },
                )
    return demo


def test_demo_wrong_inputs(capsys, tmp_path):
    _assert_one_line_error(_main(capsys, "demo", "--config", "configs/tiny_cpu_stare.yaml"), "--config is not used")
    _assert_one_line_error(_main(capsys, "demo", "--run-dir", tmp_path, "rl.stare.ww=2"), "rl.stare.ww")
    (tmp_path / "afile").write_text("x")
    result = _main(capsys, "demo", "--run-dir", tmp_path / "afile")
    _assert_one_line_error(result, "stare-jax demo: --run-dir", "is a file")  # the command named once


def test_demo_exit_status_follows_its_checks(capsys, monkeypatch):
    """A demo whose checks fail on this machine exits 1 (its summary's last line names them); all pass: 0; a stop
    signal that saved the run: its last line (stderr) says which and where; Ctrl-C exits 130, SIGTERM 0."""
    from stare_jax.cli import demo as demo_cmd
    from stare_jax.experiments.demo import Check

    ok, bad = Check("a", 1.0, ">=", 0.5), Check("b", 0.1, ">=", 0.5)
    saved = "during arm stare_o1: saved checkpoint runs/demo/stare_o1/checkpoints/3"
    for checks, stopped, sig, status in (
        ([ok, ok], None, None, 0),
        ([ok, bad], None, None, 1),
        ([], f"interrupted (Ctrl-C) {saved}", "SIGINT", 130),
        ([], f"preemption signal (SIGTERM) {saved}", "SIGTERM", 0),
    ):
        result = {"checks": checks, "stopped": stopped, "stop_signal": sig}
        monkeypatch.setattr(demo_cmd, "run_demo", lambda *a, _r=result, **k: _r)
        code, _, err = _main(capsys, "demo")
        assert code == status
        if stopped:
            assert err.strip().splitlines()[-1] == f"stare-jax demo: {stopped}; run the same command again to continue"


def test_train_wrong_inputs(capsys, tmp_path):
    _assert_one_line_error(
        _main(capsys, "train", "--run-dir", tmp_path / "r", "--config", tmp_path / "nope.yaml"), "config file not found"
    )
    _assert_one_line_error(_main(capsys, "train", "--run-dir", tmp_path / "r", "rl.stare.w=0.5"), "rl.stare.w")
    _assert_one_line_error(_main(capsys, "train", "--run-dir", tmp_path / "r", "--require-checkpoint"), "--resume")
    _assert_one_line_error(_main(capsys, "train", "--run-dir", tmp_path / "r", "--allow-config-change"), "--resume")
    _assert_one_line_error(_main(capsys, "train", "--run-dir", tmp_path / "r"), "model.path is not set")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    _assert_one_line_error(
        _main(
            capsys, "train", "--run-dir", tmp_path / "r", f"model.path={hf}", f"data.train_path={tmp_path / 'no.jsonl'}"
        ),
        "no.jsonl",
    )
    old = tmp_path / "old"
    old.mkdir()
    (old / "metrics.jsonl").write_text('{"step": 1}\n')
    _assert_one_line_error(
        _main(capsys, "train", "--run-dir", old, f"model.path={hf}", "data.train_path=x.jsonl"),
        "already holds a run",
        "--resume",
    )
    with pytest.raises(SystemExit) as e:  # argparse: usage + one error line, status 2
        cli.main(["train"])
    assert e.value.code == 2 and "--run-dir" in capsys.readouterr().err


def test_eval_wrong_inputs(capsys, tmp_path, small_context_model):
    model_dir, data = small_context_model
    base = ["eval", "--checkpoint", model_dir, "--data-dir", data, "--benchmarks", "math500"]
    _assert_one_line_error(
        _main(capsys, "eval", "--checkpoint", model_dir, "--data-dir", data, "--benchmarks", "math501"),
        "math501",
        "aime24, aime25, amc23, math500",
    )
    _assert_one_line_error(
        _main(capsys, "eval", "--checkpoint", model_dir, "--data-dir", tmp_path / "nodata", "--benchmarks", "gsm8k"),
        "gsm8k_test.jsonl",
        "--data-dir",
    )
    _assert_one_line_error(
        _main(capsys, "eval", "--checkpoint", tmp_path / "nomodel", "--data-dir", data, "--benchmarks", "math500"),
        "nomodel",
        "Hugging Face folder",
    )
    _assert_one_line_error(_main(capsys, *base, "--limit", "-1"), "--limit -1")
    # the default --max-new-tokens (3072) on a 64-token model: the largest value that fits is named
    code, _, err = _main(capsys, *base, "--prompt-template", "raw")
    _assert_one_line_error((code, "", err), "context of 64 tokens", "--max-new-tokens")
    longest = max(len(f"{i}+1?") for i in range(3))  # byte tokenizer: one token per character
    assert f"pass --max-new-tokens {64 - longest} or less" in err
    _assert_one_line_error(
        _main(capsys, *base, "--prompt-template", "raw", "--max-prompt-len", "2"), "--max-prompt-len"
    )


def test_export_wrong_inputs(capsys, tmp_path, small_context_model):
    _assert_one_line_error(_main(capsys, "export", tmp_path / "norun", tmp_path / "out"), "norun", "not a folder")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "f").write_text("x")
    _assert_one_line_error(_main(capsys, "export", small_context_model[0], tmp_path / "out"), "not empty")
    (tmp_path / "run").mkdir()  # neither an HF folder nor a run folder
    _assert_one_line_error(_main(capsys, "export", tmp_path / "run", tmp_path / "out2"), "neither")


def test_plot_wrong_inputs(capsys, tmp_path):
    _assert_one_line_error(_main(capsys, "plot", tmp_path / "nope"), "nope", "does not exist")
    (tmp_path / "empty").mkdir()
    _assert_one_line_error(_main(capsys, "plot", tmp_path / "empty"), "no metrics.jsonl")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "metrics.jsonl").write_text('{"step":1,"entropy":0.5}\n{"step":2,"entropy":\n{"step":3}\n')
    _assert_one_line_error(_main(capsys, "plot", bad), "line 2")
    (bad / "metrics.jsonl").write_text("")
    _assert_one_line_error(_main(capsys, "plot", bad), "no step records")


def test_plot_of_the_demo_folder_plots_its_arms(capsys, runs):
    """... into RUN_DIR/plot.png: the demo's own curves.png (titled, named in its summary.md) is left as it was."""
    (runs / "curves.png").write_bytes(b"the demo's plot")
    code, out, err = _main(capsys, "plot", runs)
    assert code == 0, err
    assert (runs / "plot.png").is_file() and "| grpo_ds |" in out and "| stare_o1 |" in out
    assert f"wrote {runs / 'plot.png'}" in out
    assert (runs / "curves.png").read_bytes() == b"the demo's plot"


def test_smoke_wrong_inputs_and_text(capsys, tmp_path):
    _assert_one_line_error(_main(capsys, "smoke", "--run-dir", tmp_path / "s", "--new-tokens", "0"), "--new-tokens")
    _assert_one_line_error(
        _main(capsys, "smoke", "--run-dir", tmp_path / "s", "--model", tmp_path / "nomodel"), "nomodel", "config.json"
    )
    code, out, err = _main(capsys, "smoke", "--run-dir", tmp_path / "s", "--new-tokens", "3")
    assert code == 0, err
    assert "text: 'The answer is' -> " in out and "generated [" in out
    res = json.loads((tmp_path / "s" / "smoke.json").read_text())
    assert res["text"][1]["prompt"] == "1 + 2 =" and len(res["generated"][0]) == 3


def test_config_plan_convert_smollm2_wrong_inputs(capsys, tmp_path):
    _assert_one_line_error(_main(capsys, "config", "--config", tmp_path / "nope.yaml"), "config file not found")
    _assert_one_line_error(_main(capsys, "config", "rl.stare.w=abc"), "rl.stare.w")
    _assert_one_line_error(_main(capsys, "plan", tmp_path / "nope.yaml"), "config file not found")
    _assert_one_line_error(_main(capsys, "plan", "configs/tiny_cpu_stare.yaml", "--accelerator", "v9z-3"), "v9z-3")
    _assert_one_line_error(_main(capsys, "convert", tmp_path / "m.gguf", tmp_path / "out"), "m.gguf", "not found")
    (tmp_path / "afile").write_text("x")
    _assert_one_line_error(_main(capsys, "smollm2", tmp_path / "afile"), "is a file")


def test_ctrl_c_outside_a_training_loop_is_one_line(capsys, monkeypatch):
    """A KeyboardInterrupt raised by code is one line too (a real Ctrl-C: tests/integration/test_signals.py); main()
    puts SIGINT's handler back as it was."""
    import signal

    def interrupted(args):
        raise KeyboardInterrupt

    from stare_jax.cli import config as config_command

    monkeypatch.setattr(config_command, "run", interrupted)
    before = signal.getsignal(signal.SIGINT)
    code, _, err = _main(capsys, "config")
    assert code == 130 and "Traceback" not in err and err.strip() == "stare-jax config: interrupted (Ctrl-C)"
    assert signal.getsignal(signal.SIGINT) == before


def test_eval_says_its_progress_per_benchmark(capsys, small_context_model):
    """`stare-jax eval` prints a progress line per benchmark on stderr as its samples finish (EvalProgress)."""
    model_dir, data = small_context_model
    code, out, err = _main(
        capsys,
        "eval",
        "--checkpoint",
        model_dir,
        "--data-dir",
        data,
        "--benchmarks",
        "math500",
        "--n",
        "2",
        "--max-new-tokens",
        "8",
        "--prompt-template",
        "raw",
        "--batch-prompts",
        "2",
        "--workers",
        "1",
    )
    assert code == 0, err
    progress = [ln for ln in err.splitlines() if ln.startswith("stare-jax eval: math500: ")]
    assert progress and progress[0].startswith("stare-jax eval: math500: 4/6 samples, "), err  # the first batch
    assert progress[-1].startswith("stare-jax eval: math500: 6/6 samples, ") and "tokens/s" in progress[-1], err
    assert "| math500 | 3 | 2 |" in out


def test_benchmarks_help_lists_the_accepted_names_and_defaults(capsys):
    from stare_jax.eval.benchmarks import DEFAULT_PROTOCOL

    with pytest.raises(SystemExit):
        cli.main(["eval", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in DEFAULT_PROTOCOL:
        assert name in text
    assert "--n N, --samples N" in text
    assert "--limit LIMIT first N problems of each benchmark (default: 0 = all)" in text
    assert "aime24 32" in text and "math500 4" in text and "(default: 3072)" in text


def test_no_traceback_from_a_real_process(tmp_path):
    """The same from the command line (the installed entry point's module), for one case."""
    p = subprocess.run(
        [sys.executable, "-m", "stare_jax.cli", "plot", str(tmp_path / "nope")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2 and "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_help_loads_no_command_module_and_no_jax():
    """`stare-jax --help` lists every subcommand without importing their modules (nor jax): instant."""
    code = (
        "import sys; from stare_jax.cli import COMMANDS, main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in sys.modules if m == 'jax' or m.startswith('stare_jax.cli.')))"
    )
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    *_, loaded = p.stdout.strip().splitlines()
    assert loaded == "['stare_jax.cli.common', 'stare_jax.cli.signals']", loaded  # the light helpers only
    for name in cli.COMMANDS:
        assert name in p.stdout


def test_eval_flags_are_overrides_of_config_keys():
    """eval's flags that are run-config keys are read through the config loader: absent, the config's defaults;
    given, overrides of their keys (the help names the key and its default)."""
    from stare_jax.cli import eval as eval_command
    from stare_jax.config.loader import Config

    def resolve(*argv):
        return eval_command.eval_config(cli.build_parser(["eval"]).parse_args(["eval", "--checkpoint", "x", *argv]))

    assert resolve() == Config()
    cfg = resolve(
        "--samples",
        "2",
        "--max-new-tokens",
        "96",
        "--max-prompt-len",
        "128",
        "--prompt-template",
        "raw",
        "--engine",
        "off",
        "--slots",
        "4",
        "--seed",
        "3",
    )
    assert (cfg.sampling.eval_num_samples, cfg.sampling.max_new_tokens, cfg.data.max_prompt_len) == (2, 96, 128)
    assert (cfg.data.prompt_template, cfg.sampling.engine.enabled, cfg.sampling.engine.max_slots, cfg.seed) == (
        "raw",
        False,
        4,
        3,
    )
    assert resolve("--engine", "on").sampling.engine.enabled is True
    assert resolve("--engine", "auto").sampling.engine.enabled == "auto"
    with pytest.raises(cli.UsageError, match="--max-new-tokens 0 must be >= 1"):
        resolve("--max-new-tokens", "0")
    assert set(eval_command.FLAG_KEYS) <= set(
        vars(cli.build_parser(["eval"]).parse_args(["eval", "--checkpoint", "x"]))
    )
