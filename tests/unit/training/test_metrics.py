"""MetricsWriter: JSONL format (valid JSON, non-finite values, scalar conversion), timing split, resume
truncation, durability against a killed process, TensorBoard events, main-process-only writing."""

import io
import json
import math
import pathlib
import struct
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import numpy as np
import pytest

from stare_jax.training import metrics as M


def _strict_loads(line: str):
    """json.loads that refuses NaN/Infinity literals (what a strict JSON parser would do)."""

    def bad(const):
        raise AssertionError(f"non-standard JSON constant {const} in {line!r}")

    return json.loads(line, parse_constant=bad)


def _full_record(step, **over):
    rec = {k: 0.5 for k in M.REQUIRED_STEP_KEYS if k != "step"}
    rec["gate_on"] = True
    rec.update(over)
    return rec


def test_values_are_converted_and_lines_are_strict_json(tmp_path):
    with M.MetricsWriter(tmp_path, tensorboard=False, is_main_process=True) as w:
        w.log(
            1,
            {
                "entropy": jnp.float32(0.25),
                "reward_mean": np.float64(0.5),
                "gate_on": jnp.bool_(True),
                "kept": np.int32(7),
                "loss": float("nan"),
                "grad_norm": jnp.array(float("inf")),
                "neg": -math.inf,
                "hist": np.array([1.0, np.nan]),
                "name": "arm-a",
            },
        )
        w.log(np.int64(2), {"entropy": 0.125})
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    recs = [_strict_loads(line) for line in lines]
    assert list(recs[0])[0] == "step" and list(recs[0])[1:] == sorted(list(recs[0])[1:])
    r = recs[0]
    assert r["step"] == 1 and r["entropy"] == 0.25 and r["reward_mean"] == 0.5
    assert r["gate_on"] is True and r["kept"] == 7 and isinstance(r["kept"], int)
    assert r["loss"] == "NaN" and r["grad_norm"] == "Infinity" and r["neg"] == "-Infinity"
    assert r["hist"] == [1.0, "NaN"] and r["name"] == "arm-a"
    back = M.read_metrics(tmp_path)
    assert math.isnan(back[0]["loss"]) and back[0]["grad_norm"] == math.inf and back[0]["neg"] == -math.inf
    assert back[1] == {"step": 2, "entropy": 0.125}


def test_bad_values_and_steps_raise(tmp_path):
    with M.MetricsWriter(tmp_path, tensorboard=False, is_main_process=True) as w:
        with pytest.raises(ValueError, match="'obj'"):
            w.log(1, {"obj": object()})
        with pytest.raises(ValueError, match="integer"):
            w.log(1.5, {"a": 1.0})
        w.log(3, {"a": 1.0})
        with pytest.raises(ValueError, match="strictly increase"):
            w.log(3, {"eval/accuracy": 0.5})
        with pytest.raises(ValueError, match="step=4"):
            w.log(5, {"step": 4})


def test_timing_keys_split_and_determinism_view(tmp_path):
    assert M.is_timing_key("step_time_s") and M.is_timing_key("timing/sample") and M.is_timing_key("tokens_per_s")
    assert not M.is_timing_key("stare_w") and not M.is_timing_key("selected_frac_pos")
    runs = []
    for i, t in enumerate([1.25, 9.5]):
        d = tmp_path / f"run{i}"
        with M.MetricsWriter(d, tensorboard=False, is_main_process=True) as w:
            for step in (1, 2):
                w.log(step, _full_record(step, step_time_s=t * step, **{"timing/sample": t}))
        runs.append(d)
    m0 = M.read_metrics(runs[0], drop_timing=False)
    assert m0[0]["step_time_s"] == 1.25  # the spec wants step_time_s in metrics.jsonl too
    t0 = [json.loads(x) for x in (runs[0] / "timing.jsonl").read_text().splitlines()]
    assert t0 == [
        {"step": 1, "step_time_s": 1.25, "timing/sample": 1.25},
        {"step": 2, "step_time_s": 2.5, "timing/sample": 1.25},
    ]
    assert "step_time_s" not in M.read_metrics(runs[0])[0]
    assert M.canonical_metrics(runs[0]) == M.canonical_metrics(runs[1])
    assert (runs[0] / "metrics.jsonl").read_bytes() != (runs[1] / "metrics.jsonl").read_bytes()


def test_required_keys(tmp_path):
    M.check_required_keys({"step": 1, **_full_record(1)})
    with pytest.raises(ValueError, match=r"step 4.*\['grad_norm', 'step_time_s'\]"):
        rec = {"step": 4, **_full_record(4)}
        M.check_required_keys({k: v for k, v in rec.items() if k not in ("grad_norm", "step_time_s")})
    with M.MetricsWriter(tmp_path, tensorboard=False, is_main_process=True, required_keys=M.REQUIRED_STEP_KEYS) as w:
        w.log(1, _full_record(1))
        with pytest.raises(ValueError, match="clipfrac"):
            w.log(2, {k: v for k, v in _full_record(2).items() if k != "clipfrac"})


