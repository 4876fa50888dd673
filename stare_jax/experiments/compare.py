"""`stare-jax compare`: the entropy-control methods side by side on the embedded CPU default (the demo's toy task and
its cached warm start), one config per method (configs/tiny_cpu_<method>.yaml), for a list of methods and seeds.

Writes into the run folder: one arm per (method, seed) (`<method>-seed<seed>/`, a normal training run folder),
`compare.png` (entropy with STARE's target band, reward, held-out accuracy, response length; one colour per
method, stare_jax.experiments.plot in its compact form), and the table as `compare.md` and `compare.json`: per method
the
first-step and last-10 mean entropy, the share of last-quarter steps within the target band (+-30%), held-out
accuracy before RL -> at the last evaluation, and the arms' training wall time (means over the seeds).

Arms are trained one after another in this process (stare_jax.experiments.demo.train_arm: an interrupted compare
continues
where it stopped, finished arms are reused), with JAX's persistent compilation cache on (.cache/jax unless one is
set), so the sampler and evaluation programs every arm shares are compiled once. Budget: the default list with one
seed is meant to take <= 15 minutes on 2 CPU cores (docs/compare.md: the measured time).
"""

from __future__ import annotations

import difflib
import json
import math
import pathlib
import time
from typing import Callable, Sequence

import jax

from stare_jax.config.loader import load_config
from stare_jax.experiments.demo import CONFIGS, train_arm
from stare_jax.experiments.plot import plot_runs, run_summary
from stare_jax.training.setup import TrainingError

# method -> its config (configs/); each differs from tiny_cpu_grpo_ds.yaml only in its method's keys
METHODS = {
    "grpo_ds": "tiny_cpu_grpo_ds.yaml",
    "stare_o1": "tiny_cpu_stare.yaml",
    "stare_c2": "tiny_cpu_stare_c2.yaml",
    "grpo_kl": "tiny_cpu_grpo_kl.yaml",
    "entropy_bonus": "tiny_cpu_entropy_bonus.yaml",
    "clip_cov": "tiny_cpu_clip_cov.yaml",
    "kl_cov": "tiny_cpu_kl_cov.yaml",
    "top20_entropy": "tiny_cpu_top20_entropy.yaml",
    "gspo": "tiny_cpu_gspo.yaml",
    "cispo": "tiny_cpu_cispo.yaml",
    "w_reinforce": "tiny_cpu_w_reinforce.yaml",
    "entro_adv": "tiny_cpu_entro_adv.yaml",
    "dr_grpo": "tiny_cpu_dr_grpo.yaml",
}
DEFAULT_METHODS = (
    "grpo_ds",
    "stare_o1",
    "stare_c2",
    "grpo_kl",
    "entropy_bonus",
    "clip_cov",
    "kl_cov",
    "top20_entropy",
    "gspo",
    "cispo",
)
TABLE_COLUMNS = (
    "method",
    "seeds",
    "steps",
    "first H",
    "last-10 H",
    "last quarter in band",
    "held-out acc start",
    "held-out acc end",
    "wall s",
)
PLOT_NAME, TABLE_NAME, JSON_NAME = "compare.png", "compare.md", "compare.json"


def parse_methods(text: str | Sequence[str]) -> list[str]:
    """A comma-separated list (or a sequence) of known method names; TrainingError naming the unknown ones."""
    names = [m.strip() for m in (text.split(",") if isinstance(text, str) else text) if m.strip()]
    unknown = [m for m in names if m not in METHODS]
    if unknown or not names:
        close = [c for m in unknown for c in difflib.get_close_matches(m, METHODS, n=1)]
        hint = f" (did you mean {', '.join(close)}?)" if close else ""
        raise TrainingError(f"compare: unknown method(s) {unknown or [text]}{hint}; accepted: {', '.join(METHODS)}")
    if len(set(names)) != len(names):
        raise TrainingError(f"compare: a method is listed twice in {names}")
    return names


def arm_dir(run_dir: pathlib.Path, method: str, seed: int) -> pathlib.Path:
    return run_dir / f"{method}-seed{seed}"


def _mean(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None and math.isfinite(x)]
    return sum(vals) / len(vals) if vals else None


