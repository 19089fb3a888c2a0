"""Pass@k estimators over a ``[num_problems, num_samples]`` correctness matrix (pure ``jnp``, jit-able)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _check_correct(correct) -> jax.Array:
    """``correct`` as a bool ``[num_problems, num_samples]`` array (nonzero = correct)."""
    try:
        correct = jnp.asarray(correct)
    except TypeError as e:
        raise TypeError(f"correct must be a bool or numeric 0/1 array ({e})") from e
    if correct.ndim != 2 or correct.shape[0] == 0 or correct.shape[1] == 0:
        raise ValueError(
            f"correct must have shape [num_problems, num_samples] with both > 0, got {correct.shape}"
        )
    if not (correct.dtype == jnp.bool_ or jnp.issubdtype(correct.dtype, jnp.number)):
        raise TypeError(f"correct must be a bool or numeric 0/1 array, got dtype {correct.dtype}")
    return correct != 0


def pass_at_1(correct) -> jax.Array:
    """Average pass@1 over k samples per problem (the paper's metric, k = 16 at temperature 0.6).

    .. math:: \\mathrm{pass@1} = \\frac{1}{P}\\sum_{p=1}^{P} \\frac{c_p}{n}

    Args:
      correct: ``[num_problems, n]`` bool (or 0/1) array, one row per problem, one column per sample.

    Returns:
      A float32 scalar (``float(...)`` it outside jit).
    """
    return jnp.mean(_check_correct(correct).astype(jnp.float32))


def pass_at_k(correct, k: int) -> jax.Array:
    """Unbiased pass@k (Chen et al., 2021), averaged over problems.

    With ``n`` samples of which ``c`` are correct, the chance that ``k`` of them drawn without replacement
    contain a correct one is

    .. math:: 1 - \\binom{n-c}{k} \\Big/ \\binom{n}{k} = 1 - \\prod_{i=n-c+1}^{n} \\Big(1 - \\frac{k}{i}\\Big)

    (the product form avoids huge binomials; it is exactly 1 when ``n - c < k``).

    Args:
      correct: ``[num_problems, n]`` bool (or 0/1) array.
      k: samples per attempt, ``1 <= k <= n`` (a static Python int).

    Returns:
      A float32 scalar: the mean of the per-problem estimates.
    """
    correct = _check_correct(correct)
    n = correct.shape[1]
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= n:
        raise ValueError(f"k must be an int in [1, num_samples={n}], got {k!r}")
    num_correct = correct.sum(axis=1)
    i = jnp.arange(1, n + 1, dtype=jnp.float32)
    factors = jnp.where(i[None, :] > (n - num_correct)[:, None], 1.0 - k / i[None, :], 1.0)
    return jnp.mean(1.0 - jnp.prod(factors, axis=1))
