"""plot_runs / summary_table on synthetic runs written by MetricsWriter: the drawn data equal the logged
series, the target band sits at target +-30%, the PNG decodes, the table matches a NumPy re-derivation,
and bad runs give errors naming the run and line."""

import json
import math

import numpy as np
import pytest
import yaml

from stare_jax.experiments import plot as PL
from stare_jax.training import metrics as M

N_STEPS = 24


def _write_run(run_dir, *, entropy, target=0.3, stare=True, eval_every=8, with_target_key=True):
    with M.MetricsWriter(run_dir, tensorboard=False, is_main_process=True) as w:
        for i, h in enumerate(entropy):
            step = i + 1
            rec = {
                "entropy": h,
                "reward_mean": 0.1 + 0.02 * i,
                "accuracy": 0.2 + 0.01 * i,
                "response_len_mean": 100 + 3 * i,
                "step_time_s": 1.0,
            }
            if with_target_key:
                rec["target_entropy"] = target
            if stare:
                rec.update(gate_on=bool(h < target), stare_w=1.1 + 0.001 * i, stare_m=0.9)
            if eval_every and step % eval_every == 0:
                rec["eval/accuracy"] = 0.3 + 0.01 * step
            w.log(step, rec)
    return run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("runs")
    h_grpo = list(np.linspace(0.6, 0.05, N_STEPS))  # entropy collapse
    h_stare = [0.6 * math.exp(-0.3 * i) + 0.28 for i in range(N_STEPS)]
    h_stare[5] = float("nan")  # a NaN step must be skipped, not break the plot or the means
    return {
        "grpo": _write_run(base / "grpo", entropy=h_grpo, stare=False, eval_every=0),
        "stare": _write_run(base / "stare", entropy=h_stare),
        "h": {"grpo": h_grpo, "stare": h_stare},
    }


def test_figure_draws_the_logged_series_and_the_band(runs):
    fig = PL.build_figure([runs["grpo"], runs["stare"]])
    ax_h, ax_r, ax_acc, ax_len, ax_gate, ax_w = fig.axes
    lines = {ln.get_label(): ln for ln in ax_h.get_lines()}
    np.testing.assert_allclose(lines["grpo"].get_ydata(), runs["h"]["grpo"])
    stare_x = lines["stare"].get_xdata()
    assert 6 not in list(stare_x) and len(stare_x) == N_STEPS - 1
    np.testing.assert_allclose(lines["stare"].get_ydata(), [h for h in runs["h"]["stare"] if not math.isnan(h)])
    (band,) = ax_h.patches  # one band: both runs share the target
    assert band.get_y() == pytest.approx(0.3 * 0.7) and band.get_y() + band.get_height() == pytest.approx(0.3 * 1.3)
    assert [ln.get_ydata()[0] for ln in ax_h.get_lines() if ln.get_linestyle() == "--"] == [0.3]
    eval_line = [ln for ln in ax_acc.get_lines() if ln.get_label() == "stare: held-out eval"][0]
    np.testing.assert_array_equal(eval_line.get_xdata(), [8, 16, 24])
    assert [ln.get_label() for ln in ax_w.get_lines()] == ["stare W", "stare M"]  # grpo has no W: not drawn
    gate = ax_gate.get_lines()[0]
    assert gate.get_drawstyle() == "steps-post" and 0.0 <= min(gate.get_ydata()) <= max(gate.get_ydata()) <= 1.0
    np.testing.assert_allclose(ax_len.get_lines()[1].get_ydata(), [100 + 3 * i for i in range(N_STEPS)])


