"""Gradients and updates: micro-batches summed into one gradient, and a step's several optimizer updates per
batch (an RL step's ``rl.ppo_epochs`` passes over its ``rl.mini_batches`` mini-batches).

Every split is strided (part m = rows m, m+M, m+2M, ...: each data shard keeps its own rows). Each part's loss
is divided by a normaliser computed over the *whole* batch first, so the summed micro-batch gradient is the
full-batch gradient exactly (not a mean of per-micro-batch means, verl issue #5625), and a mini-batch's loss
is its share of the whole batch's token mean (the mini-batch losses of an epoch add up to it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from rstar2jax import models
from rstar2jax.data.batch import Batch
from rstar2jax.train.state import TrainState

# loss_fn(params, micro_batch, normalizer) -> (loss, sums): both add up over micro-batches.
LossFn = Callable[[Any, Any, jax.Array], tuple[jax.Array, dict[str, jax.Array]]]


def _rows(tree) -> int:
    return jax.tree.leaves(tree)[0].shape[0]


def strided_split(tree, parts: int):
    """Every ``[rows, ...]`` leaf -> ``[parts, rows / parts, ...]``, part m = rows m, m+M, ... (each data
    shard keeps its own rows)."""

    def split(x):
        return x.reshape(x.shape[0] // parts, parts, *x.shape[1:]).swapaxes(0, 1)

    return jax.tree.map(split, tree)


def strided_merge(tree):
    """The inverse of :func:`strided_split`: ``[parts, rows / parts, ...]`` -> ``[rows, ...]``."""
    return jax.tree.map(lambda x: x.swapaxes(0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:]), tree)


def accumulate_gradients(
    loss_fn: LossFn, params, batch: Batch, normalizer: jax.Array, num_microbatches: int, *, rng=None
):
    """Σ over micro-batches of (loss, sums, ∇loss): equals the full-batch values when ``loss_fn`` is additive.

    ``rng``: a key for a random loss (LoRA dropout): micro-batch m calls ``loss_fn(..., rng=fold_in(rng,
    m))``.
    Returns ``(loss, sums, grads)``; the gradient accumulator stays in the parameters' dtype and placement.
    """
    rows = _rows(batch)
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

    micro = strided_split(batch, num_microbatches)
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


def with_adapters(loss_fn: LossFn, base, lora: models.LoraConfig, *,
                  merge_in_forward: bool = False) -> LossFn:
    """``loss_fn`` of a full params tree turned into one of LoRA adapters: the forward runs the frozen
    ``base`` with the adapters attached (``models.lora.attach``; ``merge_in_forward`` for exact numerics),
    so only the adapters get a gradient; an ``rng`` keyword (from ``accumulate_gradients``) becomes the
    adapters' dropout key."""

    def adapted(adapters, batch, normalizer, rng=None):
        policy = models.lora.attach(base, adapters, lora, dropout_key=rng, merge_in_forward=merge_in_forward)
        return loss_fn(policy, batch, normalizer)

    return adapted


def _optimizer_update(params, opt_state, grads, optimizer: optax.GradientTransformation):
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state


def apply_update(state: TrainState, grads, optimizer: optax.GradientTransformation) -> TrainState:
    """One optimizer update of ``state`` by ``grads``; the step counter advances by one."""
    params, opt_state = _optimizer_update(state.params, state.opt_state, grads, optimizer)
    return state.replace(params=params, opt_state=opt_state, step=state.step + 1)


def several_updates(state: TrainState, inputs, loss_fn: LossFn, normalizer: jax.Array, *, optimizer,
                    num_microbatches: int, ppo_epochs: int, mini_batches: int):
    """``ppo_epochs`` passes over the ``mini_batches`` strided mini-batches of ``inputs`` (a pytree of
    ``[rows, ...]`` leaves), in order, one optimizer update per mini-batch (micro-batched as
    :func:`accumulate_gradients`; ``lax.scan``: compiled once). Every mini-batch's loss is divided by the
    whole batch's ``normalizer``; the optimizer (and its learning-rate schedule) counts the updates, the
    state's step advances by one.

    Returns ``(state, loss, sums, grad_norm)``: loss and sums added over each epoch's mini-batches and
    averaged over the epochs, grad_norm the mean over the updates (non-finite when any update's is)."""
    rows = _rows(inputs)
    if mini_batches < 1 or ppo_epochs < 1 or rows % (mini_batches * num_microbatches):
        raise ValueError(f"batch rows ({rows}) must be a multiple of mini_batches x num_microbatches "
                         f"({mini_batches} x {num_microbatches}), ppo_epochs ({ppo_epochs}) positive")
    minis = strided_split(inputs, mini_batches)

    def update(carry, index):
        params, opt_state = carry
        mini = jax.tree.map(lambda x: x[index], minis)
        loss, sums, grads = accumulate_gradients(loss_fn, params, mini, normalizer, num_microbatches)
        return _optimizer_update(params, opt_state, grads, optimizer), (loss, sums, optax.global_norm(grads))

    order = jnp.tile(jnp.arange(mini_batches), ppo_epochs)
    (params, opt_state), (losses, sums, norms) = jax.lax.scan(update, (state.params, state.opt_state), order)
    state = state.replace(params=params, opt_state=opt_state, step=state.step + 1)
    per_epoch = jax.tree.map(lambda x: jnp.sum(x, axis=0) / ppo_epochs, (losses, sums))
    return state, *per_epoch, jnp.mean(norms)
