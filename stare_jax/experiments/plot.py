"""Curves and a summary table from one or more runs' RUN_DIR/metrics.jsonl (several runs overlaid).

`plot_runs(run_dirs, out_path)` writes one PNG with six panels, each titled with what it shows: entropy with the
target band (target line and target +-30% shaded), reward_mean, accuracy of the training rollouts with the
held-out evaluations (step 0: eval_start/, before any RL update), response_len_mean, gate activity (share of the
last few steps with reweighting on) and the STARE weights W (solid) and M (dashed). Overlaid runs are drawn
widest first, each with its own marker shape at staggered steps, so runs that coincide stay visible.
`summary_table(run_dirs)` returns a markdown table of the entropy-control numbers. `expand_run_dirs` turns a
folder of runs (e.g. `stare-jax demo`'s, whose arms are sub-folders) into its runs. Used by
`stare-jax plot RUN_DIR [RUN_DIR ...]`.
"""

from __future__ import annotations

import math
import os
import pathlib
from typing import Any, Sequence, TypeGuard

import matplotlib
import yaml
from matplotlib.figure import Figure  # no pyplot: no global backend state, works headless

from stare_jax.training.metrics import read_metrics

BAND = 0.30  # the target band: target_entropy * (1 -+ BAND)
MARKERS = ("o", "s", "^", "D", "v", "P")  # one marker shape per overlaid run
# `stare-jax plot`'s output name: not the demo's curves.png (titled, referenced by its summary.md) nor compare.png,
# so plotting a demo or compare folder adds a file next to theirs instead of replacing it
DEFAULT_PLOT_NAME = "plot.png"


def _finite(v: Any) -> TypeGuard[int | float]:
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


def is_run_dir(path: str | os.PathLike) -> bool:
    return (pathlib.Path(path) / "metrics.jsonl").is_file()


def expand_run_dirs(run_dirs: Sequence[str | os.PathLike]) -> list[pathlib.Path]:
    """Each RUN_DIR as given, except a folder without metrics.jsonl whose sub-folders hold runs (the demo's
    runs/demo/{grpo_ds,stare_o1}): it stands for those runs, in name order. Anything else is left for load_run
    to report."""
    out = []
    for d in run_dirs:
        d = pathlib.Path(d)
        subs = []
        if d.is_dir() and not is_run_dir(d):
            subs = sorted(p for p in d.iterdir() if p.is_dir() and is_run_dir(p))
        out.extend(subs or [d])
    return out


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
    """RUN_DIR/plot.png for one folder (a run, or a folder of runs such as the demo's), ./plot.png for several."""
    return pathlib.Path(run_dirs[0]) / DEFAULT_PLOT_NAME if len(run_dirs) == 1 else pathlib.Path(DEFAULT_PLOT_NAME)


def plot_runs(
    run_dirs: Sequence[str | os.PathLike],
    out_path: str | os.PathLike | None = None,
    *,
    target_entropy: float | None = None,
    title: str | None = None,
    labels: Sequence[str] | None = None,
    colour_groups: Sequence[str] | None = None,
    compact: bool = False,
) -> pathlib.Path:
    """Write the curves PNG for the given runs (overlaid) and return its path.

    out_path: default RUN_DIR/plot.png for one run, ./plot.png for several (default_plot_path).
    target_entropy: the band's centre; default each run's own target (metrics, then config.yaml).
    labels, colour_groups, compact: see build_figure (`stare-jax compare` draws many methods with them).
    """
    if not run_dirs:
        raise ValueError("plot_runs needs at least one run directory")
    fig = build_figure(
        run_dirs,
        target_entropy=target_entropy,
        title=title,
        labels=labels,
        colour_groups=colour_groups,
        compact=compact,
    )
    out_path = pathlib.Path(out_path) if out_path is not None else default_plot_path(run_dirs)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(out_path.name + ".tmp.png")
    fig.savefig(tmp, dpi=100)
    os.replace(tmp, out_path)
    return out_path


