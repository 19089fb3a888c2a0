"""What every process of a multi-host run exchanges: rollouts gathered to all processes, the batch placed.

Every process calls the RL iteration; each rolls out its own slice of the problems, and the trajectories are
gathered to all processes before selection, so all of them build the same global batch.
"""

from __future__ import annotations

import pickle
from typing import Any

import jax
import numpy as np

from rstar2jax.data.batch import Batch


def gather_to_all_processes(items: list[Any]) -> list[Any]:
    """Concatenation, in process order, of every process's ``items`` (pickled through a uint8 all-gather)."""
    from jax.experimental import multihost_utils

    payload = np.frombuffer(pickle.dumps(items), np.uint8)
    sizes = multihost_utils.process_allgather(np.array([payload.size]))
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: payload.size] = payload
    gathered = multihost_utils.process_allgather(padded)
    return [
        item
        for row, size in zip(gathered, sizes.reshape(-1), strict=True)
        for item in pickle.loads(row[:size].tobytes())
    ]


def put_batch(batch: Batch, sharding: jax.sharding.Sharding | None) -> Batch:
    """The host batch as global device arrays; every process holds the whole batch and places its shards."""
    if sharding is None:
        return jax.device_put(batch)
    return jax.tree.map(
        lambda x: jax.make_array_from_callback(x.shape, sharding, lambda index: x[index]), batch
    )

