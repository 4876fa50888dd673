"""The README's main job: both arms of the embedded CPU default (GRPO-ds and STARE-O1) from one cached warm start,
the overlaid curves, a summary table and the checks of the paper's central picture at toy scale:

- GRPO-ds collapses: mean entropy of its last 10 steps < 0.5 x its first-step entropy;
- STARE holds: target >= 0.55 x STARE's first-step entropy, >= 90% of STARE's last-quarter steps within +-30% of
  the target, and GRPO-ds's last-quarter mean < 0.7 x that target;
- both learn: held-out accuracy (mean of the last 3 evaluations) >= 0.2 above its value before RL.

`--scenario tool` runs the same two arms on multi-turn tool use (configs/tiny_cpu_tool_*.yaml: the tool_mul toy
task, stare_jax/tasks/tool_mul.py, with the sandboxed code interpreter in the retool format; evaluations run through
the tool rollouts too) and adds its checks:

- the tool is needed: held-out accuracy with the tool disabled (eval_notool/, the model's code gets no reply) stays
  <= 0.2 at every evaluation of both arms;
- tool use rises under RL: held-out tool calls per response, mean of the last 3 evaluations above the value before
  RL, for both arms.

The default's "target >= 0.55 x STARE's first-step entropy" is not checked there: the tool warm start's entropy
(~1 nat/token) is mostly its deliberate noise (guessed answers of random digits, random digits in D), while a policy
that always answers correctly has at most ~k ln|set| / (~2k + 8 model tokens) ~ 0.36 nats/token (the choice of D is
the only free part of a correct response); its STARE arm is STARE-C2 (top 10%) with the paper's target 0.3, below
that ceiling, and GRPO-ds must still fall below 0.7 x it.

Both STARE arms use the paper's adaptive weights (W += alpha sgn(H_tgt - H) each step, clipped to [1, W_max]; M
mirrored), sized for the toy in their configs: an integral controller, so the band holds wherever a machine's
numerics put the critical weight, not only where a fixed W was tuned (docs/demo.md: "Why a fixed W lost the band").
benchmarks/demo_seeds.py measures the checks over seeds and perturbed numerics; tests/system/test_demo_claims.py runs
both scenarios end to end and asserts every check.
"""

from __future__ import annotations

import json
import pathlib
import time
from typing import Callable, NamedTuple, Sequence

from stare_jax.config.loader import load_config
from stare_jax.config.resume import ConfigChangeError, check_resume_config
from stare_jax.experiments.plot import plot_runs, run_summary, summary_table
from stare_jax.toy.assets import run_inputs
from stare_jax.training.loop import run_training
from stare_jax.training.metrics import read_metrics
from stare_jax.training.setup import TrainingError

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs"
# scenario -> the two arms (name, config), GRPO-ds first
SCENARIOS = {
    "default": (("grpo_ds", "tiny_cpu_grpo_ds.yaml"), ("stare_o1", "tiny_cpu_stare.yaml")),
    "tool": (("grpo_ds", "tiny_cpu_tool_grpo_ds.yaml"), ("stare_c2", "tiny_cpu_tool_stare.yaml")),
}
ARMS = SCENARIOS["default"]
TITLES = {
    "default": "embedded CPU default: GRPO-ds vs STARE-O1",
    "tool": "embedded CPU tool use (tool_mul + code interpreter): GRPO-ds vs STARE-C2",
}


def _eval_gain(run_dir, key: str = "accuracy") -> float | None:
    """Mean of the last 3 evaluations of eval/<key> minus its value before RL (eval_start/<key>)."""
    recs = read_metrics(run_dir)
    start = [r[f"eval_start/{key}"] for r in recs if f"eval_start/{key}" in r]
    evals = [r[f"eval/{key}"] for r in recs if f"eval/{key}" in r]
    if not start or not evals:
        return None
    last3 = evals[-3:]
    return sum(last3) / len(last3) - start[0]


def _max_eval(run_dirs, keys: Sequence[str]) -> float | None:
    """The largest value of any of `keys` over every record of the runs (None when none has them)."""
    vals = [r[k] for d in run_dirs for r in read_metrics(d) for k in keys if k in r]
    return max(vals) if vals else None