def build_figure(
    run_dirs: Sequence[str | os.PathLike],
    *,
    target_entropy: float | None = None,
    title: str | None = None,
    labels: Sequence[str] | None = None,
    colour_groups: Sequence[str] | None = None,
    compact: bool = False,
):
    """The matplotlib Figure plot_runs saves (panels in reading order: entropy, reward, accuracy, length,
    gate, W/M).

    labels: the legend name of each run (default: folder names). colour_groups: runs with the same group share a
    colour (e.g. the seeds of one method), one colour per group. compact: many overlaid runs (`stare-jax compare`):
    the first four panels only, equal line widths without markers, and the accuracy panel shows the held-out
    evaluations (step 0: before RL) as lines."""
    if not run_dirs:
        raise ValueError("build_figure needs at least one run directory")
    runs = [load_run(d) for d in run_dirs]
    labels = list(labels) if labels is not None else run_labels(run_dirs)
    targets = [
        target_entropy if target_entropy is not None else run_target_entropy(d, r) for d, r in zip(run_dirs, runs)
    ]
    groups = list(colour_groups) if colour_groups is not None else list(range(len(runs)))
    group_index = {g: i for i, g in enumerate(dict.fromkeys(groups))}

    ax_gate: Any = None  # gate and W/M panels: not in the compact form
    ax_w: Any = None
    ax_calls: Any = None  # tool panels: runs with tool rollouts, not in the compact form
    ax_notool: Any = None
    with_tool = any("tool/calls_per_response" in r for recs in runs for r in recs)
    if compact:
        fig = Figure(figsize=(13, 9), layout="constrained")
        ax_h, ax_r, ax_acc, ax_len = fig.subplots(2, 2).ravel()
    elif with_tool:
        fig = Figure(figsize=(12, 15), layout="constrained")
        ax_h, ax_r, ax_acc, ax_len, ax_gate, ax_w, ax_calls, ax_notool = fig.subplots(4, 2).ravel()
    else:
        fig = Figure(figsize=(12, 11.5), layout="constrained")
        ax_h, ax_r, ax_acc, ax_len, ax_gate, ax_w = fig.subplots(3, 2).ravel()
    colors = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    if len(group_index) > len(colors):
        colors = [matplotlib.colormaps["tab20"](i) for i in range(20)]
    n_runs = len(runs)
    n_steps = max((len(r) for r in runs), default=1)
    window = max(1, round(n_steps / 8))  # the gate panel's rolling window, in steps
    # Runs often coincide (same warm start, same seed until the gate first fires; the same M in two STARE arms):
    # earlier runs are drawn wider underneath later ones, and each run has its own marker shape at staggered
    # steps, so every run stays visible where the lines overlap.
    every = max(1, n_steps // 10)

    def style(i: int) -> dict:
        c = colors[group_index[groups[i]] % len(colors)]
        if compact:
            return {"color": c, "lw": 1.6, "alpha": 0.9}
        return {
            "color": c,
            "lw": 1.3 + 1.6 * (n_runs - 1 - i),
            "alpha": 0.55 if i < n_runs - 1 else 1.0,
            "marker": MARKERS[i % len(MARKERS)],
            "ms": 5,
            "markevery": (min(i * max(1, every // n_runs), every - 1) if every > 1 else 0, every),
        }

    drawn_targets: set[float] = set()
    starts_drawn: list[float] = []
    all_starts = [r["eval_start/accuracy"] for recs in runs for r in recs if _finite(r.get("eval_start/accuracy"))]
    for i, (records, label, target) in enumerate(zip(runs, labels, targets)):
        st = style(i)
        c = st["color"]
        stare_on = any(r.get("stare_enabled") for r in records) or any(
            _finite(r.get("stare_w")) and r.get("stare_w") != 1.0 for r in records
        )
        steps, h = series(records, "entropy")
        _line(ax_h, steps, h, label=label, **st)
        if target is not None and round(target, 9) not in drawn_targets:
            drawn_targets.add(round(target, 9))
            band_label = f"STARE target {target:g} ±{int(BAND * 100)}%"
            ax_h.axhspan(
                target * (1 - BAND),
                target * (1 + BAND),
                color="grey" if len(set(targets)) == 1 else c,
                alpha=0.15,
                label=band_label,
            )
            ax_h.axhline(target, color="k" if len(set(targets)) == 1 else c, ls="--", lw=1)
        _line(ax_r, *series(records, "reward_mean"), label=label, **st)
        if not compact:
            _line(ax_acc, *series(records, "accuracy"), label=f"{label}: training rollouts", **st)
        # held-out accuracy: the evaluation before any RL update (eval_start/, drawn at step 0) and the periodic ones
        es, ev = series(records, "eval/accuracy")
        start = [r["eval_start/accuracy"] for r in records if _finite(r.get("eval_start/accuracy"))]
        if start:
            es, ev = [0] + es, start[:1] + ev
        if compact:
            _line(ax_acc, es, ev, label=label, **st)
            _line(ax_len, *series(records, "response_len_mean"), label=label, **st)
            continue
        _line(ax_acc, es, ev, color=c, marker="o", ls="--", ms=6 - i, lw=0.9, label=f"{label}: held-out eval")
        if start and all(abs(start[0] - v) > 0.005 for v in starts_drawn):
            starts_drawn.append(start[0])
            ax_acc.annotate(
                f"before RL: {start[0]:.2f}",
                (0, start[0]),
                textcoords="offset points",
                xytext=(6, -4 - 10 * len(starts_drawn)),
                fontsize=7,
                color=c if len(runs) > 1 and len({round(r, 2) for r in all_starts}) > 1 else "k",
            )
        _line(ax_len, *series(records, "response_len_mean"), label=label, **st)
        gs, gv = series(records, "gate_on")
        if gs:
            ax_gate.plot(
                gs,
                _rolling_mean(gv, window),
                drawstyle="steps-post",
                label=label if stare_on else f"{label} (no STARE: never on)",
                **{k: v for k, v in st.items() if k != "marker"},
            )
        ws, wv = series(records, "stare_w")
        ms_, mv = series(records, "stare_m")
        wlabel = "" if stare_on else " (no STARE: 1)"
        _line(ax_w, ws, wv, label=f"{label} W{wlabel}", **st)
        _line(ax_w, ms_, mv, label=f"{label} M{wlabel}", **{**st, "ls": "--"})
        if ax_calls is not None:
            _line(ax_calls, *series(records, "tool/calls_per_response"), label=f"{label}: training rollouts", **st)
            _line(
                ax_calls,
                *_held_out(records, "tool/calls_per_response"),
                color=c,
                marker="o",
                ls="--",
                ms=6 - i,
                lw=0.9,
                label=f"{label}: held-out eval",
            )
            _line(
                ax_notool,
                *_held_out(records, "accuracy", "_notool"),
                color=c,
                marker="o",
                ls="--",
                ms=6 - i,
                lw=0.9,
                label=label,
            )
            _line(
                ax_notool, *_held_out(records, "accuracy"), color=c, lw=0.9, alpha=0.5, label=f"{label}: with the tool"
            )

    gate_title = (
        "STARE gate: share of the last " + (f"{window} steps" if window > 1 else "step") + " with reweighting on"
    )
    panels = [
        (ax_h, "policy entropy (nats/token, mean over response tokens)", "entropy"),
        (ax_r, "reward (mean over the rollouts trained on)", "reward_mean"),
        (
            ax_acc,
            "held-out accuracy (step 0 = before RL)"
            if compact
            else "accuracy: training rollouts (lines), held-out eval (dots; step 0 = before RL)",
            "accuracy",
        ),
        (ax_len, "response length (tokens, mean over all rollouts)", "tokens"),
    ]
    if not compact:
        panels += [
            (ax_gate, gate_title, "fraction of steps"),
            (ax_w, "STARE token weights: W amplifies (solid), M attenuates (dashed)", "weight (1 = unweighted)"),
        ]
    if ax_calls is not None:
        panels += [
            (
                ax_calls,
                "tool calls per response: training rollouts (lines), held-out eval (dots; step 0 = before RL)",
                "calls",
            ),
            (ax_notool, "held-out accuracy with the tool disabled (dots; step 0 = before RL)", "accuracy"),
        ]
    for ax, name, ylabel in panels:
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("RL step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="best", ncol=2 if compact and n_runs > 6 else 1)
        else:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey")
    if ax_gate is not None:
        ax_gate.set_ylim(-0.05, 1.05)
    if title:
        fig.suptitle(title)
    return fig


def _held_out(records: Sequence[dict], key: str, kind: str = "") -> tuple[list[int], list[float]]:
    """The held-out series eval<kind>/<key> with the evaluation before RL (eval_start<kind>/<key>) at step 0
    (kind "" or "_notool": the evaluation with the tool disabled)."""
    steps, vals = series(records, f"eval{kind}/{key}")
    start = [r[f"eval_start{kind}/{key}"] for r in records if _finite(r.get(f"eval_start{kind}/{key}"))]
    return ([0] + steps, start[:1] + vals) if start else (steps, vals)


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
    _, ev0 = series(records, "eval_start/accuracy")
    return {
        "run": str(run_dir),
        "steps": len(records),
        "last_step": int(records[-1]["step"]),
        "target_entropy": target,
        "first_entropy": h[0] if h else None,
        "last10_entropy": _mean(h[-10:]),
        "last_quarter_entropy": _mean(quarter),
        "last_quarter_in_band": in_band,
        "start_eval_accuracy": ev0[0] if ev0 else None,  # before any RL update
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
