"""Which accelerator JAX runs on: the one place that tells an NVIDIA GPU from an AMD one, and every other
backend check of the library: ``"auto"`` choices of an implementation (training and decode attention,
``models.attention.resolve_attention``), whether Pallas kernels are interpreted, whether the engine unrolls
a small model's layers, whether colocated training parks its optimizer state in host memory. They ask
:func:`accelerator` (or feature-detect) rather than looking at ``jax.devices()`` themselves, so no two can
disagree about the machine. JAX names both CUDA and ROCm devices ``platform == "gpu"``; the client's
platform version (and the device kind) say which vendor's runtime it is.

FP8 support is found by feature, never by device name: :func:`float8_supported` (the backend stores and
converts float8_e4m3fn) and :func:`fp8_matmul_native` (its compiled float8 dots stay float8), each probed once
per backend and device kind.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp

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


def pallas_interpreted(device: jax.Device | None = None) -> bool:
    """Whether Pallas kernels run in Pallas' interpreter on ``device``: everywhere but on a CUDA or ROCm GPU,
    where they are lowered through Triton (the CPU tests run every kernel this way)."""
    return accelerator(device) not in ("cuda", "rocm")


def copies_scanned_weight_slices(device: jax.Device | None = None) -> bool:
    """Whether the backend copies every weight slice a ``lax.scan`` over stacked layers feeds to a dot, every
    layer of every step: XLA:CPU does (GPUs slice without copying), so there a small model's decode runs
    faster with its layers unrolled (``EngineConfig.unstacked_decode``)."""
    return accelerator(device) == "cpu"


#: The JAX memory kind of pinned host memory, where colocated training parks its optimizer state.
HOST_MEMORY_KIND = "pinned_host"


def host_offload_supported(device: jax.Device | None = None) -> bool:
    """Whether ``device`` (default: the first default-backend device) can hold arrays in pinned host memory
    (feature detection: the memory kinds it offers)."""
    device = device or jax.devices()[0]
    try:
        kinds = {memory.kind for memory in device.addressable_memories()}
    except (AttributeError, NotImplementedError, jax.errors.JaxRuntimeError):
        return False
    return HOST_MEMORY_KIND in kinds


def host_memory_is_device_memory(platform: str | None = None) -> bool:
    """Whether the device's memory is the host's (the CPU backend; ``platform``: a JAX platform name, default
    the default backend's): there parking arrays in pinned host memory would only cost a copy."""
    return (platform or accelerator()) == "cpu"


def _backend_key(device: jax.Device | None) -> tuple[str, str]:
    device = device or jax.devices()[0]
    return device.platform, device.device_kind


@functools.cache
def _float8_round_trip(key: tuple[str, str]) -> bool:
    del key  # the cache key: one probe per backend and device kind
    dtype = getattr(jnp, "float8_e4m3fn", None)
    if dtype is None:
        return False
    try:
        sample = jnp.asarray([1.0, -448.0, 0.5, 0.0], jnp.float32)
        back = jax.jit(lambda x: x.astype(dtype).astype(jnp.float32))(sample)
        return bool(jnp.all(back == sample))
    except Exception:  # noqa: BLE001 - any failure to compile or run it means "not supported"
        return False


def float8_supported(device: jax.Device | None = None) -> bool:
    """Whether JAX has ``float8_e4m3fn`` and ``device`` (default: the first device) converts to and from it:
    a float32 -> float8 -> float32 round trip, compiled and run once per backend and device kind."""
    return _float8_round_trip(_backend_key(device))


_OPERAND_LIST = re.compile(r"\b(?:dot|custom-call)\(([^)]*)\)")
_DEFINITION = re.compile(r"%([\w.\-]+) = (\w+)\[")


def consumes_float8(hlo_text: str) -> bool:
    """Whether a matmul of a compiled HLO module (a ``dot`` or a ``custom-call``, e.g. cuBLASLt's) takes a
    float8 operand as it is, rather than one converted to a wider type first."""
    types = dict(_DEFINITION.findall(hlo_text))
    for operands in _OPERAND_LIST.findall(hlo_text):
        if any(types.get(name, "").startswith("f8") for name in re.findall(r"%([\w.\-]+)", operands)):
            return True
    return False


@functools.cache
def _native_fp8_dot(key: tuple[str, str]) -> bool:
    del key
    if not _float8_round_trip(_backend_key(None)):
        return False
    operand = jax.ShapeDtypeStruct((2, 32, 32), jnp.float8_e4m3fn)
    # The pattern of quantization.matmul's native path: a float8 dot batched over groups, float32 out.
    dot = lambda a, b: jax.lax.dot_general(a, b, (((2,), (1,)), ((0,), (0,))),
                                           preferred_element_type=jnp.float32)
    try:
        return consumes_float8(jax.jit(dot).lower(operand, operand).compile().as_text())
    except Exception:  # noqa: BLE001 - a backend that cannot compile it has no native FP8 matmul
        return False


def fp8_matmul_native() -> bool:
    """Whether the default backend multiplies float8 matrices natively (FP8 tensor cores: H100/H200, MI300):
    a tiny batched float8 dot is compiled once per backend and device kind and its optimized HLO read; it is
    native when a matmul consumes the float8 operands (XLA:CPU converts them to float32 first)."""
    return _native_fp8_dot(_backend_key(None))
