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
from rstar2jax.config.algorithm import RLLossConfig
from rstar2jax.data.batch import Batch
from rstar2jax.train.faults import skip_nonfinite_updates
from rstar2jax.train.state import TrainState

# policy_loss metrics already divided by the normaliser (additive over micro-batches, unlike its token means).
_NORMALISED_METRICS = ("pg_loss", "kl_loss")

# loss_fn(params, micro_batch, normalizer) -> (loss, sums): both add up over micro-batches.
LossFn = Callable[[Any, Batch, jax.Array], tuple[jax.Array, dict[str, jax.Array]]]


def _masked_sum(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Σ mask·x with masked-out positions dropped before the product (a NaN / Inf there stays out)."""
    return jnp.sum(algo.masked_values(x, mask) * mask)


def _logprobs_and_entropy(params, model_config, batch: Batch, temperature: float = 1.0):
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


def sft_loss(params, batch: Batch, normalizer: jax.Array, *, model_config) -> tuple[jax.Array, dict]:
    """Masked cross-entropy: loss = −Σ mask·log π(target) / normalizer (the batch's loss tokens)."""
    logp, _ = _logprobs_and_entropy(params, model_config, batch)
    return -_masked_sum(logp, batch.loss_mask) / normalizer, {}


def rl_loss(
    params, batch: Batch, normalizer: jax.Array, *, model_config, loss_config: RLLossConfig, ref_params=None
):
    """The GRPO-RoC clipped surrogate (``algo.policy_loss``) with the whole-batch normaliser.

    ``ref_params`` (frozen, no gradient) give the reference log-probs of the KL term when
    ``loss_config.kl_coef`` > 0. Returns (loss, aux): ``aux["token_sums"]`` (entropy, clip fractions, approx
    KL, ratio, rollout-correction sums; divided by the batch's loss tokens after accumulation) and
    ``aux["totals"]`` (the normalised pg / KL losses). The token sums include ``algo.rollout_mismatch``'s
    (``mismatch_*``, ``mismatch_tokens``).
    """
    logp, entropy = _logprobs_and_entropy(params, model_config, batch, loss_config.temperature)
    old_logp = batch.old_logp
    if loss_config.old_logprobs == "recompute" or loss_config.decoupled:
        # One update per rollout batch: π_old is the current policy before this update.
        old_logp = jax.lax.stop_gradient(logp)
    ref_logp = None
    if loss_config.kl_coef:
        if ref_params is None:
            raise ValueError(
                f"kl_coef={loss_config.kl_coef} needs a reference policy: the state has no ref_params"
            )
        ref_logp, _ = _logprobs_and_entropy(
            jax.lax.stop_gradient(ref_params), model_config, batch, loss_config.temperature
        )
    is_weights, correction_sums = None, {}
    if loss_config.rollout_correction:  # TIS / MIS; under the decoupled objective its sequence mask only
        # batch.old_logp holds the sampler's (rollout engine's) log-probs.
        is_weights, correction_sums = algo.rollout_correction(
            old_logp,
            batch.old_logp,
            batch.loss_mask,
            token_cap=loss_config.rollout_is_cap,
            sequence_mask=loss_config.rollout_mask,
            mask_threshold=loss_config.rollout_mask_threshold,
            segment_ids=batch.segment_ids,
        )
    sequence_level = loss_config.importance_sampling_level == "sequence"
    if loss_config.decoupled:  # old_logp is the proximal policy's; batch.old_logp the sampler's (behaviour)
        objective = functools.partial(algo.decoupled_policy_loss, logp, old_logp, batch.old_logp,
                                      is_cap=loss_config.decoupled_is_cap)
    else:
        objective = functools.partial(algo.policy_loss, logp, old_logp)
    policy_loss = functools.partial(
        objective,
        batch.advantages,
        eps_low=loss_config.gspo_eps_low if sequence_level else loss_config.eps_low,
        eps_high=loss_config.gspo_eps_high if sequence_level else loss_config.eps_high,
        dual_clip=None if sequence_level else loss_config.dual_clip,
        ref_logp=ref_logp,
        kl=loss_config.kl,
        kl_coef=loss_config.kl_coef,
        entropy=entropy if loss_config.entropy_coef else None,
        entropy_coef=loss_config.entropy_coef,
        normalizer=normalizer,
        importance_sampling_level=loss_config.importance_sampling_level,
        segment_ids=batch.segment_ids,
        is_weights=is_weights,
    )
    if loss_config.agg == "seq_mean_token_mean":
        # Per sequence (segment), not per row: weight each loss token by 1 / its sequence's loss tokens and
        # sum; the token-mean metrics come from the plain mask.
        _, metrics = policy_loss(batch.loss_mask, agg="token_mean")
        weights = batch.loss_mask / jnp.maximum(_segment_loss_tokens(batch.loss_mask, batch.segment_ids), 1.0)
        loss, weighted = policy_loss(weights, agg="seq_mean_token_sum")
        metrics.update({k: v for k, v in weighted.items() if k in (*_NORMALISED_METRICS, "entropy")})
    else:
        loss, metrics = policy_loss(batch.loss_mask, agg=loss_config.agg)
    # policy_loss's token means over this micro-batch, weighted by its token count, add up to token sums over
    # the batch; its terms already divided by the whole-batch normaliser add up as they are.
    tokens = jnp.sum(batch.loss_mask)
    token_sums = {
        k: v * tokens for k, v in metrics.items() if k not in _NORMALISED_METRICS and k != "entropy"
    }
    token_sums["entropy"] = jax.lax.stop_gradient(_masked_sum(entropy, batch.loss_mask))
    token_sums.update(correction_sums)
    # The sampler's log-probs against the trainer's (this forward, before the update): no gradient.
    token_sums.update(algo.rollout_mismatch(logp, batch.old_logp, batch.loss_mask, sums=True))
    totals = {k: v for k, v in metrics.items() if k in _NORMALISED_METRICS}
    return loss, {"token_sums": token_sums, "totals": totals}


def _segment_loss_tokens(loss_mask: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """Per position, the number of loss tokens in its sequence (its run of equal segment ids in the row)."""
    starts = models.segments.segment_starts(segment_ids)
    ends = models.segments.segment_ends(starts)
    cumulative = jnp.cumsum(loss_mask, axis=1)  # exact: integer counts below 2^24
    before = jnp.take_along_axis(cumulative - loss_mask, starts, axis=1)
    return jnp.take_along_axis(cumulative, ends, axis=1) - before


def sequence_loss_normalizer(loss_mask: jax.Array, segment_ids: jax.Array, *, agg: str) -> jax.Array:
    """``algo.loss_normalizer`` with sequences as the packed segments rather than rows: the loss tokens
    (``token_mean``), the row length T (``seq_mean_token_sum_norm``, verl's constant) or the number of
    sequences with at least one loss token (the other ``seq_mean_*`` modes), so a packed batch has the
    normaliser of the same sequences padded one per row (rows of the same length)."""
    if agg in ("token_mean", "seq_mean_token_sum_norm"):
        return algo.loss_normalizer(loss_mask, agg=agg)
    algo.loss_normalizer(loss_mask, agg=agg)  # checks the mask and the mode
    first = jnp.arange(loss_mask.shape[1]) == models.segments.segment_starts(segment_ids)
    return jnp.sum(first & (_segment_loss_tokens(loss_mask, segment_ids) > 0)).astype(jnp.float32)


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


def _apply_update(state: TrainState, grads, optimizer: optax.GradientTransformation):
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    return state.replace(params=params, opt_state=opt_state, step=state.step + 1)


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
    return _apply_update(state, grads, optimizer), metrics


def rl_step(
    state: TrainState,
    batch: Batch,
    base=None,
    *,
    model_config,
    optimizer,
    loss_config: RLLossConfig,
    num_microbatches: int = 1,
    lora: models.LoraConfig | None = None,
):
    """One GRPO-RoC update on a batch of selected trajectories.

    LoRA (``lora`` given): ``state.params`` are the adapters, ``base`` the frozen base parameters, which are
    also the KL term's reference policy (the adapters off: no second copy of the weights). No dropout: the
    policy ratio needs a deterministic policy.

    Metrics: loss, grad_norm, tokens (loss tokens), and token means of entropy and the policy-loss metrics
    (clip fractions, approx KL, ratio); kl_loss with a KL term; with rollout correction rollout_is_ratio
    (mean π_train/π_rollout), rollout_is_capped (share of loss tokens whose weight was truncated),
    rollout_is_masked (share of loss tokens in masked sequences); decoupled: behaviour_ratio_mean (mean
    π_prox/π_behaviour), behaviour_ratio_capped; always the sampler-vs-trainer mismatch of the loss tokens
    (``algo.rollout_mismatch``, this forward's log-probs before the update against ``batch.old_logp``):
    mismatch_abs_log_ratio, mismatch_k3_kl, mismatch_outside_band. Sequences dropped by the rollout mask stay
    in the loss normaliser (computed over the whole batch before the forward pass).
    """
    tokens = jnp.sum(batch.loss_mask)
    normalizer = sequence_loss_normalizer(batch.loss_mask, batch.segment_ids, agg=loss_config.agg)
    loss_fn = functools.partial(
        rl_loss,
        model_config=model_config,
        loss_config=loss_config,
        ref_params=state.ref_params if lora is None else base,
    )
    if lora is not None:
        loss_fn = with_adapters(loss_fn, base, dataclasses.replace(lora, dropout=0.0))
    loss, sums, grads = accumulate_gradients(loss_fn, state.params, batch, normalizer, num_microbatches)
    count = jnp.maximum(tokens, 1.0)
    metrics = {k: v / count for k, v in sums["token_sums"].items() if k != "mismatch_tokens"}
    metrics.update(sums["totals"], loss=loss, grad_norm=optax.global_norm(grads), tokens=tokens)
    return _apply_update(state, grads, optimizer), metrics


def trainable_params(model_config, key: jax.Array, lora: models.LoraConfig | None = None, *, mesh=None):
    """Fresh trainable parameters: the model's (``models.init_params``), or with ``lora`` its adapters
    (``models.lora.init_lora``)."""
    if lora is None:
        return models.init_params(model_config, key, mesh=mesh)
    return models.lora.init_lora(model_config, lora, key, mesh=mesh)


def state_shardings(
    model_config,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    *,
    reference: bool = False,
    lora: models.LoraConfig | None = None,
) -> TrainState:
    """``TrainState`` of ``NamedSharding``: the trainable params (the model's, or with ``lora`` the adapters)
    and the optimizer's per-parameter moments (and the reference params when ``reference``) as the logical
    rules place them; counters, step and RNG replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())
    if lora is None:
        params = models.param_shardings(model_config, mesh)
    else:
        params = models.lora.lora_shardings(model_config, lora, mesh)
    abstract_params = jax.eval_shape(lambda: trainable_params(model_config, jax.random.PRNGKey(0), lora))
    abstract_opt = jax.eval_shape(optimizer.init, abstract_params)
    opt = optax.tree_map_params(
        optimizer,
        lambda _, sharding: sharding,
        abstract_opt,
        params,
        transform_non_params=lambda _: replicated,
    )
    ref_params = params if reference else None
    return TrainState(params=params, opt_state=opt, step=replicated, rng=replicated, ref_params=ref_params)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Rows over the data-parallel axes (``data`` x ``fsdp``), positions whole."""
    return NamedSharding(mesh, PartitionSpec(("data", "fsdp")))


def jit_step(
    step_fn,
    *,
    mesh: Mesh | None = None,
    shardings: TrainState | None = None,
    compiler_options: dict | None = None,
    base_shardings: dict | None = None,
):
    """``jax.jit`` of ``step_fn(state, batch)`` with the state donated; with a mesh, explicit in/out shardings
    (state as ``shardings``, batch rows over data x fsdp, metrics replicated). ``compiler_options`` go to XLA
    (e.g. ``{"xla_backend_optimization_level": 0}`` trades step speed for compile time). ``base_shardings``
    (LoRA): the step is ``step_fn(state, batch, base)``, the frozen base params placed so, not donated."""
    if mesh is None:
        return jax.jit(step_fn, donate_argnums=0, compiler_options=compiler_options)
    if shardings is None:
        raise ValueError("jit_step with a mesh needs the state shardings (see state_shardings)")
    replicated = NamedSharding(mesh, PartitionSpec())
    base = () if base_shardings is None else (base_shardings,)
    return jax.jit(
        step_fn,
        in_shardings=(shardings, batch_sharding(mesh), *base),
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
    lora: models.LoraConfig | None = None,
):
    """``sft_step`` bound to its options and jitted: ``step(state, batch) -> (state, metrics)``; with
    ``lora``, ``step(state, batch, base)`` (see ``sft_step``)."""
    step = functools.partial(
        sft_step, model_config=model_config, optimizer=optimizer, num_microbatches=num_microbatches, lora=lora
    )
    return _jit(step, model_config, lora, mesh=mesh, shardings=shardings, compiler_options=compiler_options)


def make_rl_step(
    model_config,
    optimizer,
    loss_config: RLLossConfig = RLLossConfig(),  # noqa: B008 (frozen: one shared default is safe)
    *,
    num_microbatches: int = 1,
    mesh: Mesh | None = None,
    shardings: TrainState | None = None,
    compiler_options: dict | None = None,
    lora: models.LoraConfig | None = None,
):
    """``rl_step`` bound to its options and jitted: ``step(state, batch) -> (state, metrics)``; with ``lora``,
    ``step(state, batch, base)`` (see ``rl_step``). A step whose loss or gradient is not finite keeps its
    input parameters and optimizer state (``update_skipped`` in its metrics,
    ``train.faults.skip_nonfinite_updates``)."""
    step = functools.partial(
        rl_step,
        model_config=model_config,
        optimizer=optimizer,
        loss_config=loss_config,
        num_microbatches=num_microbatches,
        lora=lora,
    )
    step = skip_nonfinite_updates(step)
    return _jit(step, model_config, lora, mesh=mesh, shardings=shardings, compiler_options=compiler_options)


def _jit(step, model_config, lora, *, mesh, **options):
    base_shardings = None if lora is None or mesh is None else models.param_shardings(model_config, mesh)
    return jit_step(step, mesh=mesh, base_shardings=base_shardings, **options)