def test_panels_explain_themselves_and_coinciding_runs_stay_visible(runs, tmp_path):
    """Titles say what each panel shows (the gate's window in steps); the held-out accuracy before RL
    (eval_start/) is drawn at step 0; two runs with identical series (here M = 0.9 in both) are drawn with
    different widths and marker shapes at different steps, so the one underneath shows."""
    twin = _write_run(tmp_path / "twin", entropy=runs["h"]["stare"])
    recs = [json.loads(x) for x in (twin / "metrics.jsonl").read_text().splitlines()]
    recs[0]["eval_start/accuracy"] = 0.25
    (twin / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    fig = PL.build_figure([runs["stare"], twin])
    ax_h, ax_r, ax_acc, ax_len, ax_gate, ax_w = fig.axes
    window = round(N_STEPS / 8)
    assert ax_gate.get_title() == f"STARE gate: share of the last {window} steps with reweighting on"
    assert "held-out" in ax_acc.get_title() and "step 0" in ax_acc.get_title()
    assert "W amplifies" in ax_w.get_title() and "M attenuates" in ax_w.get_title()
    ev = [ln for ln in ax_acc.get_lines() if ln.get_label() == "twin: held-out eval"][0]
    assert list(ev.get_xdata()) == [0, 8, 16, 24] and ev.get_ydata()[0] == 0.25
    assert "before RL: 0.25" in [t.get_text() for t in ax_acc.texts]
    m1, m2 = [ln for ln in ax_w.get_lines() if ln.get_label().endswith(" M")]
    np.testing.assert_array_equal(m1.get_ydata(), m2.get_ydata())  # the same values ...
    assert m1.get_linewidth() > m2.get_linewidth() and m1.get_marker() != m2.get_marker()  # ... both visible
    assert m1.get_markevery() != m2.get_markevery()


def test_a_folder_of_runs_stands_for_its_runs(runs, tmp_path):
    """`stare-jax plot runs/demo`: the demo folder has no metrics.jsonl of its own; its arms are sub-runs."""
    parent = runs["grpo"].parent
    assert PL.expand_run_dirs([parent]) == sorted(p for p in parent.iterdir() if (p / "metrics.jsonl").is_file())
    assert PL.expand_run_dirs([runs["stare"], tmp_path / "nope"]) == [runs["stare"], tmp_path / "nope"]
    (tmp_path / "empty").mkdir()
    assert PL.expand_run_dirs([tmp_path / "empty"]) == [tmp_path / "empty"]


def test_plot_runs_writes_a_png(runs, tmp_path):
    import matplotlib.image

    out = PL.plot_runs([runs["grpo"], runs["stare"]], tmp_path / "sub" / "cmp.png", title="grpo vs stare")
    assert out == tmp_path / "sub" / "cmp.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = matplotlib.image.imread(out)
    assert img.shape[0] > 800 and img.shape[1] > 1000, img.shape
    assert img[..., :3].std() > 0.05  # not a blank canvas
    assert PL.default_plot_path([runs["stare"]]) == runs["stare"] / "plot.png"  # not the demo's curves.png
    assert str(PL.default_plot_path([runs["stare"], runs["grpo"]])) == "plot.png"
    assert not list(tmp_path.glob("**/*.tmp.png"))


def test_summary_table_matches_numpy(runs):
    table = PL.summary_table([runs["grpo"], runs["stare"]])
    lines = table.strip().splitlines()
    assert lines[0].startswith("| run |") and len(lines) == 4
    for name, row in (("grpo", lines[2]), ("stare", lines[3])):
        h = np.array([x for x in runs["h"][name] if not math.isnan(x)])
        q = h[-math.ceil(len(h) / 4) :]
        in_band = np.mean(np.abs(q - 0.3) <= 0.3 * 0.3)
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[0] == name and cells[1] == str(N_STEPS) and cells[2] == "0.3"
        assert float(cells[3]) == pytest.approx(h[0], abs=1e-4)
        assert float(cells[4]) == pytest.approx(h[-10:].mean(), abs=1e-4)
        assert float(cells[5]) == pytest.approx(q.mean(), abs=1e-4)
        assert cells[6] == f"{in_band:.0%}"
    assert lines[2].endswith("| n/a |") and lines[3].endswith("| 0.540 |")
    s = PL.run_summary(runs["stare"])
    assert s["last_quarter_in_band"] == 1.0 and PL.run_summary(runs["grpo"])["last_quarter_in_band"] == 0.0


def test_target_from_config_yaml_or_argument(tmp_path):
    run = _write_run(tmp_path / "r", entropy=[0.5, 0.4, 0.45, 0.41], with_target_key=False, stare=False)
    assert PL.run_summary(run)["target_entropy"] is None
    (run / "config.yaml").write_text(yaml.safe_dump({"rl": {"stare": {"target_entropy": 0.4}}}))
    assert PL.run_summary(run)["target_entropy"] == 0.4
    assert PL.run_summary(run, target_entropy=0.5)["last_quarter_in_band"] == 1.0
    assert "0.4 ±30%" in [t.get_text() for t in PL.build_figure([run]).axes[0].get_legend().get_texts()][1]


def test_same_folder_names_get_parent_prefix(tmp_path):
    assert PL.run_labels([tmp_path / "a" / "run", tmp_path / "b" / "run", tmp_path / "c"]) == ["a/run", "b/run", "c"]


def test_bad_runs_name_the_run_and_line(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        PL.plot_runs([tmp_path / "nope"], tmp_path / "x.png")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"metrics.jsonl not found for run .*empty"):
        PL.summary_table([tmp_path / "empty"])
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "metrics.jsonl").write_text('{"step":1,"entropy":0.5}\n{"step":2,"entropy":\n{"step":3}\n')
    with pytest.raises(ValueError, match=r"bad/metrics.jsonl line 2: bad JSON"):
        PL.plot_runs([bad], tmp_path / "x.png")
    (bad / "metrics.jsonl").write_text("")
    with pytest.raises(ValueError, match="holds no step records"):
        PL.summary_table([bad])
    with pytest.raises(ValueError, match="at least one"):
        PL.plot_runs([])


def test_compact_figure_for_many_methods_one_colour_per_group(runs):
    """`stare-jax compare`'s form: four panels, runs of one colour group (the seeds of a method) share a colour, a
    label starting with '_' stays out of the legend, the accuracy panel is the held-out evaluations."""
    dirs = [runs["grpo"], runs["stare"], runs["stare"]]
    fig = PL.build_figure(dirs, labels=["grpo", "stare", "_stare"], colour_groups=["g", "s", "s"], compact=True)
    ax_h, ax_r, ax_acc, ax_len = fig.axes
    lines = [ln for ln in ax_h.get_lines() if ln.get_linestyle() != "--"]
    assert len(lines) == 3 and lines[1].get_color() == lines[2].get_color() != lines[0].get_color()
    assert [t.get_text() for t in ax_h.get_legend().get_texts()] == ["grpo", "STARE target 0.3 ±30%", "stare"]
    np.testing.assert_array_equal(ax_acc.get_lines()[0].get_xdata(), [8, 16, 24])  # stare's evals (grpo has none)
    assert ax_acc.get_title() == "held-out accuracy (step 0 = before RL)"