class Check(NamedTuple):
    """One claim of the demo: `value op bound` (e.g. in-band fraction >= 0.9). margin: how far the measured value
    is on the passing side of the bound (negative = failed by that much; None when not measured)."""

    name: str
    value: float | None
    op: str  # "<", "<=", ">=" or ">"
    bound: float

    @property
    def need(self) -> str:
        return f"{self.op} {self.bound:g}"

    @property
    def margin(self) -> float | None:
        if self.value is None:
            return None
        return self.value - self.bound if self.op in (">=", ">") else self.bound - self.value

    @property
    def passed(self) -> bool:
        m = self.margin
        return m is not None and (m > 0 if self.op in ("<", ">") else m >= 0)


def demo_checks(grpo_dir, stare_dir, *, tool: bool = False) -> list[Check]:
    """The demo's claims (tool: the tool scenario's too), measured on the two arms' run folders."""
    g, s = run_summary(grpo_dir), run_summary(stare_dir)
    target = s["target_entropy"]

    def ratio(a, b):
        return a / b if a is not None and b else None

    out = [
        Check("GRPO-ds last-10 entropy / first-step entropy", ratio(g["last10_entropy"], g["first_entropy"]), "<", 0.5)
    ]
    if not tool:  # the tool warm start's entropy is mostly its deliberate noise (guessed answers): no such bound
        out.append(Check("STARE target / first-step entropy", ratio(target, s["first_entropy"]), ">=", 0.55))
    out.append(Check("STARE last-quarter steps within +-30% of target", s["last_quarter_in_band"], ">=", 0.9))
    out.append(Check("GRPO-ds last-quarter mean entropy / target", ratio(g["last_quarter_entropy"], target), "<", 0.7))
    for name, d in (("GRPO-ds", grpo_dir), ("STARE", stare_dir)):
        out.append(Check(f"{name} held-out accuracy gain (last 3 evals - start)", _eval_gain(d), ">=", 0.2))
    if tool:
        for name, d in (("GRPO-ds", grpo_dir), ("STARE", stare_dir)):
            out.append(
                Check(
                    f"{name} held-out tool calls per response rise (last 3 evals - start)",
                    _eval_gain(d, "tool/calls_per_response"),
                    ">",
                    0.0,
                )
            )
        out.append(
            Check(
                "held-out accuracy with the tool disabled (max over evals, both arms)",
                _max_eval([grpo_dir, stare_dir], ("eval_start_notool/accuracy", "eval_notool/accuracy")),
                "<=",
                0.2,
            )
        )
    return out


def format_checks(checks: Sequence[Check]) -> str:
    """The checks as a markdown table, then one line with the overall verdict."""
    lines = ["| check | measured | required | pass |", "|---|---:|---:|:---:|"]
    for c in checks:
        v = "n/a" if c.value is None else f"{c.value:.3f}"
        lines.append(f"| {c.name} | {v} | {c.need} | {'yes' if c.passed else 'NO'} |")
    failed = [c.name for c in checks if not c.passed]
    verdict = (
        f"all {len(checks)} checks pass"
        if not failed
        else f"{len(failed)} of {len(checks)} checks FAIL: {'; '.join(failed)} (README: When a check says NO)"
    )
    return "\n".join(lines) + "\n\n" + verdict + "\n"


def _checkpoint_steps(arm_dir: pathlib.Path) -> list[int]:
    d = arm_dir / "checkpoints"
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit()) if d.is_dir() else []


def _unused_by(cfg, key: str) -> bool:
    """Whether the arm of `cfg` trains the same whatever the setting `key`: STARE's settings (rl.stare.*, other than
    rl.stare.enabled) in an arm with STARE off, the GRPO-ds arm. The demo's overrides apply to both arms, so a changed
    STARE setting is the STARE arm's business only (its own check names it)."""
    return not cfg.rl.stare.enabled and key.startswith("rl.stare.") and key != "rl.stare.enabled"


