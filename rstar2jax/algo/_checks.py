"""Argument checks shared by the algorithm functions.

They look only at static properties (rank, shape, dtype, option names), so they run at trace time and cost
nothing under jit; the messages name the argument and what was expected.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np


def as_array(name: str, x) -> jax.Array:
    """``x`` as an array (Python scalars and NumPy arrays are accepted)."""
    try:
        return jnp.asarray(x)
    except TypeError as err:
        raise TypeError(f"{name} must be an array, got {type(x).__name__}") from err


def check_rank(name: str, x: jax.Array, ranks: int | Iterable[int]) -> None:
    allowed = (ranks,) if isinstance(ranks, int) else tuple(ranks)
    if x.ndim not in allowed:
        want = " or ".join(str(r) for r in allowed)
        raise ValueError(f"{name} must have rank {want}, got shape {x.shape}")


def check_shape(name: str, x: jax.Array, shape: Sequence[int], like: str) -> None:
    if tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have the shape of {like} {tuple(shape)}, got {x.shape}")


def check_floating(name: str, x: jax.Array) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating-point array (float32 or bfloat16), got dtype {x.dtype}")


def check_real(name: str, x: jax.Array) -> None:
    """Integer or floating point, not bool or complex (counts and rewards)."""
    if x.dtype == jnp.bool_ or not (
        jnp.issubdtype(x.dtype, jnp.integer) or jnp.issubdtype(x.dtype, jnp.floating)
    ):
        raise TypeError(f"{name} must be an integer or floating-point array, got dtype {x.dtype}")


def check_mask(name: str, x: jax.Array) -> None:
    """A mask is bool, or numeric with 0/1 values."""
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        raise TypeError(f"{name} must be a bool or 0/1 numeric mask, got dtype {x.dtype}")


def check_option(name: str, value: str, options: Iterable[str]) -> None:
    options = tuple(options)
    if value not in options:
        raise ValueError(f"unknown {name} {value!r}; expected one of {', '.join(repr(o) for o in options)}")


def compute_dtype(dtype) -> jnp.dtype:
    """The dtype to compute in: at least float32, so bfloat16 inputs keep float32 precision internally."""
    return jnp.promote_types(dtype, jnp.float32) if jnp.issubdtype(dtype, jnp.floating) else jnp.dtype(
        jnp.float32
    )


def concrete_value(x):
    """``x`` as a NumPy value if it is known at trace time, else None (a traced hyper-parameter)."""
    if isinstance(x, jax.core.Tracer):
        return None
    try:
        return np.asarray(x)
    except (TypeError, jax.errors.ConcretizationTypeError):
        return None


def masked(x: jax.Array, mask: jax.Array) -> jax.Array:
    """``x`` with masked-out positions (``mask == 0``) replaced by 0 before any arithmetic: a NaN or Inf there
    cannot reach a value computed from the result, and ``where``'s gradient there is exactly 0."""
    return jnp.where(mask != 0, x, jnp.zeros((), x.dtype))
