"""SFT and RL (GRPO-RoC) training steps: micro-batched gradients, a whole-batch normaliser, one AdamW update.

A step is ``step(state, batch) -> (state, metrics)``. The batch is split into ``num_microbatches`` strided
micro-batches (rows m, m+M, m+2M, ...: each data shard keeps its own rows) and ``lax.scan`` sums their
gradients. Each micro-batch loss is divided by a normaliser computed over the *whole* batch first, so the
summed gradient is the full-batch gradient exactly (not a mean of per-micro-batch means, verl issue #5625).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rstar2jax import algo, models
from rstar2jax.data.batch import Batch
from rstar2jax.train.state import TrainState

OLD_LOGPROB_SOURCES = ("sampler", "recompute")
# policy_loss metrics already divided by the normaliser (additive over micro-batches, unlike its token means).
_NORMALISED_METRICS = ("pg_loss", "kl_loss")

# loss_fn(params, micro_batch, normalizer) -> (loss, sums): both add up over micro-batches.
LossFn = Callable[[Any, Batch, jax.Array], tuple[jax.Array, dict[str, jax.Array]]]


@dataclasses.dataclass(frozen=True)
class RLLossConfig:
    """Options of the GRPO-RoC policy loss (paper defaults: ε 0.2/0.28, no KL, no entropy, token mean).

    ``old_logprobs`` picks where π_old comes from: ``"sampler"`` uses the log-probs the engine recorded while
    sampling; ``"recompute"`` evaluates them with the trainer's forward before the update (the two differ by
    the sampler/trainer numerical mismatch, e.g. under bfloat16). ``temperature`` divides the logits so the
    trainer scores the same distribution the sampler drew from.
    """

    eps_low: float = 0.2
    eps_high: float = 0.28
    dual_clip: float | None = None
    agg: str = "token_mean"
    entropy_coef: float = 0.0
    temperature: float = 1.0
    old_logprobs: str = "sampler"

    def __post_init__(self):
        if self.old_logprobs not in OLD_LOGPROB_SOURCES:
            raise ValueError(f"old_logprobs={self.old_logprobs!r}; expected one of {OLD_LOGPROB_SOURCES}")
        if self.temperature <= 0:
            raise ValueError(f"temperature must be positive, got {self.temperature}")


def _masked_sum(x: jax.Array, mask: jax.Array) -> jax.Array:
    return jnp.sum(x * mask)


def _logprobs_and_entropy(params, model_config, batch: Batch, temperature: float = 1.0):
    """Per-position log π(target) and the policy's entropy (float32 ``[rows, seq_len]`` each)."""
    logits, _ = models.forward(
        params, model_config, batch.tokens, positions=batch.positions, segment_ids=batch.segment_ids
    )
    logits = logits / temperature
    logp = models.token_logprobs(logits, batch.targets)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    entropy = log_z - jnp.sum(jax.nn.softmax(logits, axis=-1) * logits, axis=-1)
    return logp, entropy


def sft_loss(params, batch: Batch, normalizer: jax.Array, *, model_config) -> tuple[jax.Array, dict]:
    """Masked cross-entropy: loss = −Σ mask·log π(target) / normalizer (the batch's loss tokens)."""
    logp, _ = _logprobs_and_entropy(params, model_config, batch)
    return -_masked_sum(logp, batch.loss_mask) / normalizer, {}


