"""Sandboxed reward scoring: a pool of worker processes with a per-item timeout and a memory limit.

Why a hand-written pool (not multiprocessing.Pool / concurrent.futures): those cannot kill one hung task,
and a worker that dies mid-task either hangs Pool or breaks the whole ProcessPoolExecutor.  Here each worker
owns one pipe and works through its items in order, answering after each, so the parent always knows which
item a worker is on.  Up to `prefetch` small items are queued per worker (kept well under the OS pipe buffer,
so a send never blocks on a busy worker), which saves a process wake-up round trip per item:
- a worker that overruns `timeout_s` is first interrupted inside the worker (SIGALRM raising a
  BaseException, which math-verify/SymPy's `except Exception` cannot swallow); if it is stuck in C code and
  does not answer within `kill_grace_s` more, the parent SIGKILLs it.  Either way: score 0, `n_timeout` += 1.
- a worker that dies (segfault, OOM kill, killed from outside) mid-item: score 0, `n_crash` += 1.
- an exception while scoring (MemoryError from RLIMIT_AS, RecursionError, parser errors): score 0,
  `n_error` += 1; the worker lives on.
Dead or killed workers are replaced at once and the items queued behind the failed one are re-dispatched;
the caller always gets one score per item.

Workers start with the 'forkserver' method (preloading the scoring modules, so replacing a worker costs a
fork, not a SymPy import) or 'spawn'; never plain 'fork', which is unsafe in a process running JAX threads.
Nothing from model output is evaluated as Python anywhere in the scoring path (see rewards/math.py).

Like any spawn/forkserver user, a script that creates a RewardPool needs the `if __name__ == "__main__":`
guard; the workers re-import the main module (not its guarded block) before they start scoring.
"""

from __future__ import annotations

import collections
import math
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from stare_jax.rewards.math import score as _math_score

__all__ = ["RewardPool", "score_without_deadline"]

# Bytes of not-yet-scored items a worker may have queued in its pipe (Linux pipes buffer 64 KiB): below this,
# Connection.send never blocks on a busy worker, so the parent keeps watching deadlines.
_PIPE_BUDGET_BYTES = 32 * 1024
_PRELOAD = ["stare_jax.rewards.math", "stare_jax.rewards.pool", "stare_jax.rewards._preload"]


class _ItemTimeout(BaseException):
    """Raised by SIGALRM inside a worker.  A BaseException so library `except Exception` blocks pass it up."""


def _on_alarm(signum, frame):
    raise _ItemTimeout()


def score_without_deadline(response: str, reference) -> float:
    """The pool's default score_fn: `rewards.math.score` without its in-thread deadline, since the pool owns the
    time limit (alarm, then kill) and counts timeouts itself."""
    return _math_score(response, reference, timeout_s=None)


def _address_space_bytes() -> int:
    """Current virtual address space of this process (0 where /proc is unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _worker_main(conn, score_fn, timeout_s: float, memory_mb: int | None) -> None:
    """Worker loop: limit memory, warm up the parser, then score (idx, response, reference) items until None."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's business; it closes us
    try:
        if memory_mb is not None:
            import resource

            limit = _address_space_bytes() + int(memory_mb) * 1024 * 1024
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        score_fn("\\boxed{\\sqrt{2}}", "2^{1/2}")  # loads the LaTeX grammar once, before any deadline runs
    except BaseException as e:  # noqa: BLE001 - reported to the parent as a start-up failure
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    signal.signal(signal.SIGALRM, _on_alarm)
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        idx, response, reference = msg
        value, status = 0.0, "ok"
        try:
            try:
                signal.setitimer(signal.ITIMER_REAL, timeout_s)
                value = float(score_fn(response, reference))
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0.0)
            if not math.isfinite(value):
                value, status = 0.0, "error"
        except _ItemTimeout:
            value, status = 0.0, "timeout"
        except BaseException:  # noqa: BLE001 - MemoryError, RecursionError, parser bugs: the item scores 0
            value, status = 0.0, "error"
        try:
            conn.send((idx, value, status))
        except (EOFError, OSError):
            return


