"""`stare-jax demo --scenario tool` at tiny settings: both arms through the multi-turn tool rollouts (the tool_mul
task, the local sandbox), the evaluations with and without the tool, the tool checks in the table, the plot's tool
panels; and the scenario's bad input."""

import json
import pathlib
import subprocess
import sys

import pytest

from stare_jax import cli
from stare_jax.config.loader import load_config
from stare_jax.experiments.demo import CONFIGS, SCENARIOS, run_demo
from stare_jax.training.setup import TrainingError
from support.cli import cli_env

REPO = pathlib.Path(__file__).resolve().parents[2]

TINY = [
    "toy.hidden_size=32",
    "toy.num_layers=2",
    "toy.sft_steps=5",
    "toy.num_train=100",
    "toy.num_eval=4",
    "rl.train_batch_size=2",
    "rl.group_size=4",
    "rl.gen_batch_size=2",
    "rl.micro_batch_size=8",
    "rl.dynamic_sampling=false",
    "logging.eval_every_steps=2",
    "logging.tensorboard=false",
    "logging.progress_bar=false",
    "checkpoint.async_save=false",
    "sampling.eval_num_samples=2",
    "total_steps=2",
    "tool.max_workers=2",
]


def test_tool_configs_differ_only_in_stare():
    g, s = (load_config(CONFIGS / name) for _, name in SCENARIOS["tool"])
    for cfg in (g, s):
        assert cfg.tool.enabled and cfg.tool.format == "retool" and cfg.tool.eval_without_tool
        assert cfg.toy.task == cfg.data.task == "tool_mul"
    assert not g.rl.stare.enabled and s.rl.stare.enabled
    assert g.rl.stare.target_entropy == s.rl.stare.target_entropy  # one band for the plot


@pytest.mark.slow  # ~100 s on 2 busy cores (load ~8): the sandbox calls and the engine's compiles
def test_tool_demo_end_to_end(tmp_path):
    """The CLI in a subprocess with one CPU device (the rollout engine does not split its slots over data
    shards; the suite's 8 fake devices would)."""
    out = tmp_path / "demo"
    cmd = [
        sys.executable,
        "-m",
        "stare_jax.cli",
        "demo",
        "--scenario",
        "tool",
        "--run-dir",
        str(out),
        f"toy.cache_dir={tmp_path / 'toy'}",
        *TINY,
    ]
    env = cli_env()
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-3000:]
    assert (out / "curves.png").stat().st_size > 0
    recs = [json.loads(line) for line in (out / "grpo_ds" / "metrics.jsonl").read_text().splitlines()]
    first, last = recs[0], recs[-1]
    assert 0 <= first["tool/calls_per_response"] <= 2 and "tool/errored_call_frac" in first
    for key in ("eval_start/accuracy", "eval_start/tool/calls_per_response", "eval_start_notool/accuracy"):
        assert 0 <= first[key] <= 2, key
    for key in ("eval/accuracy", "eval/tool/calls_per_response", "eval_notool/accuracy"):
        assert key in last, key
    summary = (out / "summary.md").read_text()
    assert "--scenario tool" in summary and "tool disabled (max over evals, both arms)" in summary
    assert summary.count("tool calls per response rise") == 2
    assert "STARE target / first-step entropy" not in summary  # a default-scenario check only


def test_unknown_scenario(tmp_path, capsys):
    with pytest.raises(TrainingError, match="unknown --scenario 'tools'"):
        run_demo(tmp_path, scenario="tools")
    with pytest.raises(SystemExit):
        cli.main(["demo", "--scenario", "tools", "--run-dir", str(tmp_path)])
    assert "invalid choice: 'tools'" in capsys.readouterr().err