def rl_loss(params, batch: Batch, normalizer: jax.Array, *, model_config, loss_config: RLLossConfig):
    """The GRPO-RoC clipped surrogate (``algo.policy_loss``) with the whole-batch normaliser.

    Returns (loss, aux): ``aux["token_sums"]`` (entropy, clip fractions, approx KL, ratio; divided by the
    batch's loss tokens after accumulation) and ``aux["totals"]`` (the normalised pg / KL losses).
    """
    logp, entropy = _logprobs_and_entropy(params, model_config, batch, loss_config.temperature)
    old_logp = batch.old_logp
    if loss_config.old_logprobs == "recompute":
        # One update per rollout batch: π_old is the current policy before this update.
        old_logp = jax.lax.stop_gradient(logp)
    loss, metrics = algo.policy_loss(
        logp,
        old_logp,
        batch.advantages,
        batch.loss_mask,
        eps_low=loss_config.eps_low,
        eps_high=loss_config.eps_high,
        dual_clip=loss_config.dual_clip,
        entropy=entropy if loss_config.entropy_coef else None,
        entropy_coef=loss_config.entropy_coef,
        agg=loss_config.agg,
        normalizer=normalizer,
    )
    # policy_loss's token means over this micro-batch, weighted by its token count, add up to token sums over
    # the batch; its terms already divided by the whole-batch normaliser add up as they are.
    tokens = jnp.sum(batch.loss_mask)
    token_sums = {
        k: v * tokens for k, v in metrics.items() if k not in _NORMALISED_METRICS and k != "entropy"
    }
    token_sums["entropy"] = jax.lax.stop_gradient(_masked_sum(entropy, batch.loss_mask))
    totals = {k: v for k, v in metrics.items() if k in _NORMALISED_METRICS}
    return loss, {"token_sums": token_sums, "totals": totals}


def _strided_microbatches(batch: Batch, num_microbatches: int) -> Batch:
    """``[rows, ...]`` -> ``[M, rows / M, ...]``, micro-batch m = rows m, m+M, ... (shard-local rows)."""

    def split(x):
        return x.reshape(x.shape[0] // num_microbatches, num_microbatches, *x.shape[1:]).swapaxes(0, 1)

    return jax.tree.map(split, batch)


def accumulate_gradients(loss_fn: LossFn, params, batch: Batch, normalizer: jax.Array, num_microbatches: int):
    """Σ over micro-batches of (loss, sums, ∇loss): equals the full-batch values when ``loss_fn`` is additive.

    Returns ``(loss, sums, grads)``; the gradient accumulator stays in the parameters' dtype and placement.
    """
    rows = batch.tokens.shape[0]
    if num_microbatches < 1 or rows % num_microbatches:
        raise ValueError(
            f"batch rows ({rows}) must be a positive multiple of num_microbatches ({num_microbatches})"
        )
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
    if num_microbatches == 1:
        (loss, sums), grads = grad_fn(params, batch, normalizer)
        return loss, sums, grads

    micro = _strided_microbatches(batch, num_microbatches)
    first = jax.tree.map(lambda x: x[0], micro)
    (loss_shape, sums_shape), _ = jax.eval_shape(grad_fn, params, first, normalizer)

    def body(carry, micro_batch):
        loss, sums, grads = carry
        (l_m, s_m), g_m = grad_fn(params, micro_batch, normalizer)
        return (loss + l_m, jax.tree.map(jnp.add, sums, s_m), jax.tree.map(jnp.add, grads, g_m)), None

    zeros = (
        jnp.zeros(loss_shape.shape, loss_shape.dtype),
        jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), sums_shape),
        jax.tree.map(jnp.zeros_like, params),
    )
    (loss, sums, grads), _ = jax.lax.scan(body, zeros, micro)
    return loss, sums, grads


def _apply_update(state: TrainState, grads, optimizer: optax.GradientTransformation):
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    return state.replace(params=params, opt_state=opt_state, step=state.step + 1)


def sft_step(state: TrainState, batch: Batch, *, model_config, optimizer, num_microbatches: int = 1):
    """One SFT update on a packed batch; metrics: loss (mean NLL per assistant token), grad norm, tokens."""
    tokens = jnp.sum(batch.loss_mask)
    loss_fn = functools.partial(sft_loss, model_config=model_config)
    loss, _, grads = accumulate_gradients(
        loss_fn, state.params, batch, jnp.maximum(tokens, 1.0), num_microbatches
    )
    metrics = {"loss": loss, "grad_norm": optax.global_norm(grads), "tokens": tokens}
    return _apply_update(state, grads, optimizer), metrics


