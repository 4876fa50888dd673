"""Per-step run metrics: RUN_DIR/metrics.jsonl (one JSON object per RL step), timing.jsonl, TensorBoard, W&B.

File format (what a reader can rely on):
- One JSON object per line, newline-terminated, written with a single write + flush + fsync, so a killed run
  loses nothing that was already logged (at most a final line without its newline, which readers drop).
- Keys: "step" first, the others sorted, so two runs with identical values give identical bytes.
- Values are JSON scalars (or lists of them). jax/numpy scalars become Python bool/int/float.
  Non-finite floats are written as the JSON strings "NaN", "Infinity", "-Infinity" (never invalid JSON,
  never silently turned into null); `read_metrics` turns them back into floats.
- Timing fields: a key is a *timing key* when it starts with "timing/" or ends with "_s" (seconds, or "per
  second" such as tokens_per_s). They are written to metrics.jsonl (the spec wants step_time_s there) and
  also, with "step", to timing.jsonl. Determinism checks compare `read_metrics(run_dir, drop_timing=True)`
  or `canonical_metrics(run_dir)`, which leave the timing keys out.
- Only the main process writes (jax.process_index() == 0 unless told otherwise); others get a no-op writer.
- Resuming at step N rewrites metrics.jsonl/timing.jsonl atomically (tmp file + fsync + rename) keeping only
  lines with step <= N, so the resumed run does not duplicate steps N+1.. that were logged before a crash.
"""

from __future__ import annotations

import json
import logging
import math
import numbers
import os
import pathlib
import sys
from typing import Any, Iterable, Mapping

import jax
import numpy as np
from tqdm.auto import tqdm

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
TIMING_FILE = "timing.jsonl"
TENSORBOARD_DIR = "tensorboard"

# Keys every RL-step record must carry (issue 5). Eval steps add eval/accuracy and eval/<name>/accuracy.
REQUIRED_STEP_KEYS = (
    "step",
    "entropy",
    "target_entropy",
    "reward_mean",
    "accuracy",
    "response_len_mean",
    "gate_on",
    "stare_w",
    "stare_m",
    "selected_frac_pos",
    "selected_frac_neg",
    "clipfrac",
    "loss",
    "grad_norm",
    "kept_groups_frac",
    "step_time_s",
)

_NONFINITE_TO_STR = {math.inf: "Infinity", -math.inf: "-Infinity"}
_STR_TO_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def is_timing_key(key: str) -> bool:
    """True for wall-clock dependent fields: 'timing/...' or '..._s' (seconds / per second)."""
    return key.startswith("timing/") or key.endswith("_s")


def missing_required_keys(record: Mapping[str, Any], required: Iterable[str] = REQUIRED_STEP_KEYS) -> list[str]:
    """The required keys absent from `record` (empty list when complete)."""
    return [k for k in required if k not in record]


def check_required_keys(record: Mapping[str, Any], required: Iterable[str] = REQUIRED_STEP_KEYS) -> None:
    """Raise ValueError naming the step and every missing key."""
    missing = missing_required_keys(record, required)
    if missing:
        raise ValueError(f"metrics record for step {record.get('step')!r} is missing required keys: {missing}")


def to_json_value(value: Any, key: str = "?") -> Any:
    """jax/numpy/Python value -> JSON-safe Python value (non-finite floats -> 'NaN'/'Infinity'/'-Infinity')."""
    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, (np.bool_,)):
        return bool(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real) and not hasattr(value, "shape"):
        return _float_to_json(float(value))
    if isinstance(value, (list, tuple)):
        return [to_json_value(v, key) for v in value]
    if hasattr(value, "__array__") or isinstance(value, np.generic):
        arr = np.asarray(value)
        if arr.dtype == object or arr.dtype.kind not in "biuf":
            raise ValueError(f"metric {key!r}: cannot log a value of dtype {arr.dtype} ({type(value).__name__})")
        if arr.size == 1:
            item = arr.reshape(()).item()
            return to_json_value(item, key)
        return [to_json_value(v, key) for v in arr.reshape(-1).tolist()]
    raise ValueError(f"metric {key!r}: cannot log a value of type {type(value).__name__}: {value!r}")


def _float_to_json(x: float) -> float | str:
    if math.isnan(x):
        return "NaN"
    if math.isinf(x):
        return _NONFINITE_TO_STR[x]
    return x


