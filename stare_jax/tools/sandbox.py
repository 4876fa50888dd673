"""The code interpreter's sandbox: run untrusted (model-written) Python in a fresh, locked-down process.

    run_python(code, *, timeout_s, memory_mb, max_output_bytes) -> ExecResult(stdout, stderr, exit_code,
                                                                              timed_out, truncated, ...)

Each call gets a fresh process in its own empty directory, with the limits below, and everything it started is
gone when the call returns. Model output is never evaluated in the trainer's process: the code is written to a
file and run by a separate interpreter launched through `_sandbox_init.py` (which does the privileged set-up in
its own process, so the trainer never forks).

Isolation (`sandbox_capabilities()` says which applies on this machine; docs/tools.md, "Sandbox", too):
- namespaces (where the kernel allows unshare; the default here and in CI, which run as root; without root
  inside a new user namespace too, where the kernel allows unprivileged ones): new mount, pid, network, IPC and
  UTS namespaces; a fresh root filesystem holding only the interpreter's directories (read-only bind mounts), a
  private size-capped tmpfs at /tmp (the call's directory: cwd, HOME, TMPDIR) and /dev/shm, a minimal /dev and
  the namespace's own /proc; the code runs as an unprivileged uid of its own (setgroups([]), no capabilities,
  no_new_privs; without root: the caller's own uid, no capabilities after exec) with RLIMIT_CPU / AS / FSIZE /
  NPROC / NOFILE / CORE. It sees no network device but a down loopback, no host file (the repository, the data,
  /root: not mounted), no host process (the trainer's pid and /proc/<pid>/environ do not exist in its
  namespace), can signal no process but its own, and when its main process exits the namespace's init exits and
  the kernel kills whatever it left running.
- rlimits (the fallback where namespaces are refused): the same limits, scrubbed environment, stdin at /dev/null
  and a fresh temp dir as cwd; as root also the uid drop (when that uid can run the interpreter) and a kill of every
  process of that uid after the call. It does NOT block the network, nor reads of world-readable files, nor
  writes to world-writable places (/tmp, /dev/shm) - see docs/tools.md.

Every failure of the code (exception, timeout, memory, output flood, crash, killed) and of the sandbox itself
(could not start) is an ExecResult, never an exception: it is the model's failed tool call, not the trainer's.
"""

from __future__ import annotations

import json
import marshal
import os
import random
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Literal

__all__ = ["ExecResult", "run_python", "sandbox_capabilities", "default_python", "SANDBOX_UID_RANGE"]

# the launcher (_sandbox_init.py) is imported by -c, not run as a script, so its bytecode comes from __pycache__
_LAUNCH = [
    "-I",
    "-S",
    "-c",
    f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
    "import _sandbox_init; _sandbox_init.main()",
]
Isolation = Literal["auto", "namespaces", "rlimits"]

# Each in-flight call runs under a uid of its own from this range (unused by any account), so RLIMIT_NPROC (a
# per-uid count) caps each call separately, `kill -9 -1` in one call cannot reach another, and the fallback can
# kill every process a call left behind by its uid. The start is drawn per trainer process.
SANDBOX_UID_RANGE = range(1_900_000_000, 1_900_000_000 + 65536)
_READ_CHUNK = 65536
_STATUS_CAP = 65536


@dataclass(frozen=True)
class ExecResult:
    """What one sandboxed run did. The first five fields are the pinned interface.

    stdout, stderr: the program's output, decoded as UTF-8 (invalid bytes replaced), each cut at max_output_bytes.
    exit_code: the process's exit status; negative = killed by that signal (-9 after a timeout or an output
      flood, -24 (SIGXCPU) at the CPU-time limit); None when no program ran (see `error`).
    timed_out: the wall timeout (or the CPU-time limit) ended it.
    truncated: some output was cut (a stream passed max_output_bytes).
    error: the sandbox's own failure (could not start, HTTP error of a remote backend), None when the code ran.
    killed_by: "timeout", "cpu_limit" or "output_limit" when the sandbox stopped the code, else None.
    wall_s: seconds the call took, start-up included.
    isolation: "namespaces", "rlimits", or the remote backend's name.
    """

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    truncated: bool
    error: str | None = None
    killed_by: str | None = None
    wall_s: float = 0.0
    isolation: str = ""

    @property
    def ok(self) -> bool:
        """The code ran to completion with exit status 0."""
        return self.error is None and not self.timed_out and self.exit_code == 0


