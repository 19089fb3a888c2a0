"""The dense KV cache of :func:`rstar2jax.models.forward` (the engine pages its own: ``engine.state``)."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from rstar2jax.models.config import ModelConfig
from rstar2jax.models.sharding import cache_shapes


@flax.struct.dataclass
class KVCache:
    """Per-layer keys ``k`` ``[num_layers, batch, num_kv_heads, max_len, head_dim]`` and values ``v``
    ``[num_layers, batch, num_kv_heads, head_dim, max_len]``.

    ``k[:, b, :, j]`` and ``v[:, b, :, :, j]`` hold the key and value of the token of row ``b`` at position
    ``j``. Entries beyond a row's current length may hold anything: causal-by-position masking never lets a
    valid query see them.

    The layout is what attention reads, so a decode step reads each layer's slice as it lies: kv heads before
    positions, as attention is batched over (row, kv head) (positions first made XLA:CPU transpose every
    layer's whole slice at every step), and each matrix with the dimension its product contracts innermost:
    head_dim for the keys (query . key), positions for the values (probabilities . values); values with
    head_dim innermost made XLA:CPU fall back to a dot several times slower.
    """

    k: jax.Array
    v: jax.Array

    @property
    def batch_size(self) -> int:
        return self.k.shape[1]

    @property
    def max_len(self) -> int:
        return self.k.shape[3]


def init_cache(config: ModelConfig, batch_size: int, max_len: int, dtype=None) -> KVCache:
    """An all-zero :class:`KVCache` (dtype defaults to ``config.compute_dtype``)."""
    k_shape, v_shape = cache_shapes(config, batch_size, max_len)
    dtype = jnp.dtype(dtype or config.compute_dtype)
    return KVCache(k=jnp.zeros(k_shape, dtype), v=jnp.zeros(v_shape, dtype))
