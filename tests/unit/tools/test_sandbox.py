"""The code interpreter's sandbox: every attack is real code run through `run_python` and through `SandboxPool`;
afterwards the test process is unharmed, nothing outside the call's own directory changed, no process of a
sandbox uid is left, and the result says what happened.

Most attacks need the namespaces mode (root, and a kernel that allows unshare; the case on the development
machines and in CI): where it is not available they are skipped with the probe's reasons. The fallback (rlimits)
mode is tested too, with the system interpreter (/usr/bin/python3, which the sandbox uid can run outside a
namespace), for what it claims to block, and the user-namespace variant as an unprivileged user. (The SandboxFusion
backend and ToolConfig have their own modules: tests/unit/tools/test_sandbox_fusion.py,
tests/unit/tools/test_config.py.)"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import socket
import subprocess
import sys
import time
import tracemalloc
import uuid

import pytest

from stare_jax.tools import ExecResult, SandboxPool, run_python, sandbox_capabilities
from stare_jax.tools.sandbox import SANDBOX_UID_RANGE, default_python

REPO = pathlib.Path(__file__).resolve().parents[3]
TIMEOUT_S = 1.0
SYSTEM_PYTHON = "/usr/bin/python3"


@pytest.fixture(scope="module")
def caps():
    return sandbox_capabilities()


@pytest.fixture(scope="module")
def ns(caps):
    """Skip unless the namespaces mode is available here (with the probe's reasons)."""
    if caps["isolation"] != "namespaces":
        pytest.skip("namespaces isolation not available: " + "; ".join(caps["reasons"]))
    return caps


@pytest.fixture(scope="module")
def fallback_python():
    """An interpreter the fallback mode can run under a sandbox uid (skip, with the reason, when there is none)."""
    if not os.path.exists(SYSTEM_PYTHON):
        pytest.skip(f"no {SYSTEM_PYTHON} to test the rlimits fallback with")
    caps = sandbox_capabilities(SYSTEM_PYTHON)
    if caps["root"] and not caps["fallback_uid_drop"]:
        pytest.skip("the rlimits fallback is refused here: " + "; ".join(caps["reasons"]))
    if not caps["root"]:
        pytest.skip("not root: the fallback runs as this user, so the attack tests would hit the test runner's user")
    return SYSTEM_PYTHON


@pytest.fixture
def listener():
    """A TCP listener on 127.0.0.1 (the attacks try to reach it); yields (port, connected())."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)

    def connected(wait_s: float = 0.3) -> bool:
        srv.settimeout(wait_s)
        try:
            conn, _ = srv.accept()
        except (socket.timeout, TimeoutError):
            return False
        conn.close()
        return True

    yield srv.getsockname()[1], connected
    srv.close()


def sandbox_processes() -> list[tuple[int, int, str]]:
    """(pid, uid, state) of every live (non-zombie) process whose real uid is a sandbox uid."""
    return _processes_of(SANDBOX_UID_RANGE)


def _processes_of(uids) -> list[tuple[int, int, str]]:
    """(pid, uid, state) of every live (non-zombie) process whose real uid is in `uids` (a range or one uid)."""
    uids = uids if isinstance(uids, range) else range(uids, uids + 1)
    out = []
    for d in pathlib.Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            status = (d / "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        uid = int(fields["Uid"].split()[0])
        state = fields["State"].split()[0]
        if uid in uids and state != "Z":
            out.append((int(d.name), uid, state))
    return out


def assert_no_sandbox_processes(wait_s: float = 1.0) -> None:
    deadline = time.monotonic() + wait_s
    while (left := sandbox_processes()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"sandbox processes survived the call: {left}"


def run(code: str, **kw) -> ExecResult:
    kw.setdefault("timeout_s", TIMEOUT_S)
    t0 = time.monotonic()
    res = run_python(code, **kw)
    assert time.monotonic() - t0 < kw["timeout_s"] + 1.0, f"call took {time.monotonic() - t0:.2f} s: {res}"
    assert_no_sandbox_processes()
    return res


# ------------------------------------------------------------------------------------------------ normal use
def test_capabilities_report_what_is_isolated(caps):
    assert caps["isolation"] in ("namespaces", "rlimits", "refused")
    assert caps["python"] == default_python()
    assert (
        caps["pid_namespace"] == caps["net_namespace"] == caps["mount_namespace"] == (caps["isolation"] == "namespaces")
    )
    if caps["isolation"] == "namespaces":
        assert any("network" in b for b in caps["blocks"]) and caps["does_not_block"]
    else:
        assert caps["reasons"], "a weaker isolation must say why"
    assert sandbox_capabilities() is caps  # probed once


def test_stdout_stderr_exit_code(ns):
    res = run("import sys\nprint('out')\nprint('err', file=sys.stderr)\nsys.exit(3)")
    assert (res.stdout, res.stderr, res.exit_code, res.timed_out, res.truncated) == ("out\n", "err\n", 3, False, False)
    assert res.error is None and res.killed_by is None and not res.ok and res.isolation == "namespaces"
    ok = run("print(6 * 7)")
    assert ok.ok and ok.stdout == "42\n" and ok.exit_code == 0


def test_syntax_error_and_exception(ns):
    res = run("def f(:\n    pass\n")
    assert res.exit_code == 1 and "SyntaxError" in res.stderr and res.error is None
    res = run("print('before')\nraise ValueError('bad value')\n")
    assert res.exit_code == 1 and res.stdout == "before\n"
    assert "ValueError: bad value" in res.stderr and 'File "/tmp/main.py", line 2' in res.stderr


def test_unicode_and_invalid_bytes(ns):
    res = run("import sys\nprint('héllo 世界 🎉')\nsys.stdout.flush()\nsys.stdout.buffer.write(b'\\xff\\xfe ok\\n')")
    assert res.ok and res.stdout.startswith("héllo 世界 🎉\n") and res.stdout.endswith("\ufffd\ufffd ok\n")


def test_large_but_allowed_output(ns):
    res = run("print('y' * 50000)", max_output_bytes=60000)
    assert res.ok and not res.truncated and res.stdout == "y" * 50000 + "\n"
    res = run("print('z' * 50000)", max_output_bytes=1000)  # over the cap but under the drain limit: runs to the end
    assert res.exit_code == 0 and res.truncated and res.stdout == "z" * 1000 and res.killed_by is None


def test_numpy_and_sympy_are_importable(ns):
    res = run("import numpy as np, sympy\nprint(int(np.arange(5).sum()), sympy.factorint(360))", timeout_s=10.0)
    assert res.ok, res
    assert res.stdout == "10 {2: 3, 3: 2, 5: 1}\n"


def _in_tmp(caps) -> list[str]:
    """Top-level names under /tmp that the sandbox's /tmp shows besides the code: the mount points of an
    interpreter that lives under the host's /tmp (a checkout there), none otherwise."""
    return sorted({b.split("/")[2] for b in caps["binds"] if b.startswith("/tmp/")})


def test_fresh_empty_directory_per_call(ns):
    res = run("import os\nprint(os.getcwd(), sorted(os.listdir('.')))\nopen('state.txt', 'w').write('1')")
    assert res.ok and res.stdout == f"/tmp {sorted(['main.py'] + _in_tmp(ns))}\n"
    res = run("import os\nprint(sorted(os.listdir('.')))")
    assert res.stdout == f"{sorted(['main.py'] + _in_tmp(ns))}\n"  # the last call's file is gone


def test_interpreter_under_the_hosts_tmp(ns, tmp_path):
    """A venv that lives under the host's /tmp (a checkout there) is mounted over the call's private /tmp."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    caps = sandbox_capabilities(python)
    assert caps["isolation"] == "namespaces", caps["reasons"]
    res = run("import os, sys\nprint(sys.prefix)\nprint(sorted(os.listdir('/tmp')))", python=python)
    assert res.ok, res
    assert res.stdout == f"{venv.resolve()}\n{sorted(['main.py'] + _in_tmp(caps))}\n"


# ------------------------------------------------------------------------------------------------ attacks
def test_infinite_loop_times_out(ns):
    t0 = time.monotonic()
    res = run("while True:\n    pass\n")
    assert time.monotonic() - t0 < TIMEOUT_S + 1.0
    assert res.timed_out and res.killed_by == "timeout" and res.exit_code == -9 and res.error is None
    # output written before the timeout is kept (the interpreter runs unbuffered)
    res = run("import time\nprint('started')\nwhile True:\n    time.sleep(0.01)\n")
    assert res.timed_out and res.stdout == "started\n"


def test_fork_bomb(ns):
    res = run(
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n", max_processes=16
    )
    assert res.timed_out and res.exit_code == -9
    res = run(
        "import subprocess\nsubprocess.run(['bash', '-c', ':(){ :|:& };:'])\nprint('bash gave up')", max_processes=16
    )
    assert "fork: retry: Resource temporarily unavailable" in res.stderr or res.timed_out


def test_allocating_10_gb(ns):
    res = run("x = bytearray(10 * 1024 ** 3)\nprint('allocated')", memory_mb=512)
    assert res.exit_code == 1 and "MemoryError" in res.stderr and "allocated" not in res.stdout
    res = run("import numpy as np\nx = np.ones(10 * 1024 ** 3 // 8)", memory_mb=512, timeout_s=5.0)
    assert res.exit_code == 1 and ("MemoryError" in res.stderr or "Unable to allocate" in res.stderr)


def test_writing_1_gb_to_stdout(ns):
    tracemalloc.start()
    t0 = time.monotonic()
    res = run(
        "import sys\nchunk = 'x' * (1 << 20)\nfor _ in range(1024):\n    sys.stdout.write(chunk)\nprint('finished')",
        max_output_bytes=10_000,
        timeout_s=10.0,
    )
    elapsed = time.monotonic() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert res.truncated and res.killed_by == "output_limit" and res.exit_code == -9 and not res.timed_out
    assert res.stdout == "x" * 10_000 and "finished" not in res.stdout
    assert elapsed < 3.0, f"an output flood took {elapsed:.2f} s to stop"
    assert peak < 8 * 1024 * 1024, f"the parent held {peak / 2**20:.1f} MiB while reading the flood"


def test_writing_outside_its_directory(ns):
    tag = uuid.uuid4().hex
    targets = [
        REPO / f"escape_{tag}",
        REPO / "README.md",
        pathlib.Path(f"/tmp/escape_{tag}"),
        pathlib.Path(f"/root/escape_{tag}"),
        pathlib.Path(f"/dev/shm/escape_{tag}"),
        pathlib.Path(f"/var/tmp/escape_{tag}"),
        pathlib.Path(f"/etc/escape_{tag}"),
        pathlib.Path(default_python()).parent / f"escape_{tag}",
    ]
    readme = (REPO / "README.md").read_bytes()
    code = (
        f"import os\nfor p in {[str(t) for t in targets]!r}:\n"
        "    try:\n        with open(p, 'a') as f:\n            f.write('pwned')\n"
        "        print(p, 'WROTE', sep='\\t')\n"
        "    except OSError as e:\n        print(p, 'refused: ' + e.strerror, sep='\\t')\n"
    )
    res = run(code)
    assert res.ok, res
    lines = dict(line.split("\t") for line in res.stdout.splitlines())
    assert set(lines) == {str(t) for t in targets}  # the result says what happened to each
    for t in targets:
        if t.name != "README.md":
            assert not t.exists(), f"{t} appeared on the host"
    assert (REPO / "README.md").read_bytes() == readme
    # /tmp and /dev/shm are the call's own private tmpfs: writes there succeed and vanish with the call
    assert lines[f"/tmp/escape_{tag}"] == "WROTE"
    assert lines[str(REPO / "README.md")].startswith("refused")


def test_tcp_connection_to_localhost(ns, listener):
    port, connected = listener
    res = run(
        f"import socket\ntry:\n    socket.create_connection(('127.0.0.1', {port}), timeout=0.5)\n"
        f"    print('CONNECTED')\nexcept OSError as e:\n    print('refused', e)\n"
    )
    assert res.ok and res.stdout.startswith("refused") and "CONNECTED" not in res.stdout
    assert not connected(), "the listener saw a connection from the sandbox"


def test_reading_the_parents_environment(ns, monkeypatch):
    secret = f"s3cret-{uuid.uuid4().hex}"
    monkeypatch.setenv("STARE_SANDBOX_TEST_SECRET", secret)
    code = (
        f"import os\nprint(dict(os.environ))\n"
        f"for pid in (os.getppid(), 1, {os.getpid()}, {os.getppid()}):\n"
        "    try:\n        print(pid, open(f'/proc/{pid}/environ', 'rb').read())\n"
        "    except OSError as e:\n        print(pid, 'refused', e.strerror)\n"
    )
    res = run(code)
    assert res.ok, res
    assert secret not in res.stdout + res.stderr
    assert "STARE_SANDBOX_TEST_SECRET" not in res.stdout
    assert f"{os.getpid()} refused" in res.stdout  # the test process does not exist in the sandbox's /proc


def test_killing_its_parent(ns):
    me = os.getpid()
    code = (
        f"import os, subprocess\n"
        f"for target in (os.getppid(), 1, {me}, {os.getppid()}):\n"
        "    try:\n        os.kill(target, 9)\n        print(target, 'SIGNALLED')\n"
        "    except OSError as e:\n        print(target, 'refused', e.strerror)\n"
        "subprocess.run(['bash', '-c', 'kill -9 -1'])\nprint('after kill -1')\n"
    )
    res = run(code)
    assert "SIGNALLED" not in res.stdout, res.stdout
    assert res.exit_code == -9 and "after kill -1" not in res.stdout  # kill -9 -1 killed only the code itself
    assert os.getpid() == me and run("print('still fine')").stdout == "still fine\n"


def test_background_process_does_not_outlive_the_call(ns, listener):
    port, connected = listener
    marker = pathlib.Path(f"/tmp/sandbox_marker_{uuid.uuid4().hex}")
    code = (
        "import os, socket, time\n"
        "if os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        f"        time.sleep(0.5)\n        open({str(marker)!r}, 'w').write('alive')\n"
        f"        socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
        "    os._exit(0)\n"
        "print('main done')\n"
    )
    res = run(code)
    assert res.ok and res.stdout == "main done\n"
    assert_no_sandbox_processes(wait_s=0.0)  # gone at once: init's exit took the namespace with it
    time.sleep(1.0)
    assert not marker.exists()
    assert not connected()


def test_calls_cannot_see_each_other(ns):
    """Two concurrent calls: different uids, neither sees the other's processes or files."""
    code = (
        "import os, time\nopen('/tmp/mine', 'w').write(str(os.getuid()))\ntime.sleep(0.3)\n"
        "print(os.getuid(), sorted(p for p in os.listdir('/proc') if p.isdigit()), sorted(os.listdir('/tmp')))"
    )
    with SandboxPool(2, timeout_s=5.0) as pool:
        a, b = pool.map([code, code])
    assert a.ok and b.ok
    uid_a, uid_b = a.stdout.split()[0], b.stdout.split()[0]
    assert uid_a != uid_b
    expected = f"['2'] {sorted(['main.py', 'mine'] + _in_tmp(ns))}\n"
    assert a.stdout.split(" ", 1)[1] == b.stdout.split(" ", 1)[1] == expected


def test_pool_runs_every_attack_at_once(ns, listener):
    """The same attacks through the pool, concurrently, with a normal call among them."""
    port, connected = listener
    attacks = {
        "loop": "while True:\n    pass\n",
        "fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
        "memory": "x = bytearray(10 * 1024 ** 3)",
        "flood": "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n",
        "network": f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=0.5)",
        "kill": "import os\nos.kill(os.getppid(), 9)",
        "background": "import os, time\nif os.fork() == 0:\n    time.sleep(5)\nprint('bye')",
        "normal": "print(sum(range(10)))",
    }
    t0 = time.monotonic()
    with SandboxPool(4, timeout_s=TIMEOUT_S, memory_mb=512, max_output_bytes=4096, max_processes=16) as pool:
        results = dict(zip(attacks, pool.map(list(attacks.values()))))
        stats = pool.stats()
    assert time.monotonic() - t0 < 2 * (TIMEOUT_S + 1.0)  # 8 calls on 4 workers: two rounds at most
    r = results
    assert r["loop"].timed_out and r["fork_bomb"].timed_out
    assert r["memory"].exit_code == 1 and "MemoryError" in r["memory"].stderr
    assert r["flood"].killed_by == "output_limit" and r["flood"].truncated and len(r["flood"].stdout) == 4096
    assert r["network"].exit_code == 1 and "Network is unreachable" in r["network"].stderr
    assert r["kill"].exit_code == 1 and "PermissionError" in r["kill"].stderr
    assert r["background"].ok and r["background"].stdout == "bye\n"
    assert r["normal"].ok and r["normal"].stdout == "45\n"
    assert stats["n_calls"] == 8 and stats["n_timeout"] == 2 and stats["n_output_limit"] == 1
    assert not connected()
    assert_no_sandbox_processes()


