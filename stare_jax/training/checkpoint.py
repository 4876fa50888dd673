"""Checkpoints of the whole run state with orbax-checkpoint, plus a SIGTERM / Ctrl-C (preemption) flag.

One checkpoint step `DIR/<step>/` holds two items:
- "state": one pytree (params, optimizer state, STARE controller state, RNG key, step, ...) saved with
  orbax's StandardSave. jax arrays keep their shardings in the metadata, but restore always follows the
  *abstract* state the caller passes (jax.ShapeDtypeStruct leaves WITH shardings, e.g. from
  jax.eval_shape + the current mesh's NamedShardings), so a run can resume on a different mesh shape:
  orbax reads each shard the new layout needs (resharding restore). Typed PRNG keys (jax.random.key) are
  saved and restored as typed keys; raw uint32 key data works too.
- "extra": a small JSON dict (the grain data-iterator state, the config, anything else JSON-able).

Atomicity: orbax writes into a temporary folder and renames it to `<step>` when every item is committed;
a folder that never got renamed is not a checkpoint. Keep-K pruning is done here, not by orbax, and only
after a newer checkpoint is complete (so at most K+1 steps are on disk while an async save is in flight).

Corruption: a step that cannot be read raises CheckpointCorruptError naming it. With
`restore(..., fallback_to_intact=True)` the unreadable newest steps are moved aside to
`DIR/corrupt_step_<N>` (kept for inspection, never deleted), a warning names them, and the newest intact
step is restored. A state whose tree or shapes do not match the checkpoint raises CheckpointMismatchError
instead (a config error, not corruption: no fallback, nothing moved).

Multi-host: every process constructs the Checkpointer and calls save/restore/wait (orbax coordinates the
writes and deletes); moving corrupt steps aside is done by process 0 only.

Wiring in a training loop (what tests/unit/training/test_checkpoint.py::_train does):

    ck = Checkpointer(run_dir / "ckpt", keep=cfg.keep, every_steps=cfg.every_steps,
                      async_save=cfg.async_save, must_exist=resume)
    if resume:
        r = ck.restore(abstract_state=with_shardings(jax.eval_shape(init_fn), state_shardings),
                       fallback_to_intact=True)
        state, start = r.state, r.step; data_iter.set_state(r.extra["data"])
    writer = MetricsWriter(run_dir, resume_step=start if resume else None)
    preempt = install_preemption_handler()
    for step in range(start + 1, total + 1):
        state, metrics = train_step(state, batch); writer.log(step, metrics)
        extra = {"data": data_iter.get_state()}
        if preempt.should_stop(step):
            ck.save(step, state, extra, force=True); break
        ck.save(step, state, extra, force=step == total)
    ck.close(); writer.close(); preempt.uninstall()
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pathlib
import signal
import threading
from typing import Any, Mapping

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

log = logging.getLogger(__name__)

STATE_ITEM = "state"
EXTRA_ITEM = "extra"
CORRUPT_PREFIX = "corrupt_step_"


class CheckpointNotFoundError(FileNotFoundError):
    """No checkpoint directory, or no complete checkpoint in it."""


class CheckpointCorruptError(RuntimeError):
    """A checkpoint step exists but cannot be read."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


class CheckpointMismatchError(ValueError):
    """The requested abstract state does not match the saved tree (different model/optimizer config)."""


@dataclasses.dataclass(frozen=True)
class Restored:
    """What `Checkpointer.restore` returns: the step restored, the state pytree, the extra JSON dict, and the
    newer steps that were unreadable and moved aside (only with fallback_to_intact=True)."""

    step: int
    state: Any
    extra: dict
    skipped_corrupt_steps: tuple[int, ...] = ()


def _to_abstract(x: Any) -> Any:
    """jax.Array -> ShapeDtypeStruct with its sharding; ShapeDtypeStructs and others pass through."""
    if isinstance(x, jax.Array):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return x


