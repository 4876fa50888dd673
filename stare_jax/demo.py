"""The README's main job: both arms of the embedded CPU default (GRPO-ds and STARE-O1) from one cached warm start,
the overlaid curves, a summary table and the checks of the paper's central picture at toy scale:

- GRPO-ds collapses: mean entropy of its last 10 steps < 0.5 x its first-step entropy;
- STARE holds: target >= 0.55 x STARE's first-step entropy, >= 90% of STARE's last-quarter steps within +-30% of
  the target, and GRPO-ds's last-quarter mean < 0.7 x that target;
- both learn: held-out accuracy (mean of the last 3 evaluations) >= 0.2 above its value before RL.
"""
from __future__ import annotations

import json
import pathlib
import time
from typing import Callable, Sequence

from stare_jax.config import load_config
from stare_jax.metrics import read_metrics
from stare_jax.plot import plot_runs, run_summary, summary_table
from stare_jax.run_config import ConfigChangeError, check_resume_config
from stare_jax.run_setup import TrainingError
from stare_jax.train import run_training

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
ARMS = (("grpo_ds", "tiny_cpu_grpo_ds.yaml"), ("stare_o1", "tiny_cpu_stare.yaml"))


def _eval_gain(run_dir) -> float | None:
    recs = read_metrics(run_dir)
    start = [r["eval_start/accuracy"] for r in recs if "eval_start/accuracy" in r]
    evals = [r["eval/accuracy"] for r in recs if "eval/accuracy" in r]
    if not start or not evals:
        return None
    last3 = evals[-3:]
    return sum(last3) / len(last3) - start[0]


def demo_checks(grpo_dir, stare_dir) -> list[tuple[str, float | None, str, bool]]:
    """(check, measured value, requirement, passed) for the demo's claims."""
    g, s = run_summary(grpo_dir), run_summary(stare_dir)
    target = s["target_entropy"]
    out = []

    def add(name, value, need, ok):
        out.append((name, value, need, bool(ok) if value is not None else False))

    ratio = g["last10_entropy"] / g["first_entropy"] if g["first_entropy"] else None
    add("GRPO-ds last-10 entropy / first-step entropy", ratio, "< 0.5", ratio is not None and ratio < 0.5)
    t_ratio = target / s["first_entropy"] if s["first_entropy"] else None
    add("STARE target / first-step entropy", t_ratio, ">= 0.55", t_ratio is not None and t_ratio >= 0.55)
    band = s["last_quarter_in_band"]
    add("STARE last-quarter steps within +-30% of target", band, ">= 0.9", band is not None and band >= 0.9)
    gq = g["last_quarter_entropy"] / target if target else None
    add("GRPO-ds last-quarter mean entropy / target", gq, "< 0.7", gq is not None and gq < 0.7)
    for name, d in (("GRPO-ds", grpo_dir), ("STARE", stare_dir)):
        gain = _eval_gain(d)
        add(f"{name} held-out accuracy gain (last 3 evals - start)", gain, ">= 0.2", gain is not None and gain >= 0.2)
    return out


def format_checks(checks) -> str:
    lines = ["| check | measured | required | pass |", "|---|---:|---:|:---:|"]
    for name, value, need, ok in checks:
        v = "n/a" if value is None else f"{value:.3f}"
        lines.append(f"| {name} | {v} | {need} | {'yes' if ok else 'NO'} |")
    return "\n".join(lines) + "\n"


def _checkpoint_steps(arm_dir: pathlib.Path) -> list[int]:
    d = arm_dir / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


def train_arm(arm: str, cfg, arm_dir: pathlib.Path, *, what: str = "demo",
              log: Callable[[str], None] = print) -> dict:
    """Train one arm into arm_dir, continuing it from its checkpoint when interrupted and reusing it when finished
    (the same config is required: a changed setting stops with the changed keys). Returns {"reused": bool,
    "stopped": None or where a stop signal ended it, "wall_s": the arm's training wall time (a reused arm: the
    time its summary.json recorded)}."""
    done = _checkpoint_steps(arm_dir)
    if done:
        try:
            check_resume_config(arm_dir, cfg, allow=False, run_dir=str(arm_dir))
        except ConfigChangeError as e:
            raise TrainingError(f"{what}: {arm_dir} was trained with other settings ({e.summary()}); run the "
                                f"{what} with the overrides it was started with, or pass a new --run-dir") from None
    elif (arm_dir / "metrics.jsonl").exists():
        raise TrainingError(f"{what}: {arm_dir} holds an arm that stopped before its first checkpoint; delete "
                            f"{arm_dir} or pass a new --run-dir")
    if done and done[-1] >= cfg.total_steps:
        log(f"{what}: arm {arm} already finished in {arm_dir} ({done[-1]} steps), reusing it")
        summary = json.loads((arm_dir / "summary.json").read_text()) if (arm_dir / "summary.json").exists() else {}
        return {"reused": True, "stopped": None, "wall_s": summary.get("wall_s")}
    log(f"{what}: training arm {arm} -> {arm_dir}" if not done else
        f"{what}: continuing arm {arm} in {arm_dir} from its checkpoint at step {done[-1]}")
    summary = run_training(cfg, arm_dir, resume=bool(done), log=log)
    stopped = None
    if summary["stopped"]:
        step = (summary.get("last") or {}).get("step", "?")
        stopped = f"{arm} after step {step}"
        log(f"{what}: stopped by a signal during arm {arm} after step {step} (saved); run the same command again "
            f"to continue from there")
    return {"reused": False, "stopped": stopped, "wall_s": summary["wall_s"]}


def run_demo(run_dir: str | pathlib.Path, overrides: Sequence[str] = (), *,
             log: Callable[[str], None] = print) -> dict:
    """Train both arms into run_dir/<arm>, then write run_dir/curves.png and run_dir/summary.md.

    Run again on the same run_dir, it continues an interrupted arm from its checkpoint and reuses a finished one
    (the same overrides are required: a changed setting stops it with the changed keys). A stop signal (Ctrl-C,
    SIGTERM) ends the demo after the current step's checkpoint; result["stopped"] then says where."""
    run_dir = pathlib.Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise TrainingError(f"demo: --run-dir {run_dir} is a file; give a folder (default runs/demo)")
    t0 = time.time()
    dirs: list[pathlib.Path] = []
    reused: list[str] = []
    for arm, cfg_file in ARMS:
        arm_dir = run_dir / arm
        result = train_arm(arm, load_config(CONFIGS / cfg_file, overrides), arm_dir, log=log)
        if result["stopped"]:
            return {"run_dirs": [str(d) for d in dirs + [arm_dir]], "stopped": result["stopped"],
                    "wall_s": time.time() - t0}
        if result["reused"]:
            reused.append(arm)
        dirs.append(arm_dir)
    plot = plot_runs(dirs, run_dir / "curves.png", title="embedded CPU default: GRPO-ds vs STARE-O1")
    checks = demo_checks(*dirs)
    wall = time.time() - t0
    text = ("# stare-jax demo\n\n" + summary_table(dirs) + "\n" + format_checks(checks)
            + (f"\nwall time {wall:.0f} s (both arms, including tokenizer training and the warm start if not cached)"
               if not reused else f"\nwall time {wall:.0f} s (finished arms reused: {', '.join(reused)})")
            + f"\ncurves: {plot}\n")
    (run_dir / "summary.md").write_text(text)
    log(text)
    return {"run_dirs": [str(d) for d in dirs], "plot": str(plot), "checks": checks, "wall_s": wall,
            "stopped": None}