def _from_json_value(value: Any) -> Any:
    if isinstance(value, str) and value in _STR_TO_NONFINITE:
        return _STR_TO_NONFINITE[value]
    if isinstance(value, list):
        return [_from_json_value(v) for v in value]
    return value


def _as_int_step(step: Any) -> int:
    if isinstance(step, numbers.Integral) and not isinstance(step, bool):
        return int(step)
    if hasattr(step, "__array__") and not isinstance(step, bool):
        arr = np.asarray(step)
        if arr.size == 1 and arr.dtype.kind in "iu":
            return int(arr.reshape(()).item())
    raise ValueError(f"metrics step must be an integer, got {step!r} ({type(step).__name__})")


def encode_record(step: int, metrics: Mapping[str, Any]) -> dict:
    """The JSON-safe record for one step: {"step": step, **sorted(metrics)}."""
    step = _as_int_step(step)
    if "step" in metrics and to_json_value(metrics["step"], "step") != step:
        raise ValueError(f"metrics carry step={metrics['step']!r} but were logged for step {step}")
    record = {"step": step}
    for key in sorted(metrics):
        if key == "step":
            continue
        if not isinstance(key, str):
            raise ValueError(f"metric names must be strings, got {key!r} at step {step}")
        record[key] = to_json_value(metrics[key], key)
    return record


def dumps_record(record: Mapping[str, Any]) -> str:
    """One canonical JSON line (no trailing newline); allow_nan=False guarantees valid JSON."""
    return json.dumps(record, allow_nan=False, separators=(",", ":"), ensure_ascii=True)


# ----------------------------------------------------------------------------------------------------------
# Reading


