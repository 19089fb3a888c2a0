"""Logical-axis sharding: one rule table maps the logical axis names of parameters and activations onto the
mesh axes ``data`` (pure data parallel), ``fsdp`` (data parallel with sharded weights) and ``tensor``
(Megatron-style tensor parallel). FSDP, TP or both follow from the mesh shape alone."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rstar2jax.models.config import ModelConfig
from rstar2jax.models.params import is_param_spec, param_specs

#: The device mesh's axes: data parallel, fully sharded data parallel, tensor parallel.
MESH_AXES = ("data", "fsdp", "tensor")

#: logical axis -> mesh axis (or tuple of mesh axes, or None for replicated).
LOGICAL_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("batch", ("data", "fsdp")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("mlp", "tensor"),
    ("layers", None),
    ("head_dim", None),
    ("norm", None),
    ("length", None),
    ("cache_length", None),
    # The residual stream between layers: whole on each device of a batch shard (FSDP gathers weights).
    ("activation_embed", None),
)

#: Logical axes of ``KVCache.k`` (``KVCache`` says why ``v``'s differ).
CACHE_LOGICAL_AXES = ("layers", "batch", "kv_heads", "cache_length", "head_dim")
#: Logical axes of ``KVCache.v``.
CACHE_VALUE_LOGICAL_AXES = ("layers", "batch", "kv_heads", "head_dim", "cache_length")


def make_mesh(
    data: int = 1, fsdp: int = 1, tensor: int = 1, devices: Sequence[jax.Device] | None = None
) -> Mesh:
    """A ``data x fsdp x tensor`` mesh on the first ``data*fsdp*tensor`` of ``devices`` (default: all)."""
    size = data * fsdp * tensor
    devices = list(jax.devices() if devices is None else devices)
    if size > len(devices):
        raise ValueError(
            f"mesh data={data} x fsdp={fsdp} x tensor={tensor} needs {size} devices, "
            f"only {len(devices)} available"
        )
    return jax.make_mesh(
        (data, fsdp, tensor), MESH_AXES, devices=devices[:size], axis_types=(jax.sharding.AxisType.Auto,) * 3
    )


def logical_to_spec(
    logical_axes: Sequence[str | None],
    mesh: Mesh,
    shape: Sequence[int] | None = None,
    rules=LOGICAL_RULES,
) -> PartitionSpec:
    """PartitionSpec for an array whose dimensions carry ``logical_axes``.

    Mesh axes missing from ``mesh`` or already used by an earlier dimension are skipped; with ``shape``, a
    dimension its mesh axes do not divide evenly stays replicated (e.g. 2 kv heads on a 4-way tensor axis).
    """
    table = dict(rules)
    used: set[str] = set()
    spec = []
    for dim, name in enumerate(logical_axes):
        if name is not None and name not in table:
            raise ValueError(f"logical axis {name!r} has no rule; known: {sorted(table)}")
        target = table.get(name) if name is not None else None
        axes = (target,) if isinstance(target, str) else tuple(target or ())
        axes = tuple(a for a in axes if a in mesh.shape and mesh.shape[a] > 1 and a not in used)
        if shape is not None and shape[dim] % math.prod(mesh.shape[a] for a in axes):
            axes = ()
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    return PartitionSpec(*spec)


def logical_sharding(logical_axes, mesh: Mesh, shape=None, rules=LOGICAL_RULES) -> NamedSharding:
    """:func:`logical_to_spec` as a ``NamedSharding`` on ``mesh``."""
    return NamedSharding(mesh, logical_to_spec(logical_axes, mesh, shape, rules))


def constrain(x: jax.Array, logical_axes: Sequence[str | None], rules=LOGICAL_RULES) -> jax.Array:
    """Pin an activation's sharding to ``logical_axes`` when traced under ``jax.set_mesh(mesh)``; otherwise
    return it unchanged.

    Without these hints GSPMD may meet FSDP-sharded weights by replicating the batch and all-reducing
    activations; with them, activations stay batch-sharded and the weights are all-gathered instead.
    """
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return x
    return jax.lax.with_sharding_constraint(x, logical_to_spec(logical_axes, mesh, x.shape, rules))


def param_shardings(config: ModelConfig, mesh: Mesh, rules=LOGICAL_RULES) -> dict:
    """Pytree of ``NamedSharding`` with the structure of the params of ``config``."""
    return jax.tree.map(
        lambda spec: logical_sharding(spec.axes, mesh, spec.shape, rules),
        param_specs(config),
        is_leaf=is_param_spec,
    )


def shard_params(params: dict, config: ModelConfig, mesh: Mesh, rules=LOGICAL_RULES) -> dict:
    """``params`` moved into their :func:`param_shardings` placement."""
    return jax.device_put(params, param_shardings(config, mesh, rules))


def cache_shapes(config: ModelConfig, batch_size: int, max_len: int) -> tuple[tuple[int, ...], ...]:
    """Shapes of ``KVCache.k`` and ``KVCache.v``: their logical axes (:data:`CACHE_LOGICAL_AXES`,
    :data:`CACHE_VALUE_LOGICAL_AXES`) define the layout."""
    sizes = dict(layers=config.num_layers, batch=batch_size, kv_heads=config.num_kv_heads,
                 cache_length=max_len, head_dim=config.head_dim)
    return tuple(tuple(sizes[a] for a in axes) for axes in (CACHE_LOGICAL_AXES, CACHE_VALUE_LOGICAL_AXES))


def cache_sharding(
    config: ModelConfig, mesh: Mesh, batch_size: int, max_len: int, rules=LOGICAL_RULES
) -> tuple[NamedSharding, NamedSharding]:
    """Shardings of ``KVCache.k`` and ``KVCache.v`` (batch over data x fsdp, kv heads over tensor):
    ``jax.device_put(cache, KVCache(*cache_sharding(...)))`` places a cache."""
    k_shape, v_shape = cache_shapes(config, batch_size, max_len)
    return (logical_sharding(CACHE_LOGICAL_AXES, mesh, k_shape, rules),
            logical_sharding(CACHE_VALUE_LOGICAL_AXES, mesh, v_shape, rules))


def batch_sharding(mesh: Mesh, shape: Sequence[int], rules=LOGICAL_RULES) -> NamedSharding:
    """Sharding of a ``[batch, length, ...]`` input such as tokens, positions or segment ids."""
    return logical_sharding(("batch", "length") + (None,) * (len(shape) - 2), mesh, shape, rules)
