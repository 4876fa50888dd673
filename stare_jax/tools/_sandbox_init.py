"""The sandbox's launcher: its own process, started by `sandbox.run_python` as `python -I -S -c "import
_sandbox_init; _sandbox_init.main()" SPEC` (SPEC a hex-encoded marshal dict); the trainer never runs any of it in
its own process. Standard library only, so it starts in a few milliseconds and does all the
privileged set-up in its own process, not in the (threaded) trainer: a fork in a process running JAX threads is
unsafe, and `preexec_fn` is a fork.

Two modes (the spec's "mode"):

namespaces (the default where the kernel allows it; as root, or else inside a new user namespace as well):
  launcher  (pid N in the host's pid namespace, own session: the trainer kills it and its group on a timeout)
    unshare(mount, pid, net, ipc, uts; and user, mapping only the caller's own uid, when not root) then fork:
    init    (pid 1 of the new pid namespace; privileged in it; PR_SET_PDEATHSIG=SIGKILL: dies with the launcher)
      builds a fresh root: a small tmpfs with read-only bind mounts of the interpreter's directories only
      (/usr, /etc, the Python prefix, the venv), a private /tmp (the call's temp dir, size-capped tmpfs), a
      private /dev/shm, a minimal /dev (null, zero, full, random, urandom) and a /proc of the new pid namespace;
      pivot_root into it, detach the host's tree, remount the root read-only; then fork:
      user  (pid 2; rlimits CPU/AS/FSIZE/NPROC/NOFILE/CORE; no_new_privs; as root: setgroups([]) and gid/uid
             dropped to the call's own unprivileged uid; in a user namespace: the caller's own (non-zero) uid,
             whose capabilities go at exec; either way none is left; cwd /tmp; execs Python on /tmp/main.py
             with the scrubbed environment)
    init reports the user process's wait status on the status pipe and exits; the kernel then SIGKILLs every
    other process of the namespace (a daemonised grandchild cannot outlive the call), and the mount namespace
    with its tmpfs goes with them.
rlimits (the fallback: no namespaces): launcher forks the user process directly (same limits and uid drop when
  root), waits, then, when it dropped to a uid of its own, kills every process left with that uid (kill(-1) as
  that uid) before it reports; without one, it kills what is left in its process group (itself last).

Either way the launcher enforces the wall deadline itself as well (deadline_s: kills the user process or init),
so a call cannot run on if the trainer dies. Status lines on fd `status_fd`: "status <wait status>" or
"error <text>". Start-up is on every tool call's path, so the launcher imports little: marshal and plain lines
rather than json (which imports re), os.uname rather than platform, _signal rather than signal (enum), and it
leaves by os._exit (no interpreter finalisation). It is imported by `-c` (not run as a script) so its bytecode is
cached in __pycache__ instead of compiled on every call.
"""

from __future__ import annotations

import _signal as signal  # type: ignore[import-not-found]  # C module; `signal` imports enum, functools, ...
import ctypes
import marshal
import os
import resource
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
CLONE_NEWIPC = 0x08000000
CLONE_NEWUSER = 0x10000000
CLONE_NEWPID = 0x20000000
CLONE_NEWNET = 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
# statvfs f_flag bit -> the mount flag that keeps it (in a user namespace the source's flags are locked: a
# remount must repeat them)
_KEEP = (
    (os.ST_NOEXEC, MS_NOEXEC),
    (os.ST_NOATIME, MS_NOATIME),
    (os.ST_NODIRATIME, MS_NODIRATIME),
    (os.ST_RELATIME, MS_RELATIME),
)
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "riscv64": 41, "ppc64le": 203, "s390x": 217}
DEVICES = ("null", "zero", "full", "random", "urandom")

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _b(s: str | None):
    return None if s is None else os.fsencode(s)


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    _check(
        _libc.mount(_b(source), _b(target), _b(fstype), ctypes.c_ulong(flags), _b(data)),
        f"mount({source!r}, {target!r}, {fstype!r}, {flags:#x}, {data!r})",
    )


def unshare(flags: int) -> None:
    _check(_libc.unshare(ctypes.c_int(flags)), f"unshare({flags:#x})")


def prctl(option: int, arg: int) -> None:
    _check(
        _libc.prctl(ctypes.c_int(option), ctypes.c_ulong(arg), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0)),
        f"prctl({option})",
    )


def pivot_root(new_root: str, put_old: str) -> None:
    nr = SYS_PIVOT_ROOT.get(os.uname().machine)
    if nr is None:
        raise OSError(f"pivot_root: unknown syscall number on {os.uname().machine}")
    _check(_libc.syscall(ctypes.c_long(nr), _b(new_root), _b(put_old)), "pivot_root")


