"""Which accelerator JAX runs on: the one place that tells an NVIDIA GPU from an AMD one.

Every ``"auto"`` choice of an implementation (training attention, paged decode attention) asks
:func:`accelerator` rather than looking at ``jax.devices()`` itself, so the two can never disagree about the
machine. JAX names both CUDA and ROCm devices ``platform == "gpu"``; the client's platform version (and the
device kind) say which vendor's runtime it is.
"""

from __future__ import annotations

import jax

ACCELERATORS = ("cuda", "rocm", "tpu", "cpu")


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
