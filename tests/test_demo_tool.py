"""`stare-jax demo --scenario tool` at tiny settings: both arms through the multi-turn tool rollouts (the tool_mul
task, the local sandbox), the evaluations with and without the tool, the tool checks in the table, the plot's tool
panels; and the scenario's bad input."""
import json

import pytest

from stare_jax import cli
from stare_jax.config import load_config
from stare_jax.demo import CONFIGS, SCENARIOS, format_checks, run_demo
from stare_jax.run_setup import TrainingError

TINY = [
    "toy.hidden_size=32", "toy.num_layers=2", "toy.sft_steps=5", "toy.num_train=100", "toy.num_eval=4",
    "rl.train_batch_size=2", "rl.group_size=4", "rl.gen_batch_size=2", "rl.micro_batch_size=8",
    "rl.dynamic_sampling=false", "logging.eval_every_steps=2", "logging.tensorboard=false",
    "logging.progress_bar=false", "checkpoint.async_save=false", "sampling.eval_num_samples=2", "total_steps=2",
    "tool.max_workers=2",
]


def test_tool_configs_differ_only_in_stare():
    g, s = (load_config(CONFIGS / name) for _, name in SCENARIOS["tool"])
    for cfg in (g, s):
        assert cfg.tool.enabled and cfg.tool.format == "retool" and cfg.tool.eval_without_tool
        assert cfg.toy.task == cfg.data.task == "tool_mul"
    assert not g.rl.stare.enabled and s.rl.stare.enabled
    assert g.rl.stare.target_entropy == s.rl.stare.target_entropy  # one band for the plot


@pytest.mark.slow
def test_tool_demo_end_to_end(tmp_path):
    out = run_demo(tmp_path / "demo", [f"toy.cache_dir={tmp_path / 'toy'}", *TINY], scenario="tool",
                   log=lambda *_: None)
    assert out["stopped"] is None and (tmp_path / "demo" / "curves.png").stat().st_size > 0
    recs = [json.loads(line) for line in (tmp_path / "demo" / "grpo_ds" / "metrics.jsonl").read_text().splitlines()]
    first, last = recs[0], recs[-1]
    assert 0 <= first["tool/calls_per_response"] <= 2 and "tool/errored_call_frac" in first
    for key in ("eval_start/accuracy", "eval_start/tool/calls_per_response", "eval_start_notool/accuracy"):
        assert 0 <= first[key] <= 2, key
    for key in ("eval/accuracy", "eval/tool/calls_per_response", "eval_notool/accuracy"):
        assert key in last, key
    names = [c[0] for c in out["checks"]]
    assert "held-out accuracy with the tool disabled (max over evals, both arms)" in names
    assert sum("tool calls per response rise" in n for n in names) == 2
    table = format_checks(out["checks"])
    assert "tool disabled" in table and "--scenario tool" in (tmp_path / "demo" / "summary.md").read_text()


def test_unknown_scenario(tmp_path, capsys):
    with pytest.raises(TrainingError, match="unknown --scenario 'tools'"):
        run_demo(tmp_path, scenario="tools")
    with pytest.raises(SystemExit):
        cli.main(["demo", "--scenario", "tools", "--run-dir", str(tmp_path)])
    assert "invalid choice: 'tools'" in capsys.readouterr().err
