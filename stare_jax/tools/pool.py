"""A bounded pool of sandboxed code runs: the rollout submits the tool calls of a batch and keeps decoding.

    with SandboxPool(4, timeout_s=5, memory_mb=1024, max_output_bytes=16384) as pool:
        fut = pool.submit("print(1)")          # concurrent.futures.Future[ExecResult]
        results = pool.map(["print(2)", "1/0"])  # in order

A thread pool (threads only wait: each call is its own process, see sandbox.run_python) bounds how many run at
once. A call that crashes, hangs, floods or breaks the backend comes back as an ExecResult (`error`, `timed_out`,
`killed_by`): the model's failed tool call, never an exception in the trainer. `stats()` counts them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol

from stare_jax.tools.sandbox import ExecResult, Isolation, run_python

__all__ = ["Backend", "LocalBackend", "SandboxPool"]


class Backend(Protocol):
    """Runs one piece of Python code and says what happened (see ExecResult)."""

    def run(self, code: str) -> ExecResult: ...


class LocalBackend:
    """`run_python` on this machine with fixed limits (the default backend)."""

    name = "local"

    def __init__(
        self,
        *,
        timeout_s: float = 5.0,
        memory_mb: int = 1024,
        max_output_bytes: int = 16384,
        max_file_mb: int = 16,
        max_processes: int = 32,
        python: str | None = None,
        isolation: Isolation = "auto",
    ):
        self.timeout_s, self.memory_mb, self.max_output_bytes = timeout_s, memory_mb, max_output_bytes
        self.max_file_mb, self.max_processes = max_file_mb, max_processes
        self.python, self.isolation = python, isolation

    def run(self, code: str) -> ExecResult:
        return run_python(
            code,
            timeout_s=self.timeout_s,
            memory_mb=self.memory_mb,
            max_output_bytes=self.max_output_bytes,
            max_file_mb=self.max_file_mb,
            max_processes=self.max_processes,
            python=self.python,
            isolation=self.isolation,
        )


class SandboxPool:
    """At most `max_workers` sandboxed runs at once through `backend` (default: LocalBackend(**limits))."""

    def __init__(self, max_workers: int = 4, *, backend: Backend | None = None, **limits):
        if max_workers < 1:
            raise ValueError(f"SandboxPool: max_workers must be >= 1, got {max_workers}")
        if backend is not None and limits:
            raise ValueError(f"SandboxPool: pass limits to the backend, not beside it (got {sorted(limits)})")
        self.backend: Backend = backend if backend is not None else LocalBackend(**limits)
        self.max_workers = max_workers
        self._executor = ThreadPoolExecutor(max_workers, thread_name_prefix="sandbox")
        self._lock = threading.Lock()
        self._stats = dict(
            n_calls=0, n_ok=0, n_failed=0, n_timeout=0, n_output_limit=0, n_truncated=0, n_sandbox_error=0
        )
        self._closed = False

    def _run_one(self, code: str) -> ExecResult:
        t0 = time.monotonic()
        try:
            res = self.backend.run(code)
        except BaseException as e:  # noqa: BLE001 - a backend bug is the call's failure, not the trainer's
            res = ExecResult(
                "",
                "",
                None,
                False,
                False,
                error=f"sandbox backend: {type(e).__name__}: {e}",
                wall_s=time.monotonic() - t0,
            )
        with self._lock:
            s = self._stats
            s["n_calls"] += 1
            s["n_ok" if res.ok else "n_failed"] += 1
            s["n_timeout"] += int(res.timed_out)
            s["n_output_limit"] += int(res.killed_by == "output_limit")
            s["n_truncated"] += int(res.truncated)
            s["n_sandbox_error"] += int(res.error is not None)
        return res

    def submit(self, code: str) -> Future[ExecResult]:
        """Queue one run; its Future resolves to an ExecResult (never to an exception)."""
        if self._closed:
            raise RuntimeError("SandboxPool.submit: the pool is closed")
        return self._executor.submit(self._run_one, code)

    def map(self, codes: Iterable[str]) -> list[ExecResult]:
        """Run all, at most max_workers at once; results in the order of `codes`."""
        futures = [self.submit(c) for c in codes]
        return [f.result() for f in futures]

    def stats(self) -> dict[str, int]:
        """Counts since the pool started: calls, ok, failed (non-zero exit, timeout, error), timeouts, output
        floods stopped, truncated outputs, sandbox/backend errors."""
        with self._lock:
            return dict(self._stats)

    def close(self) -> None:
        """Wait for the running calls (each ends by its own timeout) and drop the queued ones. Idempotent."""
        self._closed = True
        self._executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "SandboxPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