def rl_step(
    state: TrainState,
    batch: Batch,
    *,
    model_config,
    optimizer,
    loss_config: RLLossConfig,
    num_microbatches: int = 1,
):
    """One GRPO-RoC update on a batch of selected trajectories.

    Metrics: loss, grad_norm, tokens (loss tokens), and token means of entropy and the policy-loss metrics
    (clip fractions, approx KL, ratio).
    """
    tokens = jnp.sum(batch.loss_mask)
    normalizer = algo.loss_normalizer(batch.loss_mask, agg=loss_config.agg)
    loss_fn = functools.partial(rl_loss, model_config=model_config, loss_config=loss_config)
    loss, sums, grads = accumulate_gradients(loss_fn, state.params, batch, normalizer, num_microbatches)
    metrics = {k: v / jnp.maximum(tokens, 1.0) for k, v in sums["token_sums"].items()}
    metrics.update(sums["totals"], loss=loss, grad_norm=optax.global_norm(grads), tokens=tokens)
    return _apply_update(state, grads, optimizer), metrics


def state_shardings(model_config, optimizer: optax.GradientTransformation, mesh: Mesh) -> TrainState:
    """``TrainState`` of ``NamedSharding``: params (and the optimizer's per-parameter moments) as the model's
    logical rules place them; counters, step and RNG replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())
    params = models.param_shardings(model_config, mesh)
    abstract_params = jax.eval_shape(lambda: models.init_params(model_config, jax.random.PRNGKey(0)))
    abstract_opt = jax.eval_shape(optimizer.init, abstract_params)
    opt = optax.tree_map_params(
        optimizer,
        lambda _, sharding: sharding,
        abstract_opt,
        params,
        transform_non_params=lambda _: replicated,
    )
    return TrainState(params=params, opt_state=opt, step=replicated, rng=replicated)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Rows over the data-parallel axes (``data`` x ``fsdp``), positions whole."""
    return NamedSharding(mesh, PartitionSpec(("data", "fsdp")))


def jit_step(
    step_fn,
    *,
    mesh: Mesh | None = None,
    shardings: TrainState | None = None,
    compiler_options: dict | None = None,
):
    """``jax.jit`` of ``step_fn(state, batch)`` with the state donated; with a mesh, explicit in/out shardings
    (state as ``shardings``, batch rows over data x fsdp, metrics replicated). ``compiler_options`` go to XLA
    (e.g. ``{"xla_backend_optimization_level": 0}`` trades step speed for compile time)."""
    if mesh is None:
        return jax.jit(step_fn, donate_argnums=0, compiler_options=compiler_options)
    if shardings is None:
        raise ValueError("jit_step with a mesh needs the state shardings (see state_shardings)")
    replicated = NamedSharding(mesh, PartitionSpec())
    return jax.jit(
        step_fn,
        in_shardings=(shardings, batch_sharding(mesh)),
        out_shardings=(shardings, replicated),
        donate_argnums=0,
        compiler_options=compiler_options,
    )


def make_sft_step(
    model_config,
    optimizer,
    *,
    num_microbatches: int = 1,
    mesh: Mesh | None = None,
    shardings: TrainState | None = None,
    compiler_options: dict | None = None,
):
    """``sft_step`` bound to its options and jitted: ``step(state, batch) -> (state, metrics)``."""
    step = functools.partial(
        sft_step, model_config=model_config, optimizer=optimizer, num_microbatches=num_microbatches
    )
    return jit_step(step, mesh=mesh, shardings=shardings, compiler_options=compiler_options)


def make_rl_step(
    model_config,
    optimizer,
    loss_config: RLLossConfig = RLLossConfig(),
    *,
    num_microbatches: int = 1,
    mesh: Mesh | None = None,
    shardings: TrainState | None = None,
    compiler_options: dict | None = None,
):
    """``rl_step`` bound to its options and jitted: ``step(state, batch) -> (state, metrics)``."""
    step = functools.partial(
        rl_step,
        model_config=model_config,
        optimizer=optimizer,
        loss_config=loss_config,
        num_microbatches=num_microbatches,
    )
    return jit_step(step, mesh=mesh, shardings=shardings, compiler_options=compiler_options)