class _Worker:
    """Parent-side handle of one worker process: its pipe, whether it is ready, and the items sent to it
    (in order; the first is the one it is working on)."""

    def __init__(self, ctx, score_fn, timeout_s: float, memory_mb: int | None):
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_worker_main, args=(child_conn, score_fn, timeout_s, memory_mb), daemon=True)
        self.proc.start()
        child_conn.close()  # so the parent sees EOF when the worker dies
        self.conn = parent_conn
        self.ready = False
        self.started_at = time.monotonic()
        self.queue: collections.deque[int] = collections.deque()
        self.queued_bytes = 0
        self.deadline = math.inf  # hard deadline of the head of the queue

    def kill(self) -> None:
        try:
            self.proc.kill()
        except Exception:  # noqa: BLE001 - already gone
            pass
        self.proc.join(timeout=5.0)
        self.conn.close()


class RewardPool:
    """Score (response, reference) pairs in sandboxed worker processes.

    Args:
      num_workers: worker processes.
      timeout_s: per-item time limit (wall clock, from when the worker starts the item; the parent's hard
        deadline counts from when it learns the previous item finished, so it is never early).
      memory_mb: how far (MiB) each worker's address space may grow beyond its start-up footprint
        (RLIMIT_AS = footprint + memory_mb; relative, so a worker that inherited a big main module still
        works); None for no limit.  A blow-up past it raises MemoryError in the worker: score 0, n_error.
      score_fn: module-level (picklable) function (response, reference) -> float; default
        `score_without_deadline`: `stare_jax.rewards.math.score` (1.0/0.0) with the pool's timeout only.
      start_method: 'forkserver' (default) or 'spawn'.
      kill_grace_s: extra seconds after timeout_s before a worker that ignores its in-process alarm is killed.
      startup_timeout_s: how long a new worker may take to import and warm up.
      prefetch: items queued per worker (>= 1); only small items are queued behind a busy one.

    Use as a context manager (or call close()).  `score_batch` never raises because of an item: timeouts,
    crashes and errors score 0 and are counted in the returned stats.
    """

    def __init__(
        self,
        num_workers: int = 2,
        timeout_s: float = 5.0,
        memory_mb: int | None = 2048,
        score_fn: Callable[[str, object], float] = score_without_deadline,
        start_method: str = "forkserver",
        kill_grace_s: float = 1.0,
        startup_timeout_s: float = 120.0,
        prefetch: int = 4,
    ):
        if num_workers < 1:
            raise ValueError(f"RewardPool: num_workers must be >= 1, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"RewardPool: timeout_s must be > 0, got {timeout_s}")
        if memory_mb is not None and memory_mb < 256:
            raise ValueError(f"RewardPool: memory_mb must be >= 256 (SymPy needs it) or None, got {memory_mb}")
        if prefetch < 1:
            raise ValueError(f"RewardPool: prefetch must be >= 1, got {prefetch}")
        if start_method not in ("forkserver", "spawn"):
            raise ValueError(f"RewardPool: start_method must be 'forkserver' or 'spawn', got {start_method!r}")
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.memory_mb = memory_mb
        self.score_fn = score_fn
        self.kill_grace_s = float(kill_grace_s)
        self.startup_timeout_s = float(startup_timeout_s)
        self.prefetch = int(prefetch)
        self._ctx = mp.get_context(start_method)
        if start_method == "forkserver":
            # Takes effect only if this process has not started its forkserver yet; otherwise workers
            # simply import the modules themselves.
            self._ctx.set_forkserver_preload(_PRELOAD)
        self._closed = False
        self._lock = threading.Lock()  # one score_batch at a time: workers hold per-batch item indices
        self.total_restarts = 0
        self._workers = [self._new_worker() for _ in range(num_workers)]
        self._wait_all_ready()

    # ------------------------------------------------------------------ lifecycle
    def _new_worker(self) -> _Worker:
        return _Worker(self._ctx, self.score_fn, self.timeout_s, self.memory_mb)

    def _wait_all_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        for w in self._workers:
            while not w.ready:
                left = deadline - time.monotonic()
                if left <= 0 or not w.conn.poll(left):
                    self.close()
                    raise RuntimeError(f"RewardPool: worker did not start within {self.startup_timeout_s} s")
                self._handle_startup_message(w)

    def _handle_startup_message(self, w: _Worker) -> None:
        try:
            msg = w.conn.recv()
        except (EOFError, OSError):
            msg = ("failed", f"worker exited with code {w.proc.exitcode} during start-up")
        if msg[0] == "ready":
            w.ready = True
            return
        self.close()
        raise RuntimeError(
            f"RewardPool: worker failed to start ({msg[1]}); memory_mb={self.memory_mb}, "
            f"start_method={self._ctx.get_start_method()}"
        )

    def wait_ready(self, timeout_s: float | None = None) -> None:
        """Block until every worker (including replacements started by the last batch) is ready to score."""
        deadline = time.monotonic() + (self.startup_timeout_s if timeout_s is None else timeout_s)
        for i, w in enumerate(self._workers):
            while not w.ready:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RuntimeError(f"RewardPool.wait_ready: worker {i} not ready in time")
                if mpc.wait([w.conn, w.proc.sentinel], timeout=left) and not w.conn.poll():
                    self._replace(i)  # died during start-up: start another
                    w = self._workers[i]
                    continue
                if w.conn.poll():
                    self._handle_startup_message(w)

    def worker_pids(self) -> list[int]:
        """PIDs of the current workers (for monitoring and tests)."""
        return [w.proc.pid for w in self._workers]

    def close(self) -> None:
        """Stop all workers (politely, then by SIGKILL).  Idempotent."""
        if self._closed:
            return
        self._closed = True
        for w in self._workers:
            try:
                w.conn.send(None)
            except (EOFError, OSError):
                pass
        for w in self._workers:
            w.proc.join(timeout=2.0)
            if w.proc.is_alive():
                w.proc.kill()
                w.proc.join(timeout=5.0)
            w.conn.close()

    def __enter__(self) -> "RewardPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # ------------------------------------------------------------------ scoring
    def _replace(self, i: int) -> None:
        self._workers[i].kill()
        self._workers[i] = self._new_worker()
        self.total_restarts += 1

    def score_batch(
        self, responses: Sequence[str], references: Sequence[str | Sequence[str]]
    ) -> tuple[list[float], dict]:
        """Scores for each (response, reference) pair, in order, and stats: n_items, n_ok, n_correct,
        n_timeout, n_crash, n_error, n_restarts, wall_s, and timeout_idx / crash_idx / error_idx (the items)."""
        with self._lock:
            return self._score_batch(responses, references)

    def _score_batch(self, responses, references) -> tuple[list[float], dict]:
        if self._closed:
            raise RuntimeError("RewardPool.score_batch: the pool is closed")
        if len(responses) != len(references):
            raise ValueError(f"RewardPool.score_batch: {len(responses)} responses but {len(references)} references")
        for j, r in enumerate(responses):
            if not isinstance(r, str):
                raise ValueError(f"RewardPool.score_batch: responses[{j}] is {type(r).__name__}, not str")
        t0 = time.monotonic()
        n = len(responses)
        scores = [0.0] * n
        # counters (int), then the failed items' indices (list[int]) and wall_s (float)
        stats: dict[str, Any] = dict(n_items=n, n_ok=0, n_correct=0, n_timeout=0, n_crash=0, n_error=0, n_restarts=0)
        failed_idx: dict[str, list[int]] = {"n_timeout": [], "n_crash": [], "n_error": []}
        pending = collections.deque(range(n))
        startup_failures = 0

        def size(idx: int) -> int:
            ref = references[idx]
            return len(responses[idx]) + (len(ref) if isinstance(ref, str) else sum(map(len, ref))) + 256

        def fail_worker(i: int, kind: str) -> None:
            """The worker's current item (if any) fails as `kind`; items queued behind it go back to pending."""
            w = self._workers[i]
            if w.queue:
                head = w.queue.popleft()
                stats[kind] += 1
                failed_idx[kind].append(head)
                pending.extendleft(reversed(w.queue))
                w.queue.clear()
            stats["n_restarts"] += 1
            self._replace(i)

        for w in self._workers:  # pick up 'ready' messages of replacements started during the last batch
            while not w.ready and w.proc.is_alive() and w.conn.poll():
                try:
                    msg = w.conn.recv()
                except (EOFError, OSError):
                    break  # handled as a start-up death in the loop below
                if msg[0] != "ready":
                    break  # 'failed' can only be the last message; the loop below sees the exit
                w.ready = True

        while pending or any(w.queue for w in self._workers):
            # 1) hand out items breadth-first: every ready worker gets one before any gets a second
            for depth in range(1, self.prefetch + 1):
                for i, w in enumerate(self._workers):
                    if not (pending and w.ready and len(w.queue) < depth):
                        continue
                    idx = pending[0]
                    if w.queue and w.queued_bytes + size(idx) > _PIPE_BUDGET_BYTES:
                        continue  # big item: wait until this worker has drained its queue
                    pending.popleft()
                    try:
                        w.conn.send((idx, responses[idx], references[idx]))
                    except (EOFError, OSError):
                        pending.appendleft(idx)  # worker died before taking it: not the item's fault
                        fail_worker(i, "n_crash")
                        continue
                    if not w.queue:
                        w.deadline = time.monotonic() + self.timeout_s + self.kill_grace_s
                    w.queue.append(idx)
                    w.queued_bytes += size(idx)
            # 2) wait for a result, a death, a start-up, or the next deadline
            watch = {}
            for i, w in enumerate(self._workers):
                if w.queue or not w.ready:
                    watch[w.conn] = i
                    watch[w.proc.sentinel] = i
            next_deadline = min(
                [w.deadline for w in self._workers if w.queue]
                + [w.started_at + self.startup_timeout_s for w in self._workers if not w.ready]
                + [math.inf]
            )
            wait_s = max(0.0, min(next_deadline - time.monotonic(), 1.0))
            fired = mpc.wait(list(watch), timeout=wait_s) if watch else []
            handled = set()
            for obj in fired:
                i = watch[obj]
                if i in handled:
                    continue
                handled.add(i)
                w = self._workers[i]
                while True:  # drain every message already waiting on this worker's pipe
                    try:
                        if not w.conn.poll():
                            if obj is w.proc.sentinel or not w.proc.is_alive():
                                raise EOFError  # the process is gone
                            break
                        msg = w.conn.recv()
                    except (EOFError, OSError):
                        if not w.ready:
                            startup_failures += 1
                            if startup_failures > 3 * self.num_workers:
                                raise RuntimeError("RewardPool: replacement workers keep dying during start-up")
                        fail_worker(i, "n_crash")
                        break
                    if msg[0] == "ready":
                        w.ready = True
                        continue
                    if msg[0] == "failed":
                        startup_failures += 1
                        if startup_failures > 3 * self.num_workers:
                            raise RuntimeError(f"RewardPool: replacement workers fail to start: {msg[1]}")
                        fail_worker(i, "n_error")
                        break
                    idx, value, status = msg
                    if not w.queue or idx != w.queue[0]:  # the protocol is in-order; be loud if it ever is not
                        raise RuntimeError(f"RewardPool: worker answered item {idx}, expected {list(w.queue)[:1]}")
                    w.queue.popleft()
                    w.queued_bytes -= size(idx)
                    w.deadline = time.monotonic() + self.timeout_s + self.kill_grace_s if w.queue else math.inf
                    scores[idx] = value if status == "ok" else 0.0
                    stats["n_ok" if status == "ok" else f"n_{status}"] += 1
                    stats["n_correct"] += int(status == "ok" and value > 0.5)
                    if status != "ok":
                        failed_idx[f"n_{status}"].append(idx)
            # 3) kill workers past their hard deadline (or stuck in start-up)
            now = time.monotonic()
            for i, w in enumerate(self._workers):
                if w.queue and now > w.deadline:
                    fail_worker(i, "n_timeout")
                elif not w.ready and now > w.started_at + self.startup_timeout_s:
                    raise RuntimeError(f"RewardPool: replacement worker did not start in {self.startup_timeout_s} s")
        for kind, idxs in failed_idx.items():
            stats[kind.replace("n_", "") + "_idx"] = sorted(idxs)
        stats["wall_s"] = time.monotonic() - t0
        return scores, stats