def read_jsonl(path: str | os.PathLike, *, what: str = "") -> list[dict]:
    """Parse a metrics-style JSONL file; a bad line raises ValueError naming the file and line number.

    A final line without its newline (a write cut short by a kill) is dropped with a warning.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        where = f" for run {what}" if what else ""
        raise FileNotFoundError(f"{path} not found{where}")
    text = path.read_text(encoding="utf-8")
    lines = text.split("\n")
    tail_partial = lines[-1] != ""
    records = []
    for i, line in enumerate(lines, start=1):
        if line.strip() == "":
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(lines) and tail_partial:
                log.warning("%s line %d: incomplete last line (run killed mid-write?), ignored", path, i)
                break
            raise ValueError(f"{path} line {i}: bad JSON ({e.msg} at column {e.colno}): {line[:120]!r}") from e
        if not isinstance(obj, dict) or "step" not in obj:
            raise ValueError(f"{path} line {i}: expected a JSON object with a 'step' key, got {line[:120]!r}")
        records.append({k: _from_json_value(v) for k, v in obj.items()})
    return records


def read_metrics(run_dir: str | os.PathLike, *, drop_timing: bool = True, filename: str = METRICS_FILE) -> list[dict]:
    """All step records of RUN_DIR/metrics.jsonl (non-finite strings back to floats); timing keys dropped
    by default so that two runs of the same seed compare equal."""
    run_dir = pathlib.Path(run_dir)
    records = read_jsonl(run_dir / filename, what=str(run_dir))
    if drop_timing:
        records = [{k: v for k, v in r.items() if not is_timing_key(k)} for r in records]
    return records


def canonical_metrics(run_dir: str | os.PathLike, *, filename: str = METRICS_FILE) -> str:
    """metrics.jsonl without timing keys, re-serialised canonically: equal strings <=> deterministic runs."""
    recs = read_metrics(run_dir, drop_timing=True, filename=filename)
    return "".join(dumps_record(encode_record(r["step"], r)) + "\n" for r in recs)


# ----------------------------------------------------------------------------------------------------------
# Writing


def _fsync_append(fh, line: str) -> None:
    fh.write(line + "\n")
    fh.flush()
    os.fsync(fh.fileno())


def truncate_after_step(path: str | os.PathLike, step: int) -> int:
    """Atomically rewrite a JSONL file keeping only records with record['step'] <= step; returns lines kept.

    A bad line (other than an incomplete last line) raises ValueError and leaves the file untouched.
    """
    path = pathlib.Path(path)
    if not path.exists():
        return 0
    text = path.read_text(encoding="utf-8")
    kept, dropped = [], 0
    raw_lines = text.split("\n")
    for i, line in enumerate(raw_lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            if i == len(raw_lines):  # no newline after it: a write cut short
                log.warning("%s line %d: dropping incomplete last line on resume", path, i)
                dropped += 1
                continue
            raise ValueError(f"{path} line {i}: bad JSON ({e.msg}); not truncating (fix or move the file)") from e
        if not isinstance(obj, dict) or not isinstance(obj.get("step"), int):
            raise ValueError(f"{path} line {i}: record without an integer 'step'; not truncating")
        if obj["step"] <= step:
            kept.append(line)
        else:
            dropped += 1
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write("".join(line + "\n" for line in kept))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        _fsync_dir(path.parent)
        log.info("%s: resumed at step %d, dropped %d later line(s)", path, step, dropped)
    return len(kept)


def _fsync_dir(directory: pathlib.Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _last_step(path: pathlib.Path) -> int | None:
    if not path.exists():
        return None
    last = None
    for rec in read_jsonl(path):
        last = rec["step"]
    return last


def _default_is_main_process() -> bool:
    return jax.process_index() == 0


class MetricsWriter:
    """Append one JSON line per RL step to RUN_DIR/metrics.jsonl (+ timing.jsonl, TensorBoard, optional W&B).

    Args:
      run_dir: the run's output folder (created).
      tensorboard: also write TensorBoard scalars under RUN_DIR/tensorboard (tensorboardX, no TensorFlow).
      wandb_project: log to Weights & Biases too (wandb must be installed; imported only then).
      is_main_process: only the main process writes anything; default jax.process_index() == 0.
      resume_step: resuming a run after step N: drop logged lines with step > N first (atomic rewrite).
        Without it, an existing non-empty metrics file is an error (a new run would mix into an old one).
      filename: "metrics.jsonl" for RL steps; another name (e.g. "warmstart_metrics.jsonl") for other phases,
        whose timing file is then "<stem>_timing.jsonl" and TensorBoard folder "tensorboard_<stem>".
      required_keys: when given, every logged record must contain these keys (e.g. REQUIRED_STEP_KEYS).
      wandb_config / wandb_name: passed to wandb.init.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        *,
        tensorboard: bool = True,
        wandb_project: str | None = None,
        is_main_process: bool | None = None,
        resume_step: int | None = None,
        filename: str = METRICS_FILE,
        required_keys: Iterable[str] | None = None,
        wandb_config: Mapping[str, Any] | None = None,
        wandb_name: str | None = None,
    ):
        self.run_dir = pathlib.Path(run_dir)
        self.is_main = _default_is_main_process() if is_main_process is None else bool(is_main_process)
        self.required_keys = tuple(required_keys) if required_keys is not None else None
        self.metrics_path = self.run_dir / filename
        stem = filename[: -len(".jsonl")] if filename.endswith(".jsonl") else filename
        if filename == METRICS_FILE:
            self.timing_path, tb_dir = self.run_dir / TIMING_FILE, self.run_dir / TENSORBOARD_DIR
        else:
            self.timing_path, tb_dir = self.run_dir / f"{stem}_timing.jsonl", self.run_dir / f"tensorboard_{stem}"
        self._fh = self._timing_fh = self._tb = self._wandb_run = None
        self._last_step: int | None = None
        if not self.is_main:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is not None:
            truncate_after_step(self.metrics_path, int(resume_step))
            truncate_after_step(self.timing_path, int(resume_step))
            self._last_step = _last_step(self.metrics_path)
        elif self.metrics_path.exists() and self.metrics_path.stat().st_size > 0:
            raise ValueError(
                f"{self.metrics_path} already holds metrics: pass resume_step=N to continue that run "
                f"(lines after step N are dropped), or use a new run directory"
            )
        self._fh = open(self.metrics_path, "a", encoding="utf-8")
        self._timing_fh = open(self.timing_path, "a", encoding="utf-8")
        if tensorboard:
            from tensorboardX import SummaryWriter  # see tests/unit/test_import_direction.py: it imports torch

            self._tb = SummaryWriter(logdir=str(tb_dir), purge_step=None if resume_step is None else resume_step + 1)
        if wandb_project:
            try:
                import wandb
            except ImportError as e:
                raise ImportError(
                    f"logging.wandb_project={wandb_project!r} needs the 'wandb' package: pip install wandb "
                    f"(or leave wandb_project unset)"
                ) from e
            self._wandb_run = wandb.init(
                project=wandb_project,
                dir=str(self.run_dir),
                name=wandb_name or self.run_dir.name,
                config=dict(wandb_config or {}),
                resume="allow" if resume_step is not None else None,
            )

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict:
        """Write one step's record (returns it, JSON-safe). Steps must strictly increase: merge eval metrics
        into the step's dict before logging it."""
        record = encode_record(step, metrics)
        if self.required_keys is not None:
            check_required_keys(record, self.required_keys)
        if not self.is_main:
            return record
        if self._fh is None:
            raise ValueError(f"MetricsWriter for {self.metrics_path} is closed")
        if self._last_step is not None and record["step"] <= self._last_step:
            raise ValueError(
                f"{self.metrics_path}: step {record['step']} logged after step {self._last_step}; steps must "
                f"strictly increase (merge eval metrics into the same step's record)"
            )
        _fsync_append(self._fh, dumps_record(record))
        timing = {k: v for k, v in record.items() if is_timing_key(k)}
        if timing:
            _fsync_append(self._timing_fh, dumps_record({"step": record["step"], **timing}))
        self._last_step = record["step"]
        numeric = _numeric_scalars(record)
        if self._tb is not None:  # an undefined metric (NaN: e.g. accuracy over no such responses) is not plotted
            for key, value in numeric.items():
                if math.isfinite(value):
                    self._tb.add_scalar(key, value, record["step"])
            self._tb.flush()
        if self._wandb_run is not None:
            self._wandb_run.log(numeric, step=record["step"])
        return record

    def close(self) -> None:
        for fh in (self._fh, self._timing_fh):
            if fh is not None:
                fh.close()
        self._fh = self._timing_fh = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _numeric_scalars(record: Mapping[str, Any]) -> dict[str, float]:
    """The record's scalar numbers as floats (non-finite strings back to inf/nan), for TensorBoard and W&B."""
    out = {}
    for key, value in record.items():
        if key == "step":
            continue
        if isinstance(value, (bool, int, float)):
            out[key] = float(value)
        elif isinstance(value, str) and value in _STR_TO_NONFINITE:
            out[key] = _STR_TO_NONFINITE[value]
    return out


