"""A resumed run keeps its configuration: `--resume` compares the new resolved config with the run's config.yaml.

Keys that only say how a run is executed (where checkpoints and logs go and how often, the device mesh, kernel and
memory choices, how many steps to run) may change on resume: resuming on another topology, or extending a run, is
normal. Any other change (the algorithm, its hyper-parameters, the model, the data, the seed) is refused with the
list of changed keys unless the user allows it (`stare-jax train --resume --allow-config-change`). Every change on
resume, allowed or operational, is appended to RUN_DIR/config_changes.jsonl: {"step", "time", "changes": {key:
[old, new]}, "allowed_by"}.
"""

from __future__ import annotations

import datetime
import json
from typing import Any

import yaml

from stare_jax.config.loader import Config, ConfigError, config_from_dict, to_dict

CHANGES_FILE = "config_changes.jsonl"

# Dotted keys (or section prefixes ending in ".") that may change when a run is resumed: how the run executes
# (placement, memory/kernel choices with the same results, outputs, length), not what it trains.
# (model.scan_layers is not among them: it changes the layout of the parameters in the checkpoint.)
OPERATIONAL = (
    "total_steps",
    "mesh.",
    "checkpoint.",
    "logging.",
    "launch.",
    "toy.cache_dir",
    "sampling.max_prompts_per_call",
    "model.attention_impl",
    "model.remat_policy",
    "rl.logprob_chunk_size",
    "rl.stare.select_impl",
    "rl.stare.theory_diagnostics",
)


def is_operational(key: str) -> bool:
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in OPERATIONAL)


def _leaves(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v and k != "eval_paths":
            out.update(_leaves(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def diff_configs(old: dict, new: dict) -> dict[str, list]:
    """{dotted key: [old value, new value]} for every leaf that differs (a missing leaf reads as None)."""
    a, b = _leaves(old), _leaves(new)
    return {k: [a.get(k), b.get(k)] for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)}


def _saved_config(root) -> dict | None:
    """The run's config.yaml as a full nested dict (rebuilt through the current Config, so keys added since it
    was written read as their defaults), None when the run has none or it no longer parses."""
    path = root / "config.yaml"
    if not path.exists():
        return None
    raw = None
    try:
        raw = yaml.safe_load(path.read_text()) or {}
        return to_dict(config_from_dict(raw, source=str(path)))
    except (yaml.YAMLError, ConfigError, TypeError, AttributeError):
        return raw if isinstance(raw, dict) else None


def _show(v: Any) -> str:
    text = json.dumps(v) if not isinstance(v, str) else v
    return text if len(text) <= 40 else text[:37] + "..."


class ConfigChangeError(ValueError):
    """`--resume` with a configuration that differs from the run's own in keys that change what is trained."""

    def __init__(self, message: str, refused: dict[str, list]):
        super().__init__(message)
        self.refused = refused  # {key: [old, new]} of the keys that may not change

    def summary(self, limit: int = 6) -> str:
        """'key old -> new, ...' of the refused keys (the first `limit`, then how many more)."""
        shown = ", ".join(f"{k} {_show(v[0])} -> {_show(v[1])}" for k, v in list(self.refused.items())[:limit])
        return shown + (f" and {len(self.refused) - limit} more" if len(self.refused) > limit else "")


def check_resume_config(
    root, cfg: Config, *, allow: bool, run_dir: str, flag: str = "--allow-config-change"
) -> dict[str, list]:
    """The changes of `cfg` against the run's saved config (root: the run folder, a path or epath.Path).

    Raises ConfigChangeError naming the changed keys when any of them is not operational and `allow` is False.
    Returns the changes (operational ones included) for `record_changes`."""
    old = _saved_config(root)
    if old is None:
        return {}
    changes = diff_configs(old, to_dict(cfg))
    refused = {k: v for k, v in changes.items() if not is_operational(k)}
    if refused and not allow:
        err = ConfigChangeError("", refused)
        err.args = (
            f"--resume: {run_dir} was trained with a different configuration ({err.summary()}); resume "
            f"with the same --config and overrides (see {run_dir}/config.yaml), pass {flag} to continue "
            f"with the new one (recorded in {CHANGES_FILE}), or use a new --run-dir",
        )
        raise err
    return changes


def record_changes(root, step: int, changes: dict[str, list], *, allowed: bool) -> None:
    """Append one line to RUN_DIR/config_changes.jsonl (works for local folders and gs:// run dirs)."""
    if not changes:
        return
    line = json.dumps(
        {
            "step": int(step),
            "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "changes": changes,
            "allowed_by": "--allow-config-change"
            if allowed and any(not is_operational(k) for k in changes)
            else "operational keys only",
        },
        default=str,
    )
    path = root / CHANGES_FILE
    text = path.read_text() if path.exists() else ""
    path.write_text(text + line + "\n")
