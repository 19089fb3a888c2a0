"""The SFT step: masked cross-entropy over a packed batch (mean NLL per assistant token), micro-batched, one
optimizer update; LoRA runs train the adapters on the frozen base."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from rstar2jax import models
from rstar2jax.data.batch import Batch
from rstar2jax.train.gradients import (
    accumulate_gradients,
    apply_update,
    logprobs_and_entropy,
    masked_sum,
    with_adapters,
)
from rstar2jax.train.state import TrainState
from rstar2jax.train.step_jit import jit_bound_step


def sft_loss(params, batch: Batch, normalizer: jax.Array, *, model_config) -> tuple[jax.Array, dict]:
    """Masked cross-entropy: loss = −Σ mask·log π(target) / normalizer (the batch's loss tokens)."""
    logp, _ = logprobs_and_entropy(params, model_config, batch)
    return -masked_sum(logp, batch.loss_mask) / normalizer, {}


def sft_step(
    state: TrainState, batch: Batch, base=None, *, model_config, optimizer, num_microbatches: int = 1,
    lora: models.LoraConfig | None = None,
):
    """One SFT update on a packed batch; metrics: loss (mean NLL per assistant token), grad norm, tokens.

    LoRA (``lora`` given): ``state.params`` are the adapters, ``base`` the frozen base parameters; with
    ``lora.dropout`` > 0 the dropout key of step s is ``fold_in(state.rng, s)`` (a resumed run draws the same
    masks)."""
    tokens = jnp.sum(batch.loss_mask)
    loss_fn = functools.partial(sft_loss, model_config=model_config)
    rng = None
    if lora is not None:
        loss_fn = with_adapters(loss_fn, base, lora)
        rng = jax.random.fold_in(state.rng, state.step) if lora.dropout else None
    loss, _, grads = accumulate_gradients(
        loss_fn, state.params, batch, jnp.maximum(tokens, 1.0), num_microbatches, rng=rng
    )
    metrics = {"loss": loss, "grad_norm": optax.global_norm(grads), "tokens": tokens}
    return apply_update(state, grads, optimizer), metrics


def make_sft_step(
    model_config,
    optimizer,
    *,
    num_microbatches: int = 1,
    mesh: Mesh | None = None,
    shardings: TrainState | None = None,
    compiler_options: dict | None = None,
    lora: models.LoraConfig | None = None,
):
    """``sft_step`` bound to its options and jitted: ``step(state, batch) -> (state, metrics)``; with
    ``lora``, ``step(state, batch, base)`` (see ``sft_step``)."""
    step = functools.partial(
        sft_step, model_config=model_config, optimizer=optimizer, num_microbatches=num_microbatches, lora=lora
    )
    return jit_bound_step(step, model_config, lora, mesh=mesh, shardings=shardings,
                          compiler_options=compiler_options)
