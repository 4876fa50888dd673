"""The README's headline, run as a user runs it: `stare-jax demo` (and `--scenario tool`) end to end in a fresh
process with its own fresh toy cache (tokenizer, data and warm start built anew), one CPU device as on a laptop, and
every check of its summary must pass. System tier: ~2 min (default) and ~5 min (tool) on 2 cores; .ci/run runs it.
benchmarks/demo_seeds.py measures the same claims over 10 seeds and perturbed numerics."""

import os
import pathlib
import subprocess
import sys

from stare_jax.experiments.demo import SCENARIOS, demo_checks, format_checks

REPO = pathlib.Path(__file__).resolve().parents[2]


def _run_demo(tmp_path, scenario: str):
    out = tmp_path / "demo"
    cmd = [
        sys.executable,
        "-m",
        "stare_jax.cli",
        "demo",
        "--scenario",
        scenario,
        "--run-dir",
        str(out),
        f"toy.cache_dir={tmp_path / 'toy'}",
        "logging.progress_bar=false",
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}  # as a user's shell
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    (grpo, _), (stare, _) = SCENARIOS[scenario]
    checks = demo_checks(out / grpo, out / stare, tool=scenario == "tool")
    assert all(c.passed for c in checks), format_checks(checks)
    summary = (out / "summary.md").read_text()
    assert f"all {len(checks)} checks pass" in summary and "NO |" not in summary
    return checks


def test_default_demo_passes_every_check(tmp_path):
    checks = _run_demo(tmp_path, "default")
    assert len(checks) == 6


def test_tool_demo_passes_every_check(tmp_path):
    checks = _run_demo(tmp_path, "tool")
    assert len(checks) == 8
