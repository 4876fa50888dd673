"""Run a function with a wall-clock limit, in-process, from any thread (not only the main one).

`call_with_timeout(fn, timeout_s)` runs fn in a helper thread and waits at most timeout_s for it: the caller
gets the result, fn's exception, or `DeadlineExceeded` on time, whatever fn is doing (even inside one long C
call).  A helper that overran is then stopped: a stopper thread raises `_Stop` inside it (CPython's
PyThreadState_SetAsyncExc) and keeps re-raising it every `_RETRY_S` until the helper has left fn, in case
library code swallowed one (`except BaseException:`, bare `except:`, exceptions raised in a GC callback are
only printed).  It is raised only while the helper runs code of the scoring libraries (`_STOPPABLE`), never
inside an unrelated library's GC callback or finaliser that happens to run on the helper thread.

Why not signal.alarm (math-verify's own timeout): SIGALRM handlers run only in the main thread and would replace
a handler the application may own.  Why not a subprocess per call: it costs a process start and a SymPy import
per call (the sandboxed `RewardPool` is that, for scale, with memory limits and kills).

Limit: the stop is delivered between Python bytecodes, so a helper inside one long C call (a big-integer power)
stops only when that call returns; the caller is not kept waiting, but the helper burns CPU until then.  The
math verifier bounds its inputs statically (`_sympy_budget`) so that no such call is long.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Callable
from typing import TypeVar

__all__ = ["DeadlineExceeded", "call_with_timeout"]

T = TypeVar("T")
_RETRY_S = 0.05  # re-raise the stop this often until the helper has left fn
_NOT_NOW_S = 0.002  # the helper is in foreign code (a GC callback, a finaliser): look again this soon
# Code the stop may be raised in: the scoring stack, and this package (but not this module's bookkeeping).
_STOPPABLE = tuple(
    os.sep + name + os.sep for name in ("sympy", "mpmath", "math_verify", "latex2sympy2_extended", "antlr4")
) + (os.path.dirname(os.path.abspath(__file__)) + os.sep,)
# No argtypes: a py_object argument is passed as the object, None as NULL (NULL clears a pending exception).
_set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc


class DeadlineExceeded(TimeoutError):
    """call_with_timeout's fn did not finish within timeout_s (raised in the caller)."""


class _Stop(BaseException):
    """Raised inside an overrunning helper thread.  A BaseException, so that library code's `except Exception`
    blocks (math-verify and SymPy catch broadly) let it through."""


class _Helper:
    def __init__(self, fn: Callable[[], T], stoppable: tuple[str, ...]):
        self.fn = fn
        self.stoppable = stoppable
        self.lock = threading.Lock()
        self.finished = False  # set (under lock) once fn has returned or raised: never stop it after that
        self.injected = False
        self.done = threading.Event()
        self.outcome: tuple[str, object] = ("stopped", None)  # (value | error | stopped, payload)
        self.thread = threading.Thread(target=self._run, name="stare_jax-timed-call", daemon=True)

    def _run(self) -> None:
        try:
            self._call()
        except _Stop:  # delivered on the way out of fn, after _call's finally recorded the outcome
            pass
        self.done.set()

    def _call(self) -> None:
        outcome: tuple[str, object] = ("stopped", None)
        try:
            outcome = ("value", self.fn())
        except _Stop:
            pass
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            outcome = ("error", e)
        finally:
            self.outcome = outcome
            while True:  # after this, no stop is raised or pending in this thread
                try:
                    with self.lock:
                        self.finished = True
                        if self.injected:
                            _set_async_exc(self._thread_id(), None)  # drop an undelivered one
                    break
                except _Stop:
                    continue

    def _thread_id(self) -> ctypes.c_ulong:
        """The helper thread's id; called only once it runs (from it, or after its frame was found)."""
        ident = self.thread.ident
        assert ident is not None
        return ctypes.c_ulong(ident)

    def _in_stoppable_code(self) -> bool:
        ident = self.thread.ident
        frame = None if ident is None else sys._current_frames().get(ident)
        if frame is None or frame.f_code.co_filename == __file__:
            return False  # not started, or in this module's bookkeeping around fn
        return any(part in frame.f_code.co_filename for part in self.stoppable)

    def stop(self) -> None:
        """Stopper thread: raise _Stop in the helper until it has left fn."""
        while True:
            with self.lock:
                if self.finished:
                    return
                ready = self._in_stoppable_code()
                if ready:
                    self.injected = True
                    _set_async_exc(self._thread_id(), ctypes.py_object(_Stop))
            if self.done.wait(_RETRY_S if ready else _NOT_NOW_S):
                return


def call_with_timeout(fn: Callable[[], T], timeout_s: float | None, stoppable: tuple[str, ...] = _STOPPABLE) -> T:
    """fn() if it finishes within timeout_s seconds, else DeadlineExceeded (then fn is stopped in the background,
    in code whose file path contains one of `stoppable`).  fn's exceptions propagate.  timeout_s=None: just
    fn() in the calling thread."""
    if timeout_s is None:
        return fn()
    if not timeout_s > 0:
        raise ValueError(f"call_with_timeout: timeout_s must be > 0 or None, got {timeout_s}")
    helper = _Helper(fn, tuple(stoppable))
    helper.thread.start()
    if not helper.done.wait(timeout_s):
        threading.Thread(target=helper.stop, name="stare_jax-timed-call-stopper", daemon=True).start()
        raise DeadlineExceeded(f"did not finish within {timeout_s} s")
    kind, value = helper.outcome
    if kind == "error":
        raise value  # type: ignore[misc]
    if kind == "stopped":  # only if someone else stopped it; report as a timeout
        raise DeadlineExceeded("stopped")
    return value  # type: ignore[return-value]
