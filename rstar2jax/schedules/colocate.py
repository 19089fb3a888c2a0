"""Colocated rollout and training on the same devices: what sleeps while the other phase runs.

verl, NeMo-RL and Tunix colocate the rollout engine and the trainer on one set of accelerators and hand memory
back and forth between the two phases. Here:

- during rollout the optimizer moments (and a frozen reference policy, if any) wait in host memory
  (``pinned_host``, a JAX memory kind every backend with host offload offers) and come back for the update;
- the engine's KV page pool is freed after rollout and allocated again before the next one (the engine's own
  ``release``/allocation; see ``rstar2jax.engine``);
- one parameter tree serves both phases, so no second copy of the weights stays resident.

Moving a tree between memory kinds keeps every array's shape, dtype and sharding (only the memory kind
changes), so the jitted step sees the same input types from step to step and nothing recompiles.
"""

from __future__ import annotations

from typing import Any

import jax

from rstar2jax.config.vocabulary import OFFLOAD_OPTIONS
from rstar2jax.models.platform import (
    HOST_MEMORY_KIND,
    accelerator,
    host_memory_is_device_memory,
    host_offload_supported,
)


def resolve_offload(option: str, platform: str | None = None) -> bool:
    """Whether the optimizer state waits in host memory during rollout. ``"auto"``: on accelerators (their
    memory is scarce and separate from the host's), not on the CPU backend, where host memory *is* device
    memory and a copy would only cost time (``models.platform`` says which backend is which; ``platform``:
    a JAX platform name, default the default backend's). ``"host"`` / ``"device"`` force it (``"host"``
    fails clearly where the backend has no pinned host memory)."""
    if option == "auto":
        return not host_memory_is_device_memory(platform) and host_offload_supported()
    if option == "host":
        if not host_offload_supported():
            raise ValueError(
                f"host offload requested but {accelerator()} devices offer no '{HOST_MEMORY_KIND}' memory"
            )
        return True
    if option == "device":
        return False
    raise ValueError(f"offload option {option!r}; expected one of {OFFLOAD_OPTIONS}")


def _with_memory_kind(x: Any, kind: str | None):
    if not isinstance(x, jax.Array):
        return x
    sharding = x.sharding
    target = sharding.with_memory_kind(kind or sharding._device_assignment[0].default_memory().kind)
    if x.sharding.memory_kind == target.memory_kind:
        return x
    return jax.device_put(x, target)


def _move(tree: Any, kind: str | None) -> Any:
    # XLA cannot donate across memory kinds: copy, wait, then delete the source buffers so their memory is
    # free when this returns (the caller's old references become deleted arrays).
    moved = jax.tree.map(lambda x: _with_memory_kind(x, kind), tree)
    jax.block_until_ready(moved)
    for old, new in zip(jax.tree.leaves(tree), jax.tree.leaves(moved), strict=True):
        if isinstance(old, jax.Array) and old is not new:
            old.delete()
    return moved


def to_host(tree: Any) -> Any:
    """``tree`` with every array moved to pinned host memory (same shapes, dtypes and shardings); the device
    buffers are deleted, so their memory is free once this returns."""
    return _move(tree, HOST_MEMORY_KIND)


def to_device(tree: Any) -> Any:
    """``tree`` with every array back in its device's default memory (the inverse of ``to_host``)."""
    return _move(tree, None)


def memory_kinds(tree: Any) -> set[str]:
    """The memory kinds the arrays of ``tree`` live in (for checks and tests)."""
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)}