# ----------------------------------------------------------------------------------------------------------
# Progress bar


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return str(int(v))
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


class ProgressBar:
    """A tqdm bar over training steps whose postfix shows the live step and some of its metrics: for RL steps
    (the default `keys`) entropy, reward, gate and W; SFT passes SFT_POSTFIX_KEYS (loss, tokens/s).

    `update(record)` takes the dict returned by MetricsWriter.log (or any metrics dict with a 'step').
    Disabled (a no-op) when `enabled` is False, e.g. on non-main processes or with logging.progress_bar off.
    """

    POSTFIX_KEYS = (("entropy", "H"), ("reward_mean", "reward"), ("gate_on", "gate"), ("stare_w", "W"))
    SFT_POSTFIX_KEYS = (("loss", "loss"), ("tokens_per_s", "tok/s"))

    def __init__(
        self,
        total_steps: int,
        *,
        start_step: int = 0,
        enabled: bool = True,
        file=None,
        keys: tuple[tuple[str, str], ...] = POSTFIX_KEYS,
    ):
        self.enabled = enabled
        self.keys = keys
        self._bar = None
        self._pos = start_step
        if enabled:
            self._bar = tqdm(
                total=total_steps, initial=start_step, unit="step", dynamic_ncols=True, file=file or sys.stderr
            )

    def update(self, record: Mapping[str, Any]) -> str:
        """Advance to record['step'] and show its values; returns the postfix text (also when disabled)."""
        step = int(record["step"])
        parts = [f"step={step}"]
        for key, short in self.keys:
            if key in record:
                parts.append(f"{short}={_fmt(to_json_value(record[key], key))}")
        text = " ".join(parts)
        if self._bar is not None:
            self._bar.update(max(0, step - self._pos))
            self._bar.set_postfix_str(text, refresh=True)
        self._pos = max(self._pos, step)
        return text

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "ProgressBar":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