# ------------------------------------------------------------------------------------------------ pool
class _ExplodingBackend:
    def run(self, code: str) -> ExecResult:
        if code == "explode":
            raise RuntimeError("backend bug")
        return ExecResult(code, "", 0, False, False)


def test_pool_turns_backend_failures_into_results():
    with SandboxPool(2, backend=_ExplodingBackend()) as pool:
        bad, good = pool.map(["explode", "fine"])
        assert bad.error == "sandbox backend: RuntimeError: backend bug" and bad.exit_code is None and not bad.ok
        assert good.ok and good.stdout == "fine"
        assert pool.stats()["n_sandbox_error"] == 1
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit("print(1)")
    with pytest.raises(ValueError, match="max_workers"):
        SandboxPool(0)
    with pytest.raises(ValueError, match="limits to the backend"):
        SandboxPool(1, backend=_ExplodingBackend(), timeout_s=1.0)


def test_run_on_process0_returns_the_pools_results_in_order(monkeypatch):
    """One process: pool.map. Several (simulated: the broadcast as a JSON round trip): process 0's results,
    decoded into equal ExecResults; a process that is not process 0 runs nothing and gets process 0's payload
    (tests/system/test_multihost_engine.py runs it across two real processes)."""
    import json

    from stare_jax import distributed
    from stare_jax.tools.rollout import run_on_process0

    with SandboxPool(2, backend=_ExplodingBackend()) as pool:
        direct = run_on_process0(pool, ["explode", "fine"])
        assert [r.stdout for r in direct] == ["", "fine"] and direct[0].error
        monkeypatch.setattr(distributed, "is_multiprocess", lambda: True)
        monkeypatch.setattr(distributed, "broadcast_from_process0", lambda v: json.loads(json.dumps(v)))
        untimed = lambda rs: [dataclasses.replace(r, wall_s=0.0) for r in rs]  # noqa: E731
        assert untimed(run_on_process0(pool, ["explode", "fine"])) == untimed(direct)  # through JSON and back
        assert pool.stats()["n_calls"] == 4
        sent = [dataclasses.asdict(r) for r in direct]
        monkeypatch.setattr("jax.process_index", lambda: 1)
        monkeypatch.setattr(distributed, "broadcast_from_process0", lambda v: sent)
        assert run_on_process0(pool, ["explode", "fine"]) == direct and pool.stats()["n_calls"] == 4
        with pytest.raises(RuntimeError, match="diverged"):
            run_on_process0(pool, ["fine"])


