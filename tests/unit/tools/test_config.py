"""ToolConfig (the `tool.*` section): defaults, validation errors naming the key, and the backends and pool it
builds (the SandboxFusion one against the fake server of tests/support/tools.py)."""

from __future__ import annotations

import pytest

from stare_jax.config.options import ConfigError
from stare_jax.tools import SandboxFusionBackend, ToolConfig, make_backend, make_pool
from stare_jax.tools.pool import LocalBackend
from support.tools import fake_sandbox_fusion_server


@pytest.fixture
def fake_sandbox_fusion():
    with fake_sandbox_fusion_server() as url:
        yield url


def test_tool_config(fake_sandbox_fusion):
    cfg = ToolConfig()
    assert (cfg.backend, cfg.timeout_s, cfg.max_workers, cfg.isolation) == ("local", 5.0, 4, "auto")
    backend = make_backend(ToolConfig(timeout_s=2.0, memory_mb=512, max_output_bytes=100))
    assert isinstance(backend, LocalBackend)
    assert (backend.timeout_s, backend.memory_mb, backend.max_output_bytes) == (2.0, 512, 100)
    sf = make_backend(ToolConfig(backend="sandbox_fusion", sandbox_fusion_url=fake_sandbox_fusion, timeout_s=2.0))
    assert isinstance(sf, SandboxFusionBackend) and sf.endpoint == fake_sandbox_fusion + "/run_code"
    pool = make_pool(ToolConfig(backend="sandbox_fusion", sandbox_fusion_url=fake_sandbox_fusion, max_workers=3))
    with pool:
        assert pool.max_workers == 3 and pool.submit("print(5)").result().stdout == "5\n"
    for bad, words in (
        (dict(timeout_s=0), "'timeout_s' = 0 is out of range"),
        (dict(max_workers=0), "'max_workers' = 0 is out of range"),
        (dict(backend="docker"), "'backend' = 'docker' is not accepted"),
        (dict(backend="sandbox_fusion"), "needs 'sandbox_fusion_url'"),
        (dict(sandbox_fusion_url="localhost:8080"), "not an http(s) URL"),
        (dict(memory_mb="1G"), "'memory_mb' = '1G' has the wrong type"),
    ):
        with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
            ToolConfig(**bad)