def _report(fd: int, kind: str, value) -> None:
    """One status line: "status <int>" or "error <text on one line>"."""
    try:
        os.write(fd, f"{kind} {str(value).replace(chr(10), ' ')}\n".encode("utf-8", "replace"))
    except OSError:
        pass


def _mount_points_under(path: str) -> list[str]:
    """Mount points at or below `path` (from /proc/self/mountinfo; octal escapes decoded)."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mp = line.split()[4].encode().decode("unicode_escape")
            if mp == path or mp.startswith(path.rstrip("/") + "/"):
                out.append(mp)
    return out


def _bind_readonly(src: str, dst: str) -> None:
    """Bind `src` (recursively) at `dst` and make every mount under it read-only, nosuid and nodev (keeping its
    noexec and atime flags)."""
    mount(src, dst, None, MS_BIND | MS_REC)
    for mp in _mount_points_under(dst):
        f_flag = os.statvfs(mp).f_flag
        keep = sum(ms for st, ms in _KEEP if f_flag & st)
        mount(None, mp, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | keep)


def build_root(spec: dict) -> None:
    """In a new mount namespace (and as pid 1 of a new pid namespace): make the fresh root and pivot into it."""
    new = os.path.join(spec["host_dir"], "root")
    mb = int(spec["tmpfs_mb"])
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing done here propagates back to the host
    mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "size=4m,mode=755")
    # the call's own directory: a private, size-capped tmpfs at /tmp (cwd, HOME, TMPDIR); mounted before the
    # binds, so an interpreter that lives under the host's /tmp (a venv in a checkout there) is bound on top
    os.makedirs(new + "/tmp")
    mount("tmpfs", new + "/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={mb}m,mode=1777")
    for path in spec["binds"]:
        target = new + path
        if os.path.islink(path) and os.path.dirname(path) == "/":
            os.symlink(os.readlink(path), target)  # /bin -> usr/bin and friends on merged-/usr systems
            continue
        if not os.path.isdir(path):
            continue
        os.makedirs(target, exist_ok=True)
        _bind_readonly(path, target)
    # a minimal /dev: the harmless character devices, fd links, and a private /dev/shm
    dev = new + "/dev"
    os.makedirs(dev)
    mount("tmpfs", dev, "tmpfs", MS_NOSUID | MS_NOEXEC, "size=64k,mode=755")
    for name in DEVICES:
        open(f"{dev}/{name}", "w").close()
        mount(f"/dev/{name}", f"{dev}/{name}", None, MS_BIND)
    for name, link in (
        ("fd", "/proc/self/fd"),
        ("stdin", "/proc/self/fd/0"),
        ("stdout", "/proc/self/fd/1"),
        ("stderr", "/proc/self/fd/2"),
    ):
        os.symlink(link, f"{dev}/{name}")
    os.makedirs(dev + "/shm")
    mount("tmpfs", dev + "/shm", "tmpfs", MS_NOSUID | MS_NODEV, f"size={mb}m,mode=1777")
    # /proc of the new pid namespace only (the host's processes, the trainer included, are not in it);
    # hidepid=2 also hides init (root) from the unprivileged user process where the kernel supports it
    os.makedirs(new + "/proc")
    try:
        mount("proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, "hidepid=2")
    except OSError:
        mount("proc", new + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    with open(os.path.join(spec["host_dir"], "main.py"), "rb") as src, open(new + "/tmp/main.py", "wb") as dst:
        dst.write(src.read())
    os.chmod(new + "/tmp/main.py", 0o644)
    os.chdir(new)
    pivot_root(".", ".")  # the old root is stacked under the new one at "/" ...
    _check(_libc.umount2(b".", ctypes.c_int(MNT_DETACH)), "umount2(old root)")  # ... and detached here
    os.chdir("/")
    mount(None, "/", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)
    mount(None, "/dev", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC)


def exec_user(spec: dict, status_fd: int) -> None:
    """In the forked user process: limits, privileges dropped, exec Python on the code. It stays in the launcher's
    process group, so the trainer's killpg reaches it (it may leave with setsid: the pid namespace, or in the
    fallback the uid sweep, catches it then)."""
    try:
        lim = spec["limits"]
        for name, value in (
            ("RLIMIT_CPU", lim["cpu_s"]),
            ("RLIMIT_AS", lim["as_bytes"]),
            ("RLIMIT_FSIZE", lim["fsize_bytes"]),
            ("RLIMIT_NPROC", lim["nproc"]),
            ("RLIMIT_NOFILE", lim["nofile"]),
            ("RLIMIT_CORE", 0),
        ):
            hard = value + 1 if name == "RLIMIT_CPU" else value  # SIGXCPU at the soft limit, SIGKILL 1 s later
            resource.setrlimit(getattr(resource, name), (value, hard))
        prctl(PR_SET_NO_NEW_PRIVS, 1)  # no setuid binary can give privileges back
        if spec["uid"] is not None:
            os.setgroups([])
            os.setgid(spec["gid"])
            os.setuid(spec["uid"])  # from root to a non-zero uid: every capability is dropped
            if os.getuid() != spec["uid"] or os.geteuid() != spec["uid"]:
                raise OSError("uid drop did not take")
        os.chdir(spec["cwd"])
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        os.execve(spec["argv"][0], spec["argv"], spec["env"])
    except BaseException as e:  # noqa: BLE001 - reported, then this child exits
        _report(status_fd, "error", f"sandbox: could not start the code: {type(e).__name__}: {e}")
    os._exit(127)


def _wait_with_deadline(pid: int, deadline_s: float, kill) -> int:
    """waitpid(pid) with SIGALRM killing it (via `kill`) once deadline_s has passed."""
    signal.signal(signal.SIGALRM, lambda *_: kill())
    signal.setitimer(signal.ITIMER_REAL, deadline_s)
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except ChildProcessError:
            status = 0
            break
    signal.setitimer(signal.ITIMER_REAL, 0.0)
    return status


def run_init(spec: dict, status_fd: int) -> None:
    """pid 1 of the new pid namespace: build the root, start the code, reap, report, exit (taking all with it)."""
    try:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        build_root(spec)
        pid = os.fork()
        if pid == 0:
            exec_user(spec, status_fd)
        while True:  # as pid 1, reap orphans too until the code's own process is done
            done, status = os.waitpid(-1, 0)
            if done == pid:
                break
        _report(status_fd, "status", status)
    except BaseException as e:  # noqa: BLE001
        _report(status_fd, "error", f"sandbox: namespace set-up failed: {type(e).__name__}: {e}")
        os._exit(125)
    os._exit(0)  # init exits: the kernel kills every process left in the namespace


def sweep_uid(uid: int) -> None:
    """Kill every process of `uid`, as that uid: kill(-1) reaches exactly the processes it may signal. Repeated
    until none is left (ESRCH), since a process forked while one kill(-1) walks the task list can be missed."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            for _ in range(10000):
                os.kill(-1, signal.SIGKILL)
        except OSError:  # ESRCH: nothing of this uid is left
            pass
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


