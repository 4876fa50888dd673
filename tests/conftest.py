"""Test session set-up: 8 fake CPU devices (for mesh tests), a persistent JAX compilation cache, `slow` marker."""
import os

# Must happen before jax is imported anywhere: 8 host devices so mesh tests can build a (2, 4) mesh.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=8").strip()

import pathlib

import jax
import pytest

_REPO = pathlib.Path(__file__).resolve().parents[1]
jax.config.update("jax_compilation_cache_dir", str(_REPO / ".cache" / "jax"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

SHARED_DATA = _REPO.parent / "shared" / "data"


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow") or os.environ.get("STARE_JAX_RUN_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow or STARE_JAX_RUN_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def shared_data_dir():
    """../shared/data (read in place, never copied into the repo)."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"shared data folder not found at {SHARED_DATA}")
    return SHARED_DATA