def test_pool_bounds_concurrency(ns):
    code = "import time\nt0 = time.time()\ntime.sleep(0.4)\nprint(t0, time.time())"
    with SandboxPool(2, timeout_s=5.0) as pool:
        futures = [pool.submit(code) for _ in range(5)]
        spans = [tuple(map(float, f.result().stdout.split())) for f in futures]
    for t, _ in spans:  # at no start time were more than 2 calls running
        assert sum(a <= t < b for a, b in spans) <= 2


# ------------------------------------------------------------------------------------------------ fallback
def test_fallback_rlimits_mode(fallback_python, monkeypatch):
    """The rlimits fallback, forced: limits, scrubbed environment, uid of its own, no leftovers."""
    kw = dict(isolation="rlimits", python=fallback_python)
    res = run("import os\nprint(os.getuid(), os.listdir('.'))", **kw)
    assert res.ok and res.isolation == "rlimits" and int(res.stdout.split()[0]) in SANDBOX_UID_RANGE
    assert res.stdout.split(" ", 1)[1] == "['main.py']\n"
    assert run("while True:\n    pass\n", **kw).timed_out
    assert "MemoryError" in run("x = bytearray(10 * 1024 ** 3)", memory_mb=512, **kw).stderr
    flood = run("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n", max_output_bytes=1000, **kw)
    assert flood.killed_by == "output_limit" and flood.stdout == "x" * 1000
    assert run(
        "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n",
        max_processes=16,
        **kw,
    ).timed_out
    secret = f"s3cret-{uuid.uuid4().hex}"
    monkeypatch.setenv("STARE_SANDBOX_TEST_SECRET", secret)
    env = run(f"import os\nprint(dict(os.environ))\nprint(open('/proc/{os.getpid()}/environ').read())", **kw)
    assert secret not in env.stdout + env.stderr and "PermissionError" in env.stderr
    kill = run(f"import os\nos.kill({os.getpid()}, 9)", **kw)
    assert kill.exit_code == 1 and "PermissionError" in kill.stderr
    # a daemonised grandchild, after a normal exit and after a timeout: killed by the uid sweep
    for tail, expect_timeout in (("print('main done')", False), ("while True:\n    pass", True)):
        marker = pathlib.Path(f"/tmp/sandbox_marker_{uuid.uuid4().hex}")
        res = run(
            "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
            f"        time.sleep({TIMEOUT_S + 0.3})\n        open({str(marker)!r}, 'w').write('alive')\n"
            "    os._exit(0)\n" + tail,
            **kw,
        )
        assert res.timed_out == expect_timeout
        time.sleep(TIMEOUT_S + 0.5)  # past the moment it would have written
        assert not marker.exists(), "a background process outlived the call"


