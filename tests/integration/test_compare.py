"""`stare-jax compare` on a very small toy: 2 methods x 1 seed, a few steps, in-process; the files it writes, the
table's columns, one colour per method in the plot, reuse of finished arms, and bad input."""

import json

import pytest

from stare_jax import cli
from stare_jax.config.loader import load_config
from stare_jax.experiments.compare import (
    DEFAULT_METHODS,
    JSON_NAME,
    METHODS,
    PLOT_NAME,
    TABLE_COLUMNS,
    TABLE_NAME,
    run_compare,
)
from stare_jax.experiments.demo import CONFIGS
from stare_jax.training.setup import TrainingError

TINY = [
    "toy.hidden_size=32",
    "toy.num_layers=2",
    "toy.sft_steps=5",
    "toy.num_train=200",
    "toy.num_eval=8",
    "rl.train_batch_size=4",
    "rl.group_size=4",
    "rl.gen_batch_size=8",
    "rl.micro_batch_size=2",
    "rl.dynamic_sampling=false",
    "logging.eval_every_steps=2",
    "logging.tensorboard=false",
    "logging.progress_bar=false",
    "checkpoint.async_save=false",
    "sampling.eval_num_samples=2",
    "total_steps=2",
]


def test_every_method_has_a_config_that_loads():
    assert set(DEFAULT_METHODS) <= set(METHODS)
    for method, name in METHODS.items():
        cfg = load_config(CONFIGS / name)
        assert cfg.toy.enabled and cfg.rl.stare.target_entropy == 0.7, method  # one band for the plot


def test_two_methods_one_seed(tmp_path):
    over = [f"toy.cache_dir={tmp_path / 'toy'}", *TINY]
    logs = []
    out = run_compare(tmp_path / "cmp", ["grpo_ds", "grpo_kl"], [0], over, log=logs.append)
    run = tmp_path / "cmp"
    for f in (PLOT_NAME, TABLE_NAME, JSON_NAME):
        assert (run / f).is_file() and (run / f).stat().st_size > 0, f
    assert (run / "grpo_ds-seed0" / "metrics.jsonl").is_file() and (run / "grpo_kl-seed0" / "metrics.jsonl").is_file()
    header = (run / TABLE_NAME).read_text().splitlines()[2]
    assert [c.strip() for c in header.strip("|").split("|")] == list(TABLE_COLUMNS)
    data = json.loads((run / JSON_NAME).read_text())
    assert [r["method"] for r in data["methods"]] == ["grpo_ds", "grpo_kl"] and data["wall_s"] > 0
    for r in data["methods"]:
        assert r["steps"] == 2 and r["target_entropy"] == 0.7 and r["wall_s"] > 0
        assert r["first_entropy"] > 0 and 0 <= r["last_quarter_in_band"] <= 1
        assert 0 <= r["start_eval_accuracy"] <= 1 and 0 <= r["final_eval_accuracy"] <= 1
    assert out["stopped"] is None
    # run again: finished arms are reused, not retrained
    again = run_compare(run, ["grpo_ds", "grpo_kl"], [0], over, log=logs.append)
    assert json.loads((run / JSON_NAME).read_text())["reused"] == ["grpo_ds-seed0", "grpo_kl-seed0"]
    assert again["wall_s"] < out["wall_s"]
    # another setting on the same folder is refused with the changed key (demo.train_arm, shared with the demo)
    with pytest.raises(TrainingError, match=r"grpo_ds-seed0 was trained with other settings.*rl.clip_high"):
        run_compare(run, ["grpo_ds"], [0], [*over, "rl.clip_high=0.3"], log=logs.append)


def test_bad_input(tmp_path):
    with pytest.raises(TrainingError, match=r"unknown method\(s\) \['grpo_kll'\] \(did you mean grpo_kl\?\)"):
        run_compare(tmp_path, ["grpo_kll"])
    with pytest.raises(TrainingError, match="seeds"):
        run_compare(tmp_path, ["grpo_ds"], [0, 0])
    (tmp_path / "file").write_text("x")
    with pytest.raises(TrainingError, match="is a file"):
        run_compare(tmp_path / "file", ["grpo_ds"])


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--methods", "grpo,stare_o1"], "unknown method(s) ['grpo']"),
        (["--seeds", "0,x"], "--seeds '0,x': expected comma-separated integers"),
        (["--config", "configs/tiny_cpu_stare.yaml"], "--config is not used"),
    ],
)
def test_cli_bad_input_is_one_line_exit_2(argv, message, capsys, tmp_path):
    code = cli.main(["compare", "--run-dir", str(tmp_path / "cmp"), *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and len(err.splitlines()) == 1, err