def train_arm(arm: str, cfg, arm_dir: pathlib.Path, *, what: str = "demo", log: Callable[[str], None] = print) -> dict:
    """Train one arm into arm_dir, continuing it from its checkpoint when interrupted and reusing it when finished
    (the same config is required: a changed setting stops with the changed keys, except settings the arm does not
    use: _unused_by). Returns {"reused": bool, "stopped": None or which stop signal ended it and the checkpoint it
    saved (one line), "stop_signal": SIGINT, SIGTERM or None, "wall_s": the arm's training wall time (a reused arm:
    the time its summary.json recorded)}."""
    done = _checkpoint_steps(arm_dir)
    unused_changed = False  # only settings this arm does not use changed (STARE's, in the GRPO-ds arm)
    if done:
        try:
            check_resume_config(arm_dir, cfg, allow=False, run_dir=str(arm_dir))
        except ConfigChangeError as e:
            e.refused = {k: v for k, v in e.refused.items() if not _unused_by(cfg, k)}
            if e.refused:
                raise TrainingError(
                    f"{arm_dir} was trained with other settings ({e.summary()}); run the {what} with the "
                    f"overrides it was started with, or pass a new --run-dir"
                ) from None
            unused_changed = True
    elif (arm_dir / "metrics.jsonl").exists():
        raise TrainingError(
            f"{arm_dir} holds an arm that stopped before its first checkpoint; delete {arm_dir} or pass a new --run-dir"
        )
    if done and done[-1] >= cfg.total_steps:
        log(f"{what}: arm {arm} already finished in {arm_dir} ({done[-1]} steps), reusing it")
        summary = json.loads((arm_dir / "summary.json").read_text()) if (arm_dir / "summary.json").exists() else {}
        return {"reused": True, "stopped": None, "stop_signal": None, "wall_s": summary.get("wall_s")}
    log(
        f"{what}: training arm {arm} -> {arm_dir}"
        if not done
        else f"{what}: continuing arm {arm} in {arm_dir} from its checkpoint at step {done[-1]}"
    )
    # a change of settings the arm does not use is let through (and recorded in its config_changes.jsonl)
    summary = run_training(
        cfg, arm_dir, resume=bool(done), allow_config_change=unused_changed, inputs_for=run_inputs, log=log
    )
    stopped = None
    if summary["stopped"]:  # the entry point's last line (stare_jax.cli.demo / compare)
        stopped = f"{summary['stop_reason']} during arm {arm}: saved checkpoint {summary['checkpoint']}"
    return {"reused": False, "stopped": stopped, "stop_signal": summary.get("stop_signal"), "wall_s": summary["wall_s"]}


def run_demo(
    run_dir: str | pathlib.Path,
    overrides: Sequence[str] = (),
    *,
    scenario: str = "default",
    log: Callable[[str], None] = print,
) -> dict:
    """Train both arms of `scenario` (SCENARIOS) into run_dir/<arm>, then write run_dir/curves.png and
    run_dir/summary.md.

    Run again on the same run_dir, it continues an interrupted arm from its checkpoint and reuses a finished one
    (the same overrides are required: a changed setting stops it with the changed keys). A stop signal (Ctrl-C,
    SIGTERM) ends the demo after the current step's checkpoint; result["stopped"] then says which and where, and
    result["stop_signal"] names the signal."""
    run_dir = pathlib.Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise TrainingError(f"--run-dir {run_dir} is a file; give a folder (default runs/demo)")
    if scenario not in SCENARIOS:
        raise TrainingError(f"unknown --scenario {scenario!r}; accepted: {', '.join(SCENARIOS)}")
    t0 = time.time()
    dirs: list[pathlib.Path] = []
    reused: list[str] = []
    for arm, cfg_file in SCENARIOS[scenario]:
        arm_dir = run_dir / arm
        result = train_arm(arm, load_config(CONFIGS / cfg_file, overrides), arm_dir, log=log)
        if result["stopped"]:
            return {
                "run_dirs": [str(d) for d in dirs + [arm_dir]],
                "stopped": result["stopped"],
                "stop_signal": result.get("stop_signal"),
                "wall_s": time.time() - t0,
            }
        if result["reused"]:
            reused.append(arm)
        dirs.append(arm_dir)
    plot = plot_runs(dirs, run_dir / "curves.png", title=TITLES[scenario])
    checks = demo_checks(*dirs, tool=scenario == "tool")
    wall = time.time() - t0
    heading = "# stare-jax demo" + (f" --scenario {scenario}" if scenario != "default" else "")
    text = (
        heading
        + "\n\n"
        + summary_table(dirs)
        + "\n"
        + format_checks(checks)
        + (
            f"\nwall time {wall:.0f} s (both arms, including tokenizer training and the warm start if not cached)"
            if not reused
            else f"\nwall time {wall:.0f} s (finished arms reused: {', '.join(reused)})"
        )
        + f"\ncurves: {plot}\n"
    )
    (run_dir / "summary.md").write_text(text)
    log(text)
    return {"run_dirs": [str(d) for d in dirs], "plot": str(plot), "checks": checks, "wall_s": wall, "stopped": None}
