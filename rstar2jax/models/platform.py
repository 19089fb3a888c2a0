"""Which accelerator JAX runs on: the one place that tells an NVIDIA GPU from an AMD one.

Every ``"auto"`` choice of an implementation (training attention, paged decode attention) asks
:func:`accelerator` rather than looking at ``jax.devices()`` itself, so the two can never disagree about the
machine. JAX names both CUDA and ROCm devices ``platform == "gpu"``; the client's platform version (and the
device kind) say which vendor's runtime it is.
"""

from __future__ import annotations

import re

import jax

ACCELERATORS = ("cuda", "rocm", "tpu", "cpu")
# The JAX versions the library supports: 0.10.2 (this project's CPU pin) through 0.11.x (GPU images that come
# with their own JAX and plugin). setup.py declares the same range; APIs that moved between them are
# feature-detected where used.
SUPPORTED_JAX = (">=0.10.2", "<0.12")


def _version_key(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def jax_version_supported(version: str = jax.__version__) -> bool:
    """Whether ``version`` (default: the installed JAX) lies in ``SUPPORTED_JAX``."""
    low, high = (_version_key(bound) for bound in SUPPORTED_JAX)
    return low <= _version_key(version) < high


def accelerator(device: jax.Device | None = None) -> str:
    """``"cuda"`` (NVIDIA GPU), ``"rocm"`` (AMD GPU), ``"tpu"`` or ``"cpu"`` for ``device`` (default: the
    first device of the default backend)."""
    device = device or jax.devices()[0]
    if device.platform in ("cuda", "rocm", "tpu", "cpu"):
        return device.platform
    if device.platform == "gpu":
        version = getattr(device.client, "platform_version", "").lower()
        kind = device.device_kind.lower()
        if "rocm" in version or "hip" in version or "amd" in kind or "instinct" in kind:
            return "rocm"
        return "cuda"
    return device.platform