def test_root_never_runs_code_unsandboxed(caps):
    """As root, a forced fallback with an interpreter the sandbox uid cannot run is refused, not run as root."""
    if not caps["root"] or caps["fallback_uid_drop"]:
        pytest.skip("only where the fallback cannot drop privileges for this interpreter (root, venv under /root)")
    res = run_python("import os\nprint(os.getuid())", timeout_s=TIMEOUT_S, isolation="rlimits")
    assert res.error is not None and "refusing" in res.error and res.stdout == "" and res.exit_code is None


_UNPRIVILEGED_SCRIPT = r"""
import json, os, sys
sys.path.insert(0, sys.argv[1])
from stare_jax.tools import run_python, sandbox_capabilities
port, trainer_pid = int(sys.argv[2]), int(sys.argv[3])
caps = sandbox_capabilities()
print(json.dumps({k: caps[k] for k in ("isolation", "root", "user_namespace", "uid_drop", "reasons")}))
codes = {
    "whoami": "import os\nprint(os.getuid(), open('/proc/self/status').read().split('CapEff:')[1].split()[0])",
    "network": f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=0.5)",
    "write": "for p in ['/usr/x', '/etc/x', '/x']:\n    try:\n        open(p, 'w')\n        print(p, 'WROTE')\n"
             "    except OSError as e:\n        print(p, e.strerror)",
    "remount": "import os\nos.system('mount -o remount,rw /usr; unshare -Urm sh -c \"mount -o remount,rw /usr\"')\n"
               "try:\n    open('/usr/x', 'w')\n    print('WROTE')\nexcept OSError as e:\n    print(e.strerror)",
    "env": f"import os\nprint(sorted(os.environ))\nprint(open('/proc/{trainer_pid}/environ').read())",
    "kill": f"import os\nos.kill({trainer_pid}, 9)",
    "loop": "while True:\n    pass",
    "fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
    "memory": "x = bytearray(10 * 1024 ** 3)",
    "background": "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(30)\nprint('bye')",
}
for name, code in codes.items():
    r = run_python(code, timeout_s=1.0, memory_mb=512, max_processes=16)
    print(json.dumps({"name": name, "stdout": r.stdout, "stderr": r.stderr[-400:], "exit_code": r.exit_code,
                      "timed_out": r.timed_out, "error": r.error}))
"""


