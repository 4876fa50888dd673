"""stare_jax._platform: JAX_PLATFORMS=cpu exactly when libtpu is installed but no TPU is present (and no CUDA plugin
could claim a GPU) and the user set nothing; and, in a fresh process on this machine, `import stare_jax` then jax
starts the CPU backend without libtpu's start-up errors."""

import os
import subprocess
import sys

import pytest

from stare_jax._platform import default_platforms


@pytest.mark.parametrize(
    "environ,libtpu,tpu,cuda,expected",
    [
        ({}, True, False, False, "cpu"),  # the test set-up on a laptop / CPU VM: no libtpu noise
        ({}, True, True, False, None),  # a TPU VM keeps the TPU
        ({}, False, False, False, None),  # no libtpu: jax's default is already quiet
        ({}, True, False, True, None),  # a CUDA plugin may claim a GPU: jax's own choice
        ({"JAX_PLATFORMS": "tpu"}, True, False, False, None),  # the user's word wins
        ({"JAX_PLATFORMS": ""}, True, False, False, None),
    ],
)
def test_default_platforms(environ, libtpu, tpu, cuda, expected):
    assert default_platforms(environ, libtpu_installed=libtpu, has_tpu=tpu, cuda_plugin_installed=cuda) == expected


def _fresh(code: str, **env_changes):
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    env.update(env_changes)
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)


def test_fresh_process_starts_quietly():
    from stare_jax._platform import tpu_present

    if tpu_present():
        pytest.skip("this machine has a TPU: jax is meant to start it")
    p = _fresh("import stare_jax, jax; print(jax.devices()[0].platform)")
    assert p.returncode == 0, p.stderr
    assert p.stdout.split()[-1] == "cpu"
    for noise in ("TPU_WORKER_HOSTNAMES", "host bounds", "TPU accelerator type", "libtpu"):
        assert noise not in p.stderr, p.stderr[:2000]


def test_explicit_platform_is_kept():
    p = _fresh("import os, stare_jax; print(os.environ['JAX_PLATFORMS'])", JAX_PLATFORMS="cpu,tpu")
    assert p.returncode == 0 and p.stdout.strip() == "cpu,tpu", p.stderr
