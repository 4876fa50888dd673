"""Ctrl-C in the `stare-jax` command: one line on stderr and exit status 130, at any moment of any command.

`main()` installs `ctrl_c_exits(command)` before anything else (before the command's module imports jax): from then
on SIGINT writes `stare-jax CMD: interrupted (Ctrl-C)` on stderr, flushes stdout and stderr and ends the process with
os._exit(130). No exception unwinds the stack: a KeyboardInterrupt raised while XLA's threads are alive (during a
compile, say) could crash the process (SIGSEGV) instead of ending it, and one raised in a garbage-collection
callback during `import jax` is swallowed ("Exception ignored in ...").

A Python signal handler runs only when the main thread gets back to Python byte code, which it does not during a
long C++ call (an XLA compile, a device transfer). So the handler also has a watcher thread: CPython's C-level
handler writes the signal's number to a wakeup pipe (signal.set_wakeup_fd) at once, the thread reads it and, if the
exit handler is still SIGINT's handler, ends the process itself, whatever the main thread is doing.

A training loop replaces the handler while it runs (stare_jax.training.checkpoint.PreemptionHandler): its first Ctrl-C
lets the step under way finish and saves it, its second ends the process at once (the system default for SIGINT,
exit status 130 in the shell), and when the loop ends the exit handler is back. The command then says in its last
line which signal stopped it and where the checkpoint is (`stop_status` gives its exit status: 130 for Ctrl-C, 0 for
a preemption's SIGTERM, after which the launchers resume).

Nothing heavy is imported here: it runs before jax is imported.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Iterator

EXIT_INTERRUPTED = 130  # 128 + SIGINT: what a shell reports for a command ended by Ctrl-C

_exiting = threading.Lock()  # taken by the first of the handler and the watcher that ends the process
_wakeup: dict[str, int] = {}  # the watcher's pipe: "read" and "write" file descriptors, made once per process


def interrupted_line(command: str | None) -> str:
    """The one line a Ctrl-C leaves: `stare-jax CMD: interrupted (Ctrl-C)`."""
    return f"stare-jax{' ' + command if command else ''}: interrupted (Ctrl-C)"


def stop_status(stop_signal: str | None) -> int:
    """The exit status of a command that a signal stopped after saving its checkpoint: 130 for Ctrl-C (SIGINT), as
    for any interrupted command; 0 otherwise (a preemption's SIGTERM: the run is saved and resumes on relaunch)."""
    return EXIT_INTERRUPTED if stop_signal == "SIGINT" else 0


class _ExitHandler:
    """SIGINT's handler while no training loop runs: the line, the flushes, os._exit(130)."""

    def __init__(self, command: str | None):
        self.line = interrupted_line(command)

    def __call__(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        end_process(self.line)


def end_process(line: str) -> None:
    """Write `line` on stderr, flush stdout and stderr (for at most half a second: the main thread may hold their
    lock, blocked on a full pipe) and end the process with status 130, without unwinding any stack. Only the first
    caller does it; a second one (the handler and the watcher both saw the signal) waits for the end."""
    if not _exiting.acquire(blocking=False):
        if threading.current_thread() is not threading.main_thread():
            threading.Event().wait()  # the other caller is ending the process
        return
    try:
        os.write(2, ("\n" + line + "\n").encode())
    except OSError:
        pass

    def flush() -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                if stream is not None:
                    stream.flush()
            except Exception:  # noqa: BLE001 - a closed stream, a reentrant call: nothing more to save
                pass

    flusher = threading.Thread(target=flush, daemon=True)
    flusher.start()
    flusher.join(0.5)
    os._exit(EXIT_INTERRUPTED)


def _watch(read_fd: int) -> None:
    """The watcher thread: end the process on a SIGINT while the exit handler is SIGINT's handler."""
    while True:
        try:
            data = os.read(read_fd, 64)
        except InterruptedError:
            continue
        except OSError:
            return
        if not data:
            return
        handler = signal.getsignal(signal.SIGINT)
        if signal.SIGINT in data and isinstance(handler, _ExitHandler):
            end_process(handler.line)


def _wakeup_fd() -> int:
    """The write end of the watcher's pipe (the pipe and its thread are made on first use)."""
    if not _wakeup:
        r, w = os.pipe()  # not inherited by child processes (PEP 446)
        os.set_blocking(w, False)  # set_wakeup_fd needs a non-blocking fd
        _wakeup.update(read=r, write=w)
        threading.Thread(target=_watch, args=(r,), name="stare-jax-ctrl-c", daemon=True).start()
    return _wakeup["write"]


@contextlib.contextmanager
def ctrl_c_exits(command: str | None) -> Iterator[None]:
    """While inside: Ctrl-C ends the process with one line and status 130 (see the module doc); the previous
    handler and wakeup fd are put back on the way out (so `main()` called in a test leaves the process as it was).
    A SIGINT that was ignored when entering stays ignored (nohup, a background job of a script). Outside the main
    thread it does nothing (signal handlers are the main thread's)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        yield
        return
    previous_handler = signal.signal(signal.SIGINT, _ExitHandler(command))
    previous_fd = signal.set_wakeup_fd(_wakeup_fd(), warn_on_full_buffer=False)
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous_fd)
        signal.signal(signal.SIGINT, previous_handler if previous_handler is not None else signal.SIG_DFL)