def with_shardings(abstract_tree: Any, sharding_tree: Any) -> Any:
    """Attach shardings to an abstract state (e.g. jax.eval_shape output): the restore target for a mesh.

    `sharding_tree` has the same structure (or is one Sharding used for every leaf)."""
    if isinstance(sharding_tree, jax.sharding.Sharding):
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding_tree), abstract_tree)
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_tree, sharding_tree)


def _path_str(path) -> str:
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)


def _leaf_shape(x: Any) -> tuple | None:
    shape = getattr(x, "shape", None)
    dtype = getattr(x, "dtype", None)
    if shape is not None and dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        # typed keys are stored as their uint32 key data: shape + the key implementation's trailing dims
        abstract = jax.ShapeDtypeStruct(tuple(shape), dtype)
        return tuple(jax.eval_shape(jax.random.key_data, abstract).shape)
    if shape is None:
        return () if isinstance(x, (int, float, bool, np.number)) else None
    return tuple(shape)


def _check_json(extra: Mapping[str, Any]) -> dict:
    if not isinstance(extra, Mapping):
        raise ValueError(f"extra_json must be a dict, got {type(extra).__name__}")
    for key, value in extra.items():
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(
                f"extra_json[{key!r}] is not JSON-serialisable ({e}); put arrays in the state pytree instead"
            ) from e
    return dict(extra)


