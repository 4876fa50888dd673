"""SandboxFusionBackend: the real HTTP client against a fake SandboxFusion server (tests/support/tools.py) that
answers in the documented /run_code format; every failure mode of the server is an ExecResult with `error`."""

from __future__ import annotations

import socket

import pytest

from stare_jax.tools import SandboxFusionBackend, SandboxPool
from support.tools import FakeSandboxFusion, fake_sandbox_fusion_server


@pytest.fixture
def fake_sandbox_fusion():
    with fake_sandbox_fusion_server() as url:
        yield url


def test_sandbox_fusion_backend(fake_sandbox_fusion):
    backend = SandboxFusionBackend(
        fake_sandbox_fusion, timeout_s=3.0, memory_mb=256, max_output_bytes=1000, request_timeout_s=1.0
    )
    res = backend.run("print(6 * 7)")
    assert (res.stdout, res.stderr, res.exit_code, res.timed_out, res.truncated) == ("42\n", "", 0, False, False)
    assert res.ok and res.isolation == "sandbox_fusion"
    sent = FakeSandboxFusion.requests[-1]
    assert sent["path"] == "/run_code" and sent["code"] == "print(6 * 7)" and sent["language"] == "python"
    assert sent["run_timeout"] == 3.0 and sent["memory_limit_MB"] == 256
    long = SandboxFusionBackend(fake_sandbox_fusion, max_output_bytes=8).run("print('é' * 20)")
    assert long.truncated and long.stdout == "é" * 4  # 8 bytes of UTF-8, not cut inside a character
    err = backend.run("raise")
    assert err.exit_code == 1 and "ValueError" in err.stderr and err.error is None
    loop = backend.run("loop")
    assert loop.timed_out and loop.killed_by == "timeout" and loop.exit_code == -9 and loop.stdout == "partial"
    for code, words in (
        ("sandbox_error", "SandboxError: no executor"),
        ("http500", "HTTP 500"),
        ("garbage", "not a run_code response"),
        ("slow", "request to"),
    ):
        res = backend.run(code)
        assert res.error is not None and words in res.error and res.exit_code is None, (code, res)
    # the /run_code URL itself is accepted too; a server that is not there is a failed call, not an exception
    assert SandboxFusionBackend(fake_sandbox_fusion + "/run_code/").run("print(1)").stdout == "1\n"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]
    gone = SandboxFusionBackend(f"http://127.0.0.1:{closed_port}", request_timeout_s=1.0).run("print(1)")
    assert gone.error is not None and "refused" in gone.error.lower()
    with SandboxPool(2, backend=backend) as pool:
        assert [r.stdout for r in pool.map(["print(1)", "print(2)"])] == ["1\n", "2\n"]
    with pytest.raises(ValueError, match="http"):
        SandboxFusionBackend("localhost:8080")
