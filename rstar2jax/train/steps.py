"""The RL (GRPO-RoC) training step: the policy loss over a batch of selected trajectories, its whole-batch
normaliser over packed sequences, micro-batched gradients, one AdamW update.

A step is ``step(state, batch) -> (state, metrics)``. What every step shares (micro-batches, gradient
accumulation, LoRA adapters, the update) is ``train.gradients``; placing and jitting a step is
``train.step_jit``; the SFT step is ``train.sft_step``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from rstar2jax import algo, models
from rstar2jax.config.algorithm import RLLossConfig
from rstar2jax.data.batch import Batch
from rstar2jax.train.faults import skip_nonfinite_updates
from rstar2jax.train.gradients import (
    accumulate_gradients,
    apply_update,
    logprobs_and_entropy,
    masked_sum,
    with_adapters,
)
from rstar2jax.train.state import TrainState
from rstar2jax.train.step_jit import jit_bound_step

# policy_loss metrics already divided by the normaliser (additive over micro-batches, unlike its token means).
_NORMALISED_METRICS = ("pg_loss", "kl_loss")


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
    logp, entropy = logprobs_and_entropy(params, model_config, batch, loss_config.temperature)
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
        ref_logp, _ = logprobs_and_entropy(
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
    token_sums["entropy"] = jax.lax.stop_gradient(masked_sum(entropy, batch.loss_mask))
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
    return apply_update(state, grads, optimizer), metrics


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
    return jit_bound_step(step, model_config, lora, mesh=mesh, shardings=shardings,
                          compiler_options=compiler_options)
