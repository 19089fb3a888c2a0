"""Where the asynchronous producer's engines run and how the trainer's weights reach them (``rl.placement``).

* ``"colocated"``: one set of devices. The trainer's mesh takes every device; the engine runs on the first
  device of each process and keeps its own copy of the weights in the inference (compute) dtype, made after
  every update: the trainer donates its parameters to the next update, so the engine never holds the
  trainer's buffers.
* ``"split"``: each process sets its last ``rl.rollout_devices`` local devices apart for the rollout (one
  engine per device) and the train mesh (``config.mesh``) takes the other devices of all processes. After
  each update the new weights are copied device to device into each engine's layout while it decodes; under
  ``jax.distributed`` the train mesh's shards are first gathered into a full replica on every process's
  train devices (an all-gather on the mesh), then copied to that process's rollout devices.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from rstar2jax.config.options import RunOptions


def _split(options: RunOptions | None) -> int:
    """Rollout devices each process sets apart (0: colocated, or not an asynchronous RL run)."""
    rl = None if options is None else options.rl
    return rl.rollout_devices if rl is not None and rl.placement == "split" else 0


def local_devices_needed(options: RunOptions, num_processes: int | None = None) -> int:
    """Devices each process needs: its share of the train mesh plus, split, its rollout devices.
    ``num_processes``: the run's processes (default ``distributed.num_processes``; None there, the count the
    cluster's environment said, else one)."""
    processes = num_processes or options.distributed.num_processes or 1
    return -(-options.mesh.size // processes) + _split(options)


def rollout_devices(options: RunOptions | None, devices: Sequence[jax.Device] | None = None) -> list:
    """This process's rollout devices: split, its last ``rl.rollout_devices`` local devices; colocated, its
    first local device. ``devices``: all devices (default ``jax.devices()``)."""
    devices = list(jax.devices() if devices is None else devices)
    local = sorted((d for d in devices if d.process_index == jax.process_index()), key=lambda d: d.id)
    count = _split(options)
    return local[-count:] if count else local[:1]


def train_devices(options: RunOptions | None, devices: Sequence[jax.Device] | None = None) -> list:
    """The devices the train mesh may take: all of them, but split, every process's rollout devices."""
    devices = list(jax.devices() if devices is None else devices)
    count = _split(options)
    if not count:
        return devices
    apart = set()
    for process in {d.process_index for d in devices}:
        local = sorted((d for d in devices if d.process_index == process), key=lambda d: d.id)
        apart.update(local[-count:])
    return [d for d in devices if d not in apart]


def _local_replica(params):
    """``params`` as arrays whose every device holds the whole value: under several processes the train
    mesh's shards are all-gathered on the mesh (device to device) and each process takes its local replica."""
    leaves = jax.tree.leaves(params)
    if all(leaf.is_fully_addressable for leaf in leaves):
        return params
    replicated = jax.tree.map(lambda x: NamedSharding(x.sharding.mesh, PartitionSpec()), params)
    gathered = jax.jit(lambda tree: tree, out_shardings=replicated)(params)
    return jax.tree.map(lambda x: x.addressable_shards[0].data, gathered)


def engine_copy(params, device: jax.Device, dtype=None):
    """A copy of the trainer's ``params`` on ``device`` in fresh buffers, its floating leaves cast to
    ``dtype`` (the engine's compute dtype; None: kept): the engine's own weights, which the trainer's next
    update (donating its parameters) cannot touch. Dispatched asynchronously (device to device)."""
    def copy(x):
        placed = jax.device_put(x, device)
        if dtype is not None and jnp.issubdtype(placed.dtype, jnp.floating) and placed.dtype != dtype:
            return placed.astype(dtype)
        if placed is x or x.devices() == {device}:  # already there: device_put kept the buffer
            return jnp.copy(placed)
        return placed

    local = _local_replica(params)
    with jax.default_device(device):
        return jax.tree.map(copy, local)
