"""The environment of a `stare-jax` subprocess in the tests: a run as on a user's laptop, compiled as the suite
compiles."""

import os
import pathlib

REPO = pathlib.Path(__file__).resolve().parents[2]


def cli_env(*, compile_cache: bool = False) -> dict:
    """os.environ for a CLI subprocess: the CPU platform and one device (the session's 8 fake host devices dropped
    from XLA_FLAGS), the session's other XLA flags kept (the default tiers' -O0 backend: the same IEEE results,
    ~1.5x faster compiles; tests/conftest.py). compile_cache: the checkout's persistent compilation cache, so runs
    of the same toy programs compile once per suite (kept off for runs with the rollout engine: writing its
    programs there has crashed jaxlib, docs/perf_history.md)."""
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
    if flags:
        env["XLA_FLAGS"] = " ".join(flags)
    else:
        env.pop("XLA_FLAGS", None)
    env["JAX_PLATFORMS"] = "cpu"
    if compile_cache:
        env["JAX_COMPILATION_CACHE_DIR"] = str(REPO / ".cache" / "jax")
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0.5"
    return env