def _failed(error: str, isolation: str = "", wall_s: float = 0.0) -> ExecResult:
    return ExecResult("", "", None, False, False, error=error, wall_s=wall_s, isolation=isolation)


class _UidPool:
    """Hands out a distinct uid from SANDBOX_UID_RANGE to each in-flight call."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy: set[int] = set()
        self._next = random.randrange(len(SANDBOX_UID_RANGE))

    def acquire(self) -> int:
        with self._lock:
            while True:
                uid = SANDBOX_UID_RANGE[self._next % len(SANDBOX_UID_RANGE)]
                self._next += 1
                if uid not in self._busy:
                    self._busy.add(uid)
                    return uid

    def release(self, uid: int) -> None:
        with self._lock:
            self._busy.discard(uid)


_UIDS = _UidPool()


def default_python() -> str:
    """The interpreter the code runs in: the trainer's own (its venv, so numpy / sympy are importable), named by a
    path without symlinked directories (only real directories are mounted into the sandbox's root)."""
    exe = sys.executable
    return os.path.join(os.path.realpath(os.path.dirname(exe)), os.path.basename(exe))


def _interpreter_binds(python: str) -> list[str]:
    """Host paths the sandbox's root needs to run `python`: the system directories, /etc and the interpreter's
    prefixes (venv and base), outermost first, none inside another."""
    out = subprocess.run(
        [
            python,
            "-E",
            "-s",
            "-c",
            "import json, sys; print(json.dumps([sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]))",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        env=_base_env(python),
        stdin=subprocess.DEVNULL,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{python} did not report its prefixes: {out.stderr.strip()[-300:]}")
    prefixes = [os.path.realpath(p) for p in json.loads(out.stdout)]
    prefixes += [os.path.dirname(os.path.realpath(python)), os.path.dirname(python)]
    system = ["/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc"]
    paths = [p for p in system if os.path.lexists(p)] + sorted(set(prefixes), key=len)
    binds: list[str] = []
    for p in paths:
        if p not in binds and not any(p.startswith(b.rstrip("/") + "/") for b in binds if not os.path.islink(b)):
            binds.append(p)
    return binds


def _base_env(python: str) -> dict[str, str]:
    """The scrubbed environment: nothing of the trainer's (no tokens, no keys), one thread per numeric library."""
    path = ":".join(dict.fromkeys([os.path.dirname(python), "/usr/local/bin", "/usr/bin", "/bin"]))
    return {
        "PATH": path,
        "HOME": "/tmp",
        "TMPDIR": "/tmp",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "NUMEXPR_NUM_THREADS": "1",
        "MPLBACKEND": "Agg",
    }


# ---------------------------------------------------------------------------------------------- capabilities
_CAPS: dict[str, dict] = {}
_CAPS_LOCK = threading.Lock()

_BLOCKS = {
    "namespaces": [
        "network: new network namespace (only a down loopback; no TCP/UDP/unix-abstract to the host)",
        "host files: fresh root with read-only mounts of /usr, /etc and the interpreter's prefixes only; writes "
        "only to its private tmpfs /tmp and /dev/shm (size-capped, gone after the call)",
        "host processes: new pid namespace with its own /proc (the trainer and its environment are invisible)",
        "signals: unprivileged uid of its own; cannot signal the trainer or another call",
        "leftovers: when the code's main process exits, the namespace's init exits and the kernel kills the rest",
        "resources: RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE, RLIMIT_NPROC, RLIMIT_NOFILE, no core dumps; wall timeout",
        "privilege: setgroups([]), uid/gid dropped (no capabilities), no_new_privs (setuid binaries give nothing)",
    ],
    "rlimits": [
        "resources: RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE, RLIMIT_NPROC, RLIMIT_NOFILE, no core dumps; wall timeout",
        "environment: scrubbed (the trainer's variables are not passed), stdin /dev/null, fresh temp dir as cwd",
        "leftovers: its process group is killed after the call (and, with a uid of its own, every process of it)",
    ],
}
# the namespaces mode without root: a user namespace maps only the caller's uid, so there is no uid to drop to
_USERNS_BLOCKS = [
    "signals: runs under the caller's own uid inside a new user namespace, with no capability left after exec; "
    "the pid namespace leaves it no process outside the call to signal",
    "privilege: no_new_privs; the read-only mounts were made by the namespace's init and cannot be undone without "
    "capabilities",
]
_DOES_NOT_BLOCK = {
    "namespaces": [
        "kernel attack surface: same kernel, no seccomp filter (this is not a VM)",
        "reads of the mounted system directories, /etc and the interpreter's installed packages",
    ],
    "rlimits": [
        "network: the code can open sockets (TCP to localhost and beyond, unix sockets)",
        "reads of any file its uid may read (the repository and data when world-readable)",
        "writes to world-writable places (/tmp, /dev/shm, /var/tmp) and, without a uid of its own, to "
        "everything the trainer's user may write",
        "processes: it sees the host's processes in /proc; without a uid of its own it may signal the "
        "trainer (same user) and read its /proc/<pid>/environ",
        "leftovers that left the process group, when it has no uid of its own",
    ],
}


def sandbox_capabilities(python: str | None = None, refresh: bool = False) -> dict:
    """What isolation `run_python` gets on this machine for `python` (probed once per interpreter, by real calls):

    {"isolation": "namespaces" | "rlimits" | "refused" (what "auto" uses), "root": bool, "pid_namespace",
     "net_namespace", "mount_namespace": bool, "user_namespace": bool (namespaces without root), "uid_drop": bool
     (namespaces as root: the code runs under a uid of its own), "fallback_uid_drop": bool (the same for the
     rlimits mode), "python": path, "binds": [...], "blocks": [...], "does_not_block": [...],
     "reasons": [why a stronger level was not taken]}

    "refused": no namespaces, running as root, and the sandbox uid cannot run the interpreter (e.g. it lives
    under /root): untrusted code is never run as root, so every call returns an ExecResult with `error`."""
    python = python or default_python()
    with _CAPS_LOCK:
        if python in _CAPS and not refresh:
            return _CAPS[python]
        caps = _probe(python)
        _CAPS[python] = caps
        return caps


def _probe_run(python: str, mode: str, binds: list[str], uid_drop: bool) -> tuple[bool, str]:
    """Run a real call in `mode`; True when it ran under the expected uid (a sandbox uid when uid_drop, else ours)."""
    res = _run(
        "import os; print(os.getuid())",
        timeout_s=20.0,
        memory_mb=1024,
        max_output_bytes=4096,
        max_file_mb=8,
        max_processes=16,
        python=python,
        mode=mode,
        uid_drop=uid_drop,
        binds=binds,
    )
    uid = int(res.stdout) if res.ok and res.stdout.strip().isdigit() else None
    ok = uid is not None and (uid in SANDBOX_UID_RANGE if uid_drop else uid == os.getuid())
    return ok, (res.error or res.stderr.strip()[-300:] or f"exit code {res.exit_code}, uid {uid}")


def _probe(python: str) -> dict:
    root = os.geteuid() == 0
    reasons: list[str] = []
    binds: list[str] = []
    ns_ok = fallback_uid_drop = False
    if sys.platform != "linux":
        reasons.append(f"namespaces: not Linux ({sys.platform})")
    else:
        try:
            binds = _interpreter_binds(python)
            ns_ok, why = _probe_run(python, "namespaces", binds, uid_drop=root)
            if not ns_ok:
                what = "" if root else " (not root: in a new user namespace, which the kernel may refuse)"
                reasons.append(f"namespaces{what}: probe failed: {why}")
        except Exception as e:  # noqa: BLE001 - any failure means: fall back, and say why
            reasons.append(f"namespaces: probe failed: {type(e).__name__}: {e}")
    if root:
        fallback_uid_drop, why = _probe_run(python, "rlimits", [], uid_drop=True)
        if not fallback_uid_drop:
            reasons.append(
                f"rlimits: the sandbox uid cannot run {python} outside a namespace ({why}); as root the "
                f"fallback is refused"
            )
    mode = "namespaces" if ns_ok else "rlimits" if (fallback_uid_drop or not root) else "refused"
    blocks = list(_BLOCKS.get(mode, []))
    if mode == "namespaces" and not root:
        blocks = [b for b in blocks if not b.startswith(("signals", "privilege"))] + _USERNS_BLOCKS
    return {
        "isolation": mode,
        "root": root,
        "user_namespace": ns_ok and not root,
        "uid_drop": ns_ok and root,
        "fallback_uid_drop": fallback_uid_drop,
        "pid_namespace": ns_ok,
        "net_namespace": ns_ok,
        "mount_namespace": ns_ok,
        "python": python,
        "binds": binds,
        "blocks": blocks,
        "does_not_block": list(_DOES_NOT_BLOCK.get(mode, [])),
        "reasons": reasons,
    }


# ---------------------------------------------------------------------------------------------- running
def run_python(
    code: str,
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 1024,
    max_output_bytes: int = 16384,
    max_file_mb: int = 16,
    max_processes: int = 32,
    python: str | None = None,
    isolation: Isolation = "auto",
) -> ExecResult:
    """Run `code` as a Python program in a fresh sandboxed process and return what happened (never raises for
    anything the code does).

    timeout_s: wall-clock limit of the whole call (start-up included); the process tree is killed at it.
    memory_mb: address-space limit (RLIMIT_AS) of each of the code's processes; an allocation past it raises
      MemoryError in the code.
    max_output_bytes: kept bytes per stream; a program that keeps writing past max(4x that, 1 MiB) is killed.
    max_file_mb: largest file it may write (RLIMIT_FSIZE) and, with namespaces, the size of its /tmp and /dev/shm.
    max_processes: RLIMIT_NPROC for the call's uid (threads count as processes).
    python: the interpreter (default: the trainer's own, see default_python).
    isolation: "auto" (the strongest this machine allows), "namespaces" (an ExecResult with `error` when the
      machine does not allow them) or "rlimits" (force the fallback; tests use it).
    """
    if not isinstance(code, str):
        raise TypeError(f"run_python: code must be str, got {type(code).__name__}")
    if not timeout_s > 0 or memory_mb < 16 or max_output_bytes < 0 or max_file_mb < 1 or max_processes < 1:
        raise ValueError(
            f"run_python: bad limits timeout_s={timeout_s}, memory_mb={memory_mb}, max_output_bytes="
            f"{max_output_bytes}, max_file_mb={max_file_mb}, max_processes={max_processes}"
        )
    python = python or default_python()
    caps = sandbox_capabilities(python)
    mode = caps["isolation"] if isolation == "auto" else isolation
    if mode == "namespaces" and not caps["mount_namespace"]:
        return _failed(
            "sandbox: isolation='namespaces' was asked for but this machine does not allow it: "
            + "; ".join(caps["reasons"])
        )
    if mode != "namespaces" and caps["root"] and not caps["fallback_uid_drop"]:
        return _failed(
            "sandbox: refusing to run untrusted code as root without namespaces: " + "; ".join(caps["reasons"]),
            isolation="refused",
        )
    if len(code.encode("utf-8", "surrogatepass")) > max_file_mb * 1024 * 1024 // 2:
        return _failed(
            f"sandbox: code of {len(code)} characters is larger than half of max_file_mb={max_file_mb}", isolation=mode
        )
    return _run(
        code,
        timeout_s=timeout_s,
        memory_mb=memory_mb,
        max_output_bytes=max_output_bytes,
        max_file_mb=max_file_mb,
        max_processes=max_processes,
        python=python,
        mode=mode,
        uid_drop=caps["uid_drop"] if mode == "namespaces" else caps["fallback_uid_drop"],
        binds=caps["binds"],
    )


def _run(
    code: str,
    *,
    timeout_s: float,
    memory_mb: int,
    max_output_bytes: int,
    max_file_mb: int,
    max_processes: int,
    python: str,
    mode: str,
    uid_drop: bool,
    binds: list[str],
) -> ExecResult:
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    uid = _UIDS.acquire() if uid_drop else None
    host_dir = tempfile.mkdtemp(prefix="stare_sandbox_")
    proc = None
    status_r = -1
    try:
        if mode == "namespaces":
            os.mkdir(os.path.join(host_dir, "root"))  # mount point of the call's new root (private to it)
            script, cwd = os.path.join(host_dir, "main.py"), "/tmp"
            os.chmod(host_dir, 0o700)
        else:
            cwd = os.path.join(host_dir, "work")
            os.mkdir(cwd, 0o700)
            script = os.path.join(cwd, "main.py")
            if uid is not None:
                os.chown(cwd, uid, uid)
            os.chmod(host_dir, 0o755)
        with open(script, "w", encoding="utf-8", errors="surrogatepass") as f:
            f.write(code)
        os.chmod(script, 0o644)
        env = _base_env(python)
        if mode == "rlimits":
            env.update(HOME=cwd, TMPDIR=cwd)
        status_r, status_w = os.pipe()
        spec = {
            "mode": mode,
            "userns": os.geteuid() != 0,
            "host_dir": host_dir,
            "cwd": cwd,
            "status_fd": status_w,
            "binds": binds,
            "tmpfs_mb": max_file_mb,
            "uid": uid,
            "gid": uid,
            "deadline_s": timeout_s + 1.0,
            "env": env,
            "argv": [python, "-E", "-s", "-u", "-X", "utf8", "-B", "/tmp/main.py" if mode == "namespaces" else script],
            "limits": {
                "cpu_s": int(timeout_s) + 1,
                "as_bytes": int(memory_mb) * 1024 * 1024,
                "fsize_bytes": int(max_file_mb) * 1024 * 1024,
                "nproc": int(max_processes),
                "nofile": 256,
            },
        }
        try:
            proc = subprocess.Popen(
                [sys.executable, *_LAUNCH, _encode(spec)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(status_w,),
                start_new_session=True,
                env={"PATH": env["PATH"], "LANG": "C.UTF-8"},
                cwd=host_dir,
            )
        finally:
            os.close(status_w)
        out = _collect(proc, status_r, deadline, max_output_bytes)
        return _result(out, mode, time.monotonic() - t0)
    except Exception as e:  # noqa: BLE001 - the sandbox itself failed: the call fails, the trainer goes on
        return _failed(f"sandbox: {type(e).__name__}: {e}", isolation=mode, wall_s=time.monotonic() - t0)
    finally:
        if proc is not None:
            _kill_group(proc)
            if uid is not None and mode == "rlimits" and proc.returncode != 0:
                _sweep(uid)  # the launcher was killed before its own sweep: escaped processes of the uid
        if status_r >= 0:
            os.close(status_r)
        shutil.rmtree(host_dir, ignore_errors=True)
        if uid is not None:
            _UIDS.release(uid)


def _encode(spec: dict) -> str:
    """The launcher's argument: the spec as hex-encoded marshal (the launcher then needs no json import)."""
    return marshal.dumps(spec).hex()


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher's process group: the launcher, the namespace's init (whose death kills the whole pid
    namespace) and the code unless it left the group."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    for f in (proc.stdout, proc.stderr):
        if f is not None:
            f.close()


def _sweep(uid: int) -> None:
    """Kill every process of `uid` (kill(-1) as that uid, until none is left), after the trainer killed a
    fallback-mode call whose launcher could not sweep: util-linux's setpriv and a shell loop where present (two
    execs), else the launcher script."""
    setpriv = shutil.which("setpriv")
    if setpriv and os.path.exists("/bin/sh"):
        loop = "i=0; while kill -s KILL -- -1 2>/dev/null && [ $i -lt 10000 ]; do i=$((i+1)); done"
        cmd = [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "/bin/sh", "-c", loop]
    else:
        cmd = [sys.executable, *_LAUNCH, _encode({"mode": "sweep", "uid": uid})]
    subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, timeout=30, env={"PATH": "/usr/bin:/bin"})


def _collect(proc: subprocess.Popen, status_r: int, deadline: float, cap: int) -> dict:
    """Read stdout / stderr / status incrementally until all are closed, the deadline passes, or a stream floods
    (past max(4 x cap, 1 MiB)). Keeps at most `cap` bytes per stream."""
    assert proc.stdout is not None and proc.stderr is not None
    drain_limit = max(4 * cap, 1 << 20)
    streams = {proc.stdout.fileno(): "stdout", proc.stderr.fileno(): "stderr", status_r: "status"}
    kept = {"stdout": bytearray(), "stderr": bytearray(), "status": bytearray()}
    seen = {"stdout": 0, "stderr": 0, "status": 0}
    killed_by = None
    sel = selectors.DefaultSelector()
    for fd in streams:
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    exited_at = None
    try:
        while streams:
            now = time.monotonic()
            if now >= deadline:
                killed_by = "timeout"
                break
            if exited_at is None and proc.poll() is not None:
                exited_at = now
            if exited_at is not None and now - exited_at > 0.5:
                break  # the launcher is gone and what holds the pipes open is not ours to wait for
            wait = min(deadline - now, 0.1 if exited_at is not None else 1.0)
            for key, _ in sel.select(wait):
                fd = int(key.fd)
                try:
                    data = os.read(fd, _READ_CHUNK)
                except BlockingIOError:
                    continue
                name = streams[fd]
                if not data:
                    sel.unregister(fd)
                    del streams[fd]
                    continue
                seen[name] += len(data)
                room = (_STATUS_CAP if name == "status" else cap) - len(kept[name])
                if room > 0:
                    kept[name] += data[:room]
                if name != "status" and seen[name] > drain_limit:
                    killed_by = "output_limit"
            if killed_by:
                break
    finally:
        sel.close()
    if killed_by or proc.poll() is None:
        _kill_group(proc)
    return {
        "stdout": bytes(kept["stdout"]),
        "stderr": bytes(kept["stderr"]),
        "status": bytes(kept["status"]),
        "truncated": seen["stdout"] > cap or seen["stderr"] > cap,
        "killed_by": killed_by,
    }


def _result(out: dict, mode: str, wall_s: float) -> ExecResult:
    status, error = None, None
    for line in out["status"].decode("utf-8", "replace").splitlines():
        kind, _, value = line.partition(" ")
        if kind == "error":
            error = error or value
        elif kind == "status" and value.lstrip("-").isdigit():
            status = int(value)
    killed_by = out["killed_by"]
    exit_code: int | None = None
    if status is not None:
        exit_code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else -os.WTERMSIG(status)
    elif killed_by is not None:
        exit_code = -signal.SIGKILL
    elif error is None:
        error = "sandbox: the launcher ended without reporting the code's exit status"
    if killed_by is None and exit_code == -signal.SIGXCPU:
        killed_by = "cpu_limit"
    if error is not None and killed_by is None:
        exit_code = None
    stdout = out["stdout"].decode("utf-8", "replace")
    stderr = out["stderr"].decode("utf-8", "replace")
    return ExecResult(
        stdout,
        stderr,
        exit_code,
        killed_by in ("timeout", "cpu_limit"),
        bool(out["truncated"]),
        error=error,
        killed_by=killed_by,
        wall_s=wall_s,
        isolation=mode,
    )