def method_rows(run_dir: pathlib.Path, methods: Sequence[str], seeds: Sequence[int], wall: dict) -> list[dict]:
    """One row per method (means over its seeds) with TABLE_COLUMNS's quantities, plus its per-seed runs."""
    rows = []
    for m in methods:
        runs = [dict(run_summary(arm_dir(run_dir, m, s)), seed=s, wall_s=wall.get((m, s))) for s in seeds]
        rows.append(
            {
                "method": m,
                "config": METHODS[m],
                "seeds": list(seeds),
                "steps": runs[0]["steps"],
                "target_entropy": runs[0]["target_entropy"],
                **{
                    k: _mean([r[k] for r in runs])
                    for k in (
                        "first_entropy",
                        "last10_entropy",
                        "last_quarter_entropy",
                        "last_quarter_in_band",
                        "start_eval_accuracy",
                        "final_eval_accuracy",
                        "wall_s",
                    )
                },
                "runs": runs,
            }
        )
    return rows


def format_table(rows: Sequence[dict]) -> str:
    def f(v, spec=".3f"):
        return "n/a" if v is None else format(v, spec)

    lines = ["| " + " | ".join(TABLE_COLUMNS) + " |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['method']} | {len(r['seeds'])} | {r['steps']} | {f(r['first_entropy'])} | "
            f"{f(r['last10_entropy'])} | {f(r['last_quarter_in_band'], '.0%')} | "
            f"{f(r['start_eval_accuracy'])} | {f(r['final_eval_accuracy'])} | {f(r['wall_s'], '.0f')} |"
        )
    return "\n".join(lines) + "\n"


def run_compare(
    run_dir: str | pathlib.Path,
    methods: Sequence[str] = DEFAULT_METHODS,
    seeds: Sequence[int] = (0,),
    overrides: Sequence[str] = (),
    *,
    log: Callable[[str], None] = print,
) -> dict:
    """Train every (method, seed) arm into run_dir, then write compare.png, compare.md and compare.json.
    `overrides` (KEY=VALUE) apply to every arm, after the arm's own `seed=`."""
    run_dir = pathlib.Path(run_dir)
    if run_dir.exists() and not run_dir.is_dir():
        raise TrainingError(f"compare: --run-dir {run_dir} is a file; give a folder (default runs/compare)")
    methods = parse_methods(methods)
    if not seeds or len(set(seeds)) != len(seeds) or any(s < 0 for s in seeds):
        raise TrainingError(f"compare: seeds {list(seeds)} must be distinct integers >= 0")
    if not getattr(jax.config, "jax_compilation_cache_dir"):  # the arms share the sampler and eval programs
        jax.config.update("jax_compilation_cache_dir", str(pathlib.Path(".cache") / "jax"))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
    t0 = time.time()
    wall: dict = {}
    reused = []
    for m in methods:
        for s in seeds:
            cfg = load_config(CONFIGS / METHODS[m], [f"seed={s}", *overrides])
            result = train_arm(f"{m} (seed {s})", cfg, arm_dir(run_dir, m, s), what="compare", log=log)
            if result["stopped"]:
                return {"stopped": result["stopped"], "stop_signal": result["stop_signal"], "wall_s": time.time() - t0}
            wall[(m, s)] = result["wall_s"]
            if result["reused"]:
                reused.append(f"{m}-seed{s}")
    total = time.time() - t0
    rows = method_rows(run_dir, methods, seeds, wall)
    dirs = [arm_dir(run_dir, m, s) for m in methods for s in seeds]
    labels = [m if i == 0 else f"_{m}" for m in methods for i, _ in enumerate(seeds)]  # one legend entry a method
    plot = plot_runs(
        dirs,
        run_dir / PLOT_NAME,
        labels=labels,
        colour_groups=[m for m in methods for _ in seeds],
        compact=True,
        title=f"embedded CPU default: {len(methods)} methods x {len(seeds)} seed(s)",
    )
    table = format_table(rows)
    note = (
        f"wall time {total:.0f} s for {len(dirs)} arms"
        + (f" (reused: {', '.join(reused)})" if reused else "")
        + "; 'wall s' per arm includes its compiles and evaluations"
    )
    (run_dir / TABLE_NAME).write_text(f"# stare-jax compare\n\n{table}\n{note}\n\nplot: {plot}\n")
    (run_dir / JSON_NAME).write_text(
        json.dumps(
            {"methods": rows, "wall_s": total, "reused": reused, "columns": list(TABLE_COLUMNS), "plot": str(plot)},
            indent=1,
        )
    )
    log(table + note + f"\nwrote {plot}, {run_dir / TABLE_NAME}, {run_dir / JSON_NAME}")
    return {
        "rows": rows,
        "plot": str(plot),
        "table": str(run_dir / TABLE_NAME),
        "json": str(run_dir / JSON_NAME),
        "wall_s": total,
        "stopped": None,
    }