def enter_namespaces(userns: bool) -> None:
    """New mount, pid, network, IPC and UTS namespaces; without root also a new user namespace first, with the
    caller's own uid and gid mapped to themselves (so the code, exec'd under that non-zero uid, holds no
    capability in it; the launcher and init keep the ones unshare gave them, for the mounts)."""
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS
    if not userns:
        unshare(flags)
        return
    uid, gid = os.getuid(), os.getgid()
    unshare(CLONE_NEWUSER | flags)
    for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def main() -> None:
    spec = marshal.loads(bytes.fromhex(sys.argv[1]))
    if spec["mode"] == "sweep":  # the trainer's clean-up after it killed a fallback-mode call
        sweep_uid(spec["uid"])
        return
    status_fd = int(spec["status_fd"])
    os.set_inheritable(status_fd, False)  # the code's process must not get it (closed on its exec)
    if spec["mode"] == "namespaces":
        try:
            enter_namespaces(spec["userns"])
        except OSError as e:
            _report(status_fd, "error", f"sandbox: unshare failed: {e}")
            os._exit(125)
        pid = os.fork()
        if pid == 0:
            run_init(spec, status_fd)
        status = _wait_with_deadline(pid, spec["deadline_s"], lambda: os.kill(pid, signal.SIGKILL))
        os._exit(0 if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 else 1)
    pid = os.fork()
    if pid == 0:
        exec_user(spec, status_fd)
    status = _wait_with_deadline(pid, spec["deadline_s"], lambda: os.kill(pid, signal.SIGKILL))
    if spec["uid"] is not None and os.geteuid() == 0:
        sweep_uid(spec["uid"])  # whatever the code left running under the call's uid, in the group or not
    _report(status_fd, "status", status)
    if spec["uid"] is None:
        os.killpg(0, signal.SIGKILL)  # no uid of its own: at least what is left in this process group (us too)


if __name__ == "__main__":
    main()
