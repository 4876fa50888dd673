"""Curves and a summary table from one or more runs' RUN_DIR/metrics.jsonl (several runs overlaid).

`plot_runs(run_dirs, out_path)` writes one PNG with six panels: entropy with the target band (target line
and target +-30% shaded), reward_mean, accuracy (+ eval/accuracy points), response_len_mean, gate activity
(rolling fraction of gate_on) and the STARE weights W (solid) and M (dashed). `summary_table(run_dirs)`
returns a markdown table of the entropy-control numbers. Used by `stare-jax plot RUN_DIR [RUN_DIR ...]`.
"""

from __future__ import annotations

import math
import os
import pathlib
from typing import Any, Sequence

from stare_jax.metrics import read_metrics

BAND = 0.30  # the target band: target_entropy * (1 -+ BAND)
DEFAULT_PLOT_NAME = "curves.png"


def _finite(v: Any) -> bool:
    """A plottable value: a bool, or a finite int/float (NaN/inf markers and strings are skipped)."""
    if isinstance(v, bool):
        return True
    return isinstance(v, (int, float)) and math.isfinite(v)


def series(records: Sequence[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records that carry a finite number (or bool) under `key`."""
    steps, values = [], []
    for r in records:
        v = r.get(key)
        if _finite(v):
            steps.append(int(r["step"]))
            values.append(float(v))
    return steps, values


def load_run(run_dir: str | os.PathLike) -> list[dict]:
    """The run's step records (timing keys kept); errors name the run dir, the file and a bad line."""
    run_dir = pathlib.Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"run directory {run_dir} does not exist")
    records = read_metrics(run_dir, drop_timing=False)
    if not records:
        raise ValueError(f"{run_dir / 'metrics.jsonl'} holds no step records (run {run_dir})")
    return records


def run_labels(run_dirs: Sequence[str | os.PathLike]) -> list[str]:
    """Folder names; parent/name where two runs share a folder name."""
    paths = [pathlib.Path(d).resolve() for d in run_dirs]
    names = [p.name for p in paths]
    return [f"{p.parent.name}/{p.name}" if names.count(p.name) > 1 else p.name for p in paths]


def run_target_entropy(run_dir: str | os.PathLike, records: Sequence[dict]) -> float | None:
    """The run's target entropy: from its metrics (last finite target_entropy), else config.yaml's
    rl.stare.target_entropy, else None."""
    _, vals = series(records, "target_entropy")
    if vals:
        return vals[-1]
    cfg_path = pathlib.Path(run_dir) / "config.yaml"
    if cfg_path.is_file():
        import yaml

        try:
            cfg = yaml.safe_load(cfg_path.read_text()) or {}
            value = cfg.get("rl", {}).get("stare", {}).get("target_entropy")
        except (yaml.YAMLError, AttributeError):
            return None
        return float(value) if isinstance(value, (int, float)) else None
    return None


def _rolling_mean(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _line(ax, xs: list, ys: list, **kw) -> None:
    """Plot only when there is data, so a missing metric shows as 'no data' rather than an empty legend entry."""
    if xs:
        ax.plot(xs, ys, **kw)


def default_plot_path(run_dirs: Sequence[str | os.PathLike]) -> pathlib.Path:
    """RUN_DIR/curves.png for one run, ./curves.png for several."""
    return pathlib.Path(run_dirs[0]) / DEFAULT_PLOT_NAME if len(run_dirs) == 1 else pathlib.Path(DEFAULT_PLOT_NAME)


def plot_runs(
    run_dirs: Sequence[str | os.PathLike],
    out_path: str | os.PathLike | None = None,
    *,
    target_entropy: float | None = None,
    title: str | None = None,
) -> pathlib.Path:
    """Write the curves PNG for the given runs (overlaid) and return its path.

    out_path: default RUN_DIR/curves.png for one run, ./curves.png for several.
    target_entropy: the band's centre; default each run's own target (metrics, then config.yaml).
    """
    if not run_dirs:
        raise ValueError("plot_runs needs at least one run directory")
    fig = build_figure(run_dirs, target_entropy=target_entropy, title=title)
    out_path = pathlib.Path(out_path) if out_path is not None else default_plot_path(run_dirs)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    os.replace(tmp, out_path)
    return out_path


def build_figure(
    run_dirs: Sequence[str | os.PathLike], *, target_entropy: float | None = None, title: str | None = None
):
    """The matplotlib Figure plot_runs saves (panels in reading order: entropy, reward, accuracy, length,
    gate, W/M)."""
    if not run_dirs:
        raise ValueError("build_figure needs at least one run directory")
    import matplotlib
    from matplotlib.figure import Figure  # no pyplot: no global backend state, works headless

    runs = [load_run(d) for d in run_dirs]
    labels = run_labels(run_dirs)
    targets = [
        target_entropy if target_entropy is not None else run_target_entropy(d, r) for d, r in zip(run_dirs, runs)
    ]

    fig = Figure(figsize=(12, 11), layout="constrained")
    ax_h, ax_r, ax_acc, ax_len, ax_gate, ax_w = fig.subplots(3, 2).ravel()
    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]

    drawn_targets: set[float] = set()
    for i, (records, label, target) in enumerate(zip(runs, labels, targets)):
        c = colors[i % len(colors)]
        steps, h = series(records, "entropy")
        _line(ax_h, steps, h, color=c, label=label, lw=1.3)
        if target is not None and round(target, 9) not in drawn_targets:
            drawn_targets.add(round(target, 9))
            band_label = f"target {target:g} ±{int(BAND * 100)}%"
            ax_h.axhspan(target * (1 - BAND), target * (1 + BAND), color="grey" if len(set(targets)) == 1 else c,
                         alpha=0.15, label=band_label)
            ax_h.axhline(target, color="k" if len(set(targets)) == 1 else c, ls="--", lw=1)
        _line(ax_r, *series(records, "reward_mean"), color=c, label=label, lw=1.3)
        _line(ax_acc, *series(records, "accuracy"), color=c, label=f"{label} (train)", lw=1.3)
        _line(ax_acc, *series(records, "eval/accuracy"), color=c, marker="o", ls="--", ms=5, lw=0.8,
              label=f"{label} (eval)")
        _line(ax_len, *series(records, "response_len_mean"), color=c, label=label, lw=1.3)
        gs, gv = series(records, "gate_on")
        if gs:
            window = max(1, len(gv) // 20)
            ax_gate.plot(gs, _rolling_mean(gv, window), color=c, drawstyle="steps-post", lw=1.3,
                         label=f"{label} (mean over {window})" if window > 1 else label)
        _line(ax_w, *series(records, "stare_w"), color=c, lw=1.3, label=f"{label} W")
        _line(ax_w, *series(records, "stare_m"), color=c, lw=1.3, ls="--", label=f"{label} M")

    panels = [
        (ax_h, "policy entropy (token mean)", "entropy"),
        (ax_r, "reward (mean over rollouts)", "reward_mean"),
        (ax_acc, "accuracy", "accuracy"),
        (ax_len, "response length (tokens, mean)", "tokens"),
        (ax_gate, "STARE gate activity (fraction on)", "gate_on"),
        (ax_w, "STARE weights: W (solid), M (dashed)", "weight"),
    ]
    for ax, name, ylabel in panels:
        ax.set_title(name)
        ax.set_xlabel("RL step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="best")
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
    ax_gate.set_ylim(-0.05, 1.05)
    if title:
        fig.suptitle(title)
    return fig


def _mean(xs: Sequence[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def run_summary(run_dir: str | os.PathLike, *, target_entropy: float | None = None) -> dict:
    """Entropy-control numbers of one run (None where not available)."""
    records = load_run(run_dir)
    _, h = series(records, "entropy")
    target = target_entropy if target_entropy is not None else run_target_entropy(run_dir, records)
    quarter = h[len(h) - max(1, math.ceil(len(h) / 4)) :] if h else []
    in_band = None
    if target is not None and quarter:
        in_band = sum(abs(x - target) <= BAND * target for x in quarter) / len(quarter)
    _, ev = series(records, "eval/accuracy")
    return {
        "run": str(run_dir),
        "steps": len(records),
        "last_step": int(records[-1]["step"]),
        "target_entropy": target,
        "first_entropy": h[0] if h else None,
        "last10_entropy": _mean(h[-10:]),
        "last_quarter_entropy": _mean(quarter),
        "last_quarter_in_band": in_band,
        "final_eval_accuracy": ev[-1] if ev else None,
    }


def summary_table(run_dirs: Sequence[str | os.PathLike], *, target_entropy: float | None = None) -> str:
    """Markdown table: per run first-step entropy, last-10 mean, last-quarter mean, fraction of last-quarter
    steps within target +-30%, final eval accuracy."""
    labels = run_labels(run_dirs)
    header = (
        "| run | steps | target H | first H | last-10 mean H | last-quarter mean H | last quarter in ±30% "
        "| final eval acc |\n|---|---:|---:|---:|---:|---:|---:|---:|\n"
    )

    def f(v, spec=".4f"):
        return "n/a" if v is None else format(v, spec)

    rows = []
    for label, d in zip(labels, run_dirs):
        s = run_summary(d, target_entropy=target_entropy)
        rows.append(
            f"| {label} | {s['steps']} | {f(s['target_entropy'], 'g')} | {f(s['first_entropy'])} | "
            f"{f(s['last10_entropy'])} | {f(s['last_quarter_entropy'])} | {f(s['last_quarter_in_band'], '.0%')} | "
            f"{f(s['final_eval_accuracy'], '.3f')} |"
        )
    return header + "\n".join(rows) + "\n"