def test_user_namespace_mode_without_root(listener):
    """Not root: the namespaces mode inside a new user namespace (the caller's uid, no capabilities). Run as the
    unprivileged uid 65534 (setpriv) with the system interpreter, the same attacks, checked from outside."""
    port, connected = listener
    if os.geteuid() != 0 or not os.path.exists(SYSTEM_PYTHON) or not shutil.which("setpriv"):
        pytest.skip("needs root (to become an unprivileged user), setpriv and /usr/bin/python3")
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    check = subprocess.run(
        nobody + [SYSTEM_PYTHON, "-c", f"import sys; sys.path.insert(0, {str(REPO)!r}); import stare_jax.tools"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if check.returncode != 0:
        pytest.skip(f"uid 65534 cannot import stare_jax from {REPO}: {check.stderr.strip()[-200:]}")
    secret = f"s3cret-{uuid.uuid4().hex}"
    before = {p for p, uid, _ in _processes_of(65534)}
    out = subprocess.run(
        nobody + [SYSTEM_PYTHON, "-c", _UNPRIVILEGED_SCRIPT, str(REPO), str(port), str(os.getpid())],
        capture_output=True,
        text=True,
        timeout=120,
        cwd="/",
        env={"PATH": "/usr/bin:/bin", "STARE_SANDBOX_TEST_SECRET": secret},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    caps, r = lines[0], {d["name"]: d for d in lines[1:]}
    if caps["isolation"] != "namespaces":
        pytest.skip("the kernel refuses unprivileged user namespaces here: " + "; ".join(caps["reasons"]))
    assert caps["user_namespace"] and not caps["root"] and not caps["uid_drop"]
    assert all(d["error"] is None for d in r.values()), r
    assert r["whoami"]["stdout"] == "65534 0000000000000000\n"  # the caller's uid, no capability at all
    assert "Network is unreachable" in r["network"]["stderr"] and not connected()
    assert r["write"]["stdout"] == (
        "/usr/x Read-only file system\n/etc/x Read-only file system\n/x Read-only file system\n"
    )
    # neither mount(8) nor a nested user namespace can make the read-only mounts writable again
    assert r["remount"]["stdout"].endswith("Read-only file system\n") and "WROTE" not in r["remount"]["stdout"]
    assert secret not in r["env"]["stdout"] + r["env"]["stderr"] and "FileNotFoundError" in r["env"]["stderr"]
    assert r["kill"]["exit_code"] == 1 and "ProcessLookupError" in r["kill"]["stderr"]
    assert r["loop"]["timed_out"] and r["fork_bomb"]["timed_out"]
    assert r["memory"]["exit_code"] == 1 and "MemoryError" in r["memory"]["stderr"]
    assert r["background"]["exit_code"] == 0 and r["background"]["stdout"] == "bye\n"
    time.sleep(0.2)
    assert {p for p, _, _ in _processes_of(65534)} <= before, "a process of the unprivileged user survived"


def test_bad_arguments_are_the_callers_errors():
    with pytest.raises(TypeError, match="code must be str"):
        run_python(b"print(1)", timeout_s=1.0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout_s=0"):
        run_python("print(1)", timeout_s=0)
