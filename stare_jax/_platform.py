"""Which JAX platforms a process asks for when the user did not say (JAX_PLATFORMS unset), decided before jax is
imported: on a machine with libtpu installed (the test set-up installs it for the TPU ahead-of-time compiles) but no
TPU chip, jax would first try to start the TPU backend, print ~10 lines of libtpu errors ("could not determine TPU
worker hostnames", "Failed to find host bounds for accelerator type") and then fall back to the CPU. We ask for the
CPU directly in exactly that case; a TPU VM (a TPU chip on the PCI bus, /dev/accel*, /dev/vfio groups) still gets
the TPU, a machine with a CUDA plugin is left to jax's own choice, and an explicit JAX_PLATFORMS always wins.

No jax import here: stare_jax/__init__.py calls `choose_default_platforms()` before any submodule imports jax.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import pathlib
import sys
from typing import Mapping

_GOOGLE_PCI_VENDOR = "0x1ae0"
# PCI device ids of Google's TPU chips (v3 .. TPU7x); other Google PCI devices (gVNIC, NVMe) are not TPUs
_TPU_PCI_DEVICES = frozenset({"0x0027", "0x0056", "0x005e", "0x0062", "0x0063", "0x006f", "0x0076"})
_CUDA_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")


def tpu_present() -> bool:
    """True when this machine shows a TPU: a Google TPU chip on the PCI bus, a /dev/accel* device (TPU v2-v4 VMs) or a
    numbered /dev/vfio group (TPU v5+ VMs). Errs towards True: a false positive only keeps jax's default."""
    for vendor_path in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            vendor = pathlib.Path(vendor_path).read_text().strip()
            if vendor == _GOOGLE_PCI_VENDOR:
                device = (pathlib.Path(vendor_path).parent / "device").read_text().strip()
                if device in _TPU_PCI_DEVICES:
                    return True
        except OSError:
            continue
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"))


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that is missing or broken
        return False


def default_platforms(
    environ: Mapping[str, str], *, libtpu_installed: bool, has_tpu: bool, cuda_plugin_installed: bool
) -> str | None:
    """The JAX_PLATFORMS value to set, or None to leave jax's default: "cpu" only when the user set none, libtpu is
    installed, no TPU is present and no CUDA plugin could claim a GPU."""
    if "JAX_PLATFORMS" in environ or not libtpu_installed or has_tpu or cuda_plugin_installed:
        return None
    return "cpu"


def choose_default_platforms() -> str | None:
    """Set JAX_PLATFORMS for this process as default_platforms() says, unless jax is already imported (then its
    platforms are decided and setting the variable would only mislead). Returns the value set, or None."""
    if "jax" in sys.modules or "JAX_PLATFORMS" in os.environ:
        return None
    libtpu = _installed("libtpu")
    value = default_platforms(
        os.environ,
        libtpu_installed=libtpu,
        has_tpu=libtpu and tpu_present(),
        cuda_plugin_installed=libtpu and any(_installed(m) for m in _CUDA_PLUGINS),
    )
    if value is not None:
        os.environ["JAX_PLATFORMS"] = value
    return value