class Checkpointer:
    """Save / restore the run state every `every_steps` steps, keeping the newest `keep` complete checkpoints.

    Args:
      directory: checkpoint root (local path or gs://...).
      keep: number of complete checkpoints kept (older ones are deleted once a newer one is complete).
      every_steps: `should_save(step)` is True when step % every_steps == 0 (0 = only forced saves).
      async_save: write in a background thread (the caller continues training; `wait()` blocks).
      must_exist: for --resume: raise CheckpointNotFoundError naming the directory if it does not exist
        (instead of creating it).
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        keep: int = 3,
        every_steps: int = 50,
        async_save: bool = True,
        must_exist: bool = False,
    ):
        if keep < 1:
            raise ValueError(f"checkpoint keep must be >= 1, got {keep}")
        if every_steps < 0:
            raise ValueError(f"checkpoint every_steps must be >= 0, got {every_steps}")
        # orbax needs absolute local paths; remote ones (gs://...) are kept as given
        self.directory = pathlib.Path(directory).absolute() if "://" not in str(directory) else directory
        self.keep = keep
        self.every_steps = every_steps
        self.async_save = async_save
        exists = os.path.isdir(directory) if "://" not in str(directory) else True
        if must_exist and not exists:
            raise CheckpointNotFoundError(f"checkpoint directory {directory} does not exist (nothing to resume)")
        self._mngr = self._make_manager()

    def _make_manager(self) -> ocp.CheckpointManager:
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None,  # pruned by _prune, only after a newer step is complete
            save_interval_steps=1,
            enable_async_checkpointing=self.async_save,
            create=True,
        )
        return ocp.CheckpointManager(
            self.directory,
            options=options,
            item_handlers={
                STATE_ITEM: ocp.StandardCheckpointHandler(),
                EXTRA_ITEM: ocp.JsonCheckpointHandler(),
            },
        )

    # ------------------------------------------------------------------ saving

    def should_save(self, step: int) -> bool:
        return self.every_steps > 0 and step % self.every_steps == 0

    def save(self, step: int, state: Any, extra_json: Mapping[str, Any] | None = None, *, force: bool = False) -> bool:
        """Start saving `state` (pytree) and `extra_json` as checkpoint `step`; returns False if skipped.

        Saves when `force` or `should_save(step)`. Async saves return once the arrays are copied off the
        devices; call `wait()` before reading the checkpoint or exiting. Re-saving an existing step is a no-op
        (returns False) so a final forced save after a periodic one is harmless.
        """
        step = int(step)
        if not (force or self.should_save(step)):
            return False
        extra = _check_json(extra_json or {})
        if step in self._mngr.all_steps():
            log.info("checkpoint step %d already exists in %s; not saving again", step, self.directory)
            return False
        args = ocp.args.Composite(**{STATE_ITEM: ocp.args.StandardSave(state), EXTRA_ITEM: ocp.args.JsonSave(extra)})
        # orbax waits for the previous async save before starting this one, so every step but `step` is
        # complete afterwards: keep K of those (plus the one in flight).
        self._mngr.save(step, args=args, force=True)
        self._prune(exclude=step if self.async_save else None)
        return True

    def wait(self) -> None:
        """Block until any async save has finished, then prune to `keep` checkpoints. Raises if it failed."""
        self._mngr.wait_until_finished()
        self._mngr.check_for_errors()
        self._prune(exclude=None)

    def _prune(self, exclude: int | None) -> None:
        # called on every process: orbax's delete removes files on the primary host and then syncs all hosts
        complete = sorted(s for s in self._mngr.all_steps() if s != exclude)
        for old in complete[: max(0, len(complete) - self.keep)]:
            log.info("deleting old checkpoint step %d in %s (keep=%d)", old, self.directory, self.keep)
            self._mngr.delete(old)

    # ------------------------------------------------------------------ querying

    def all_steps(self) -> list[int]:
        """Steps on disk plus the one an async save may have in flight (orbax's own bookkeeping)."""
        return sorted(self._mngr.all_steps())

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    # ------------------------------------------------------------------ restoring

    def restore(
        self, step: int | None = None, *, abstract_state: Any = None, fallback_to_intact: bool = False
    ) -> Restored:
        """Restore checkpoint `step` (default: the newest) laid out as `abstract_state`.

        abstract_state: pytree of jax.ShapeDtypeStruct with shardings (or concrete arrays, whose shardings are
          used) matching the saved tree; arrays come back with exactly these shardings and dtypes. None
          restores the saved layout (only on the same device set; for inspection).
        fallback_to_intact: when the newest step is unreadable, move it aside (corrupt_step_<N>) and try the
          next older one, and so on (only when `step` is None).
        """
        self.wait()
        steps = self.all_steps()
        if not steps:
            raise CheckpointNotFoundError(self._nothing_here_message())
        if step is not None:
            if int(step) not in steps:
                raise CheckpointNotFoundError(f"no checkpoint step {step} in {self.directory}; available: {steps}")
            return self._restore_step(int(step), abstract_state)
        skipped: list[int] = []
        for candidate in reversed(steps):
            try:
                restored = self._restore_step(candidate, abstract_state)
            except CheckpointCorruptError as e:
                if not fallback_to_intact:
                    raise
                log.warning("%s; falling back to the previous checkpoint", e)
                self._move_aside(candidate)
                skipped.append(candidate)
                continue
            if skipped:
                log.warning(
                    "restored checkpoint step %d from %s; unreadable newer step(s) %s moved to %s<N>",
                    candidate,
                    self.directory,
                    skipped,
                    CORRUPT_PREFIX,
                )
            return dataclasses.replace(restored, skipped_corrupt_steps=tuple(skipped))
        raise CheckpointCorruptError(
            f"every checkpoint in {self.directory} is unreadable (steps {skipped}, moved to {CORRUPT_PREFIX}<N>)",
            step=skipped[-1],
        )

    def _nothing_here_message(self) -> str:
        d = self.directory
        if "://" not in str(d) and not os.path.isdir(d):
            return f"checkpoint directory {d} does not exist (nothing to resume)"
        entries = sorted(os.listdir(d)) if "://" not in str(d) else []
        partial = [e for e in entries if "tmp" in e]
        hint = f"; unfinished save(s) found: {partial}" if partial else ""
        return f"checkpoint directory {d} holds no complete checkpoint{hint}"

    def _restore_step(self, step: int, abstract_state: Any) -> Restored:
        where = f"checkpoint step {step} in {self.directory}"
        if abstract_state is not None:
            abstract_state = jax.tree.map(_to_abstract, abstract_state)
            self._check_matches(step, abstract_state, where)
        args = ocp.args.Composite(
            **{STATE_ITEM: ocp.args.StandardRestore(abstract_state), EXTRA_ITEM: ocp.args.JsonRestore()}
        )
        try:
            out = self._mngr.restore(step, args=args)
        except Exception as e:  # noqa: BLE001 - any read failure of an existing step is corruption
            raise CheckpointCorruptError(f"{where} is unreadable ({type(e).__name__}: {_short(e)})", step) from e
        extra = out[EXTRA_ITEM]
        if extra is None:
            raise CheckpointCorruptError(f"{where} is unreadable (its '{EXTRA_ITEM}' JSON is missing)", step)
        return Restored(step=step, state=out[STATE_ITEM], extra=dict(extra))

    def _check_matches(self, step: int, abstract_state: Any, where: str) -> None:
        """Compare leaf paths and shapes with the saved metadata; unreadable metadata counts as corruption."""
        try:
            meta = self._mngr.item_metadata(step)[STATE_ITEM]
            if meta is None:
                raise FileNotFoundError(f"no '{STATE_ITEM}' item metadata")
            meta_tree = getattr(meta, "tree", meta)
            saved = {_path_str(p): _leaf_shape(x) for p, x in jax.tree_util.tree_flatten_with_path(meta_tree)[0]}
        except Exception as e:  # noqa: BLE001
            raise CheckpointCorruptError(f"{where} is unreadable ({type(e).__name__}: {_short(e)})", step) from e
        wanted = {_path_str(p): _leaf_shape(x) for p, x in jax.tree_util.tree_flatten_with_path(abstract_state)[0]}
        missing = sorted(set(wanted) - set(saved))
        unexpected = sorted(set(saved) - set(wanted))
        if missing or unexpected:
            raise CheckpointMismatchError(
                f"{where} does not match the requested state: leaves not in the checkpoint {missing[:8]}, "
                f"checkpoint leaves not requested {unexpected[:8]}"
            )
        bad = [(k, saved[k], wanted[k]) for k in wanted if None not in (saved[k], wanted[k]) and saved[k] != wanted[k]]
        if bad:
            details = ", ".join(f"{k}: saved {s} vs requested {w}" for k, s, w in bad[:8])
            raise CheckpointMismatchError(f"{where} does not match the requested state shapes: {details}")

    def _move_aside(self, step: int) -> None:
        """Rename DIR/<step> to DIR/corrupt_step_<step> (process 0; all processes then sync and reload).
        Object stores (gs://) have no atomic rename: there the step is left in place and only skipped."""
        if jax.process_index() == 0 and "://" not in str(self.directory):
            src = pathlib.Path(self.directory) / str(step)
            dst = pathlib.Path(self.directory) / f"{CORRUPT_PREFIX}{step}"
            n = 1
            while dst.exists():
                dst = pathlib.Path(self.directory) / f"{CORRUPT_PREFIX}{step}.{n}"
                n += 1
            if src.exists():
                os.replace(src, dst)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices(f"stare_jax_checkpoint_move_aside_{step}")
        self._mngr.reload()

    def close(self) -> None:
        """Wait for pending saves and release orbax's threads."""
        self.wait()
        self._mngr.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _short(e: BaseException, n: int = 300) -> str:
    text = str(e).replace("\n", " ")
    return text if len(text) <= n else text[:n] + "..."


# ---------------------------------------------------------------------------------------------- preemption


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _stderr_line(text: str) -> None:
    """One line on stderr from a signal handler: os.write, not print (print could re-enter a buffered write the
    main thread was in the middle of, e.g. the progress bar's)."""
    try:
        os.write(2, ("\n" + text + "\n").encode())
    except OSError:
        pass


SIGINT_IGNORED = (
    "SIGINT is ignored in this process (started in the background by a non-interactive shell, or "
    "under nohup?): Ctrl-C will not stop it; `kill PID` (SIGTERM) stops it after the current step, "
    "which is saved as a checkpoint"
)


class PreemptionHandler:
    """Set by SIGTERM (TPU/GCE preemption notice) or SIGINT (Ctrl-C); the training loop polls
    `should_stop(step)` each step, and when True saves a checkpoint and exits cleanly. The handler only sets a
    flag and says so in one line on stderr.

    Ctrl-C: the first one stops the run at the end of the current step (checkpoint saved; the `stare-jax` command
    then names it in its last line and exits with status 130, SIGTERM with 0: stare_jax.cli.signals); it also puts
    SIGINT back to the system default, so a second Ctrl-C ends the process at once, even inside a long XLA call
    (the current step is lost; the previous checkpoint stays; a shell reports status 130). `reason()` words the
    signal for that last line. A SIGINT that was ignored when the handler was installed (e.g. a
    background job of a non-interactive shell) stays ignored, and `install` says so in one line (SIGINT_IGNORED:
    Ctrl-C will not stop the run, SIGTERM will).

    Multi-host: `should_stop` is this process's flag; the training loop combines the flags of all processes
    each step (stare_jax.distributed.any_process), so every host stops and saves at the same step even when
    only some of them were signalled.
    """

    def __init__(self, signals: tuple[int, ...] = STOP_SIGNALS, *, announce=_stderr_line):
        self._event = threading.Event()
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        self._signals = signals
        self._announce = announce

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def _handle(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        first = not self._event.is_set()
        self.signum = signum
        self._event.set()
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)  # a second Ctrl-C ends the process at once
        if first and self._announce is not None:
            name = "Ctrl-C (SIGINT)" if signum == signal.SIGINT else signal.Signals(signum).name
            again = "; press Ctrl-C again to stop at once without saving it" if signum == signal.SIGINT else ""
            self._announce(f"{name}: stopping after the current step, which is saved as a checkpoint{again}")

    def install(self) -> "PreemptionHandler":
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("install_preemption_handler() must be called from the main thread")
        for sig in self._signals:
            if sig == signal.SIGINT and signal.getsignal(sig) == signal.SIG_IGN:
                if self._announce is not None:  # ignored on purpose by whoever started us: say what still works
                    self._announce(SIGINT_IGNORED)
                continue
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        """Put back the handlers that were there before `install`."""
        for sig, prev in self._previous.items():
            signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
        self._previous.clear()

    @property
    def signal_name(self) -> str | None:
        """SIGINT, SIGTERM, ...: the signal this process got (None: none, or only another process got one)."""
        return None if self.signum is None else signal.Signals(self.signum).name

    def reason(self) -> str:
        """What stopped the run, for the line naming its checkpoint: "interrupted (Ctrl-C)" for SIGINT,
        "preemption signal (SIGTERM)" for SIGTERM, "stop signal on another process" when only another process of a
        multi-process run got one."""
        name = self.signal_name
        if name == "SIGINT":
            return "interrupted (Ctrl-C)"
        if name == "SIGTERM":
            return "preemption signal (SIGTERM)"
        return f"stop signal ({name})" if name else "stop signal on another process"

    def should_stop(self, step: int) -> bool:  # noqa: ARG002 - the step is part of the polling contract
        """Whether THIS process got the signal; multi-process loops must agree across processes
        (stare_jax.distributed.any_process), since only some hosts may be signalled."""
        return self.requested

    def __enter__(self) -> "PreemptionHandler":
        return self

    def __exit__(self, *exc) -> None:
        self.uninstall()


def install_preemption_handler(signals: tuple[int, ...] = STOP_SIGNALS, *, announce=_stderr_line) -> PreemptionHandler:
    """Install the flag-setting handler for SIGTERM and SIGINT (default) and return it; see PreemptionHandler.
    announce: called with one line when the first signal arrives (default: written to stderr; None = silent)."""
    return PreemptionHandler(signals, announce=announce).install()