def test_resume_truncates_atomically_and_refuses_silent_append(tmp_path):
    with M.MetricsWriter(tmp_path, tensorboard=False, is_main_process=True) as w:
        for step in range(1, 6):
            w.log(step, {"entropy": step / 10, "step_time_s": 1.0})
    with pytest.raises(ValueError, match="resume_step"):
        M.MetricsWriter(tmp_path, tensorboard=False, is_main_process=True)
    # a write cut short by a kill: a last line without newline
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write('{"step":6,"entr')
    with M.MetricsWriter(tmp_path, tensorboard=False, is_main_process=True, resume_step=3) as w:
        assert [r["step"] for r in M.read_metrics(tmp_path)] == [1, 2, 3]
        assert [json.loads(x)["step"] for x in (tmp_path / "timing.jsonl").read_text().splitlines()] == [1, 2, 3]
        with pytest.raises(ValueError, match="strictly increase"):
            w.log(3, {"entropy": 0.0})
        w.log(4, {"entropy": 0.44})
    assert [(r["step"], r["entropy"]) for r in M.read_metrics(tmp_path)][-2:] == [(3, 0.3), (4, 0.44)]
    assert not list(tmp_path.glob("*.tmp"))


def test_resume_refuses_to_rewrite_a_file_with_a_bad_middle_line(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text('{"step":1}\n{oops\n{"step":2}\n')
    before = p.read_bytes()
    with pytest.raises(ValueError, match="line 2"):
        M.MetricsWriter(tmp_path, tensorboard=False, is_main_process=True, resume_step=1)
    assert p.read_bytes() == before


def test_read_errors_name_file_and_line(tmp_path):
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        M.read_metrics(tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step":1}\n{"step":2,,}\n')
    with pytest.raises(ValueError, match=r"line 2: bad JSON"):
        M.read_metrics(tmp_path)


def test_lines_survive_a_killed_process(tmp_path):
    code = textwrap.dedent(
        f"""
        import os, signal
        from stare_jax.training.metrics import MetricsWriter
        w = MetricsWriter({str(tmp_path)!r}, tensorboard=False, is_main_process=True)
        for s in (1, 2, 3):
            w.log(s, {{"entropy": s * 0.5}})
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    assert proc.returncode == -9, proc.stderr
    assert [r["entropy"] for r in M.read_metrics(tmp_path)] == [0.5, 1.0, 1.5]


def test_non_main_process_writes_nothing(tmp_path):
    run = tmp_path / "run"
    with M.MetricsWriter(run, is_main_process=False, wandb_project="never-imported") as w:
        rec = w.log(1, {"entropy": jnp.float32(0.5)})
    assert rec == {"step": 1, "entropy": 0.5}
    assert not run.exists()
    with M.MetricsWriter(run, tensorboard=False) as w:  # default: jax.process_index() == 0 writes
        w.log(1, {"entropy": 0.5})
    assert M.read_metrics(run) == [{"step": 1, "entropy": 0.5}]


def _read_tb_scalars(event_dir: pathlib.Path) -> dict[str, list[tuple[int, float]]]:
    """Parse TFRecord-framed tensorboard Event protos with tensorboardX's own proto classes."""
    from tensorboardX.proto import event_pb2

    out: dict[str, list] = {}
    for f in sorted(event_dir.glob("events.out.tfevents.*")):
        data = f.read_bytes()
        pos = 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos : pos + 8])
            ev = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + n])
            pos += 12 + n + 4
            for v in ev.summary.value:
                out.setdefault(v.tag, []).append((ev.step, v.simple_value))
    return out


def test_tensorboard_scalars(tmp_path):
    with M.MetricsWriter(tmp_path, tensorboard=True, is_main_process=True) as w:
        w.log(1, {"entropy": 0.5, "gate_on": True, "name": "x", "eval/accuracy": 0.25})
        w.log(2, {"entropy": 0.75, "gate_on": False, "tool/accuracy_without_tool": float("nan")})
        w.log(3, {"entropy": 1.0, "tool/accuracy_without_tool": 0.5})
    sc = _read_tb_scalars(tmp_path / "tensorboard")
    assert sc["entropy"] == [(1, 0.5), (2, 0.75), (3, 1.0)]
    assert sc["gate_on"] == [(1, 1.0), (2, 0.0)] and sc["eval/accuracy"] == [(1, 0.25)]
    assert "name" not in sc
    # an undefined metric (NaN: no response without the tool) stays in metrics.jsonl and is not plotted
    assert sc["tool/accuracy_without_tool"] == [(3, 0.5)]
    assert (
        M.read_metrics(tmp_path)[1]["tool/accuracy_without_tool"]
        != M.read_metrics(tmp_path)[1]["tool/accuracy_without_tool"]
    )


def test_wandb_missing_is_a_clear_error(tmp_path):
    try:
        import wandb  # noqa: F401

        pytest.skip("wandb is installed")
    except ImportError:
        pass
    with pytest.raises(ImportError, match="pip install wandb"):
        M.MetricsWriter(tmp_path, tensorboard=False, is_main_process=True, wandb_project="p")


def test_progress_bar_shows_live_values():
    buf = io.StringIO()
    with M.ProgressBar(10, start_step=2, file=buf) as bar:
        rec = {"step": 3, "entropy": jnp.float32(0.3125), "reward_mean": 0.5, "gate_on": True, "stare_w": 1.1}
        text = bar.update(rec)
    assert text == "step=3 H=0.3125 reward=0.5 gate=1 W=1.1"
    assert "W=1.1" in buf.getvalue() and "3/10" in buf.getvalue()
    assert M.ProgressBar(5, enabled=False).update({"step": 1}) == "step=1"
    # SFT's bar (stare-jax sft): the same bar with its own values
    sft = M.ProgressBar(5, enabled=False, keys=M.ProgressBar.SFT_POSTFIX_KEYS)
    assert sft.update({"step": 2, "loss": 1.23456, "tokens_per_s": 5120}) == "step=2 loss=1.235 tok/s=5120"
