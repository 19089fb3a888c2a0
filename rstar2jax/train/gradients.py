"""What every training step shares: the per-position log-probs of a batch, micro-batched gradient
accumulation with a whole-batch normaliser, LoRA adapters bound to a loss, and the optimizer update.

A step's batch is split into ``num_microbatches`` strided micro-batches (rows m, m+M, m+2M, ...: each data
shard keeps its own rows) and ``lax.scan`` sums their gradients. Each micro-batch loss is divided by a
normaliser computed over the *whole* batch first, so the summed gradient is the full-batch gradient exactly
(not a mean of per-micro-batch means, verl issue #5625).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from rstar2jax import algo, models
from rstar2jax.data.batch import Batch
from rstar2jax.train.state import TrainState

# loss_fn(params, micro_batch, normalizer) -> (loss, sums): both add up over micro-batches.
LossFn = Callable[[Any, Batch, jax.Array], tuple[jax.Array, dict[str, jax.Array]]]


def masked_sum(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Σ mask·x with masked-out positions dropped before the product (a NaN / Inf there stays out)."""
    return jnp.sum(algo.masked_values(x, mask) * mask)


def logprobs_and_entropy(params, model_config, batch: Batch, temperature: float = 1.0):
    """Per-position log π(target) and the policy's entropy (float32 ``[rows, seq_len]`` each), from the final
    hidden states by vocabulary chunks (``models.sequence_logprobs``: no ``[rows, seq_len, vocab]`` array)."""
    return models.sequence_logprobs(
        params,
        model_config,
        batch.tokens,
        batch.targets,
        positions=batch.positions,
        segment_ids=batch.segment_ids,
        temperature=temperature,
    )


def _strided_microbatches(batch: Batch, num_microbatches: int) -> Batch:
    """``[rows, ...]`` -> ``[M, rows / M, ...]``, micro-batch m = rows m, m+M, ... (shard-local rows)."""

    def split(x):
        return x.reshape(x.shape[0] // num_microbatches, num_microbatches, *x.shape[1:]).swapaxes(0, 1)

    return jax.tree.map(split, batch)


def accumulate_gradients(
    loss_fn: LossFn, params, batch: Batch, normalizer: jax.Array, num_microbatches: int, *, rng=None
):
    """Σ over micro-batches of (loss, sums, ∇loss): equals the full-batch values when ``loss_fn`` is additive.

    ``rng``: a key for a random loss (LoRA dropout): micro-batch m calls ``loss_fn(..., rng=fold_in(rng,
    m))``.
    Returns ``(loss, sums, grads)``; the gradient accumulator stays in the parameters' dtype and placement.
    """
    rows = batch.tokens.shape[0]
    if num_microbatches < 1 or rows % num_microbatches:
        raise ValueError(
            f"batch rows ({rows}) must be a positive multiple of num_microbatches ({num_microbatches})"
        )
    value_and_grad = jax.value_and_grad(loss_fn, has_aux=True)

    def grad_fn(params, micro_batch, index):
        extra = {} if rng is None else {"rng": jax.random.fold_in(rng, index)}
        return value_and_grad(params, micro_batch, normalizer, **extra)

    if num_microbatches == 1:
        (loss, sums), grads = grad_fn(params, batch, 0)
        return loss, sums, grads

    micro = _strided_microbatches(batch, num_microbatches)
    first = jax.tree.map(lambda x: x[0], micro)
    (loss_shape, sums_shape), _ = jax.eval_shape(grad_fn, params, first, 0)

    def body(carry, inputs):
        loss, sums, grads = carry
        (l_m, s_m), g_m = grad_fn(params, *inputs)
        return (loss + l_m, jax.tree.map(jnp.add, sums, s_m), jax.tree.map(jnp.add, grads, g_m)), None

    zeros = (
        jnp.zeros(loss_shape.shape, loss_shape.dtype),
        jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), sums_shape),
        jax.tree.map(jnp.zeros_like, params),
    )
    (loss, sums, grads), _ = jax.lax.scan(body, zeros, (micro, jnp.arange(num_microbatches)))
    return loss, sums, grads


def with_adapters(loss_fn: LossFn, base, lora: models.LoraConfig) -> LossFn:
    """``loss_fn`` of a full params tree turned into one of LoRA adapters: the forward runs the frozen
    ``base`` with the adapters attached (``models.lora.attach``), so only the adapters get a gradient;
    an ``rng`` keyword (from ``accumulate_gradients``) becomes the adapters' dropout key."""

    def adapted(adapters, batch, normalizer, rng=None):
        return loss_fn(models.lora.attach(base, adapters, lora, dropout_key=rng), batch, normalizer)

    return adapted


def apply_update(state: TrainState, grads, optimizer: optax.GradientTransformation):
    """One optimizer update of ``state`` by the summed ``grads``; the step counter advances."""
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    return state.replace(params=params, opt_state=opt_state, step=state.step + 1)
