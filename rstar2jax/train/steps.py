"""SFT and RL (GRPO-RoC) training steps: micro-batched gradients, a whole-batch normaliser, AdamW updates.

A step is ``step(state, batch) -> (state, metrics)``. The batch is split into ``num_microbatches`` strided
micro-batches and ``lax.scan`` sums their gradients (``rstar2jax.train.updates``): one update per batch, or an
RL step's ``ppo_epochs`` x ``mini_batches`` updates against the policy the step started from.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rstar2jax import algo, models
from rstar2jax.config.loss_config import RLLossConfig
from rstar2jax.data.batch import Batch
from rstar2jax.train.faults import skip_nonfinite_updates
from rstar2jax.train.state import TrainState
from rstar2jax.train.updates import (
    LossFn,
    accumulate_gradients,
    apply_update,
    several_updates,
    strided_merge,
    strided_split,
    with_adapters,
)

#: The paper's loss (``make_rl_step``'s default).
DEFAULT_LOSS = RLLossConfig()
# policy_loss metrics already divided by the normaliser (additive over micro-batches, unlike its token means).
_NORMALISED_METRICS = ("pg_loss", "kl_loss")


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
    params, batch: Batch, normalizer: jax.Array, *, model_config, loss_config: RLLossConfig, ref_params=None,
    policy_logp: jax.Array | None = None,
):
    """The policy loss ``loss_config`` picks (``algo.compute_policy_loss`` of ``loss_config.objective()``,
    the GRPO-RoC clipped surrogate by default) with the whole-batch normaliser.

    ``ref_params`` (frozen, no gradient) give the reference log-probs of the KL term when
    ``loss_config.kl_coef`` > 0. ``policy_logp``: the log-probs of the policy the step's updates started
    from (pi_old when recomputed, pi_prox under the decoupled objective, the trainer's side of the mismatch
    metrics); None: this forward's (one update per batch, the same values). Returns (loss, aux):
    ``aux["token_sums"]`` (entropy, clip fractions, approx KL, ratio, rollout-correction sums; divided by the
    batch's loss tokens after accumulation) and
    ``aux["totals"]`` (the normalised pg / KL losses). The token sums include ``algo.rollout_mismatch``'s
    (``mismatch_*``, ``mismatch_tokens``).
    """
    logp, entropy = _logprobs_and_entropy(params, model_config, batch, loss_config.temperature)
    # The policy before this step's updates: with one update per batch, this forward's.
    start_logp = jax.lax.stop_gradient(logp) if policy_logp is None else policy_logp
    old_logp = batch.sampler_logp
    if loss_config.old_logprobs == "recompute" or loss_config.decoupled:
        old_logp = start_logp
    ref_logp = _reference_logp(ref_params, model_config, batch, loss_config)
    is_weights, correction_sums = None, {}
    if loss_config.rollout_correction:  # TIS / MIS; under the decoupled objective its sequence mask only
        # batch.sampler_logp holds the sampler's (rollout engine's) log-probs.
        is_weights, correction_sums = algo.rollout_correction(
            old_logp,
            batch.sampler_logp,
            batch.loss_mask,
            token_cap=loss_config.rollout_is_cap,
            sequence_mask=loss_config.rollout_mask,
            mask_threshold=loss_config.rollout_mask_threshold,
            segment_ids=batch.segment_ids,
        )
    # Under the decoupled objective old_logp is the proximal policy's, batch.sampler_logp the behaviour's.
    policy_loss = functools.partial(
        algo.compute_policy_loss,
        loss_config.objective(),
        logp,
        old_logp,
        batch.advantages,
        options=loss_config.loss_options(),
        behaviour_logp=batch.sampler_logp if loss_config.decoupled else None,
        ref_logp=ref_logp,
        kl=loss_config.kl,
        kl_coef=loss_config.kl_coef,
        entropy=entropy if loss_config.entropy_coef else None,
        entropy_coef=loss_config.entropy_coef,
        normalizer=normalizer,
        segment_ids=batch.segment_ids,
        is_weights=is_weights,
    )
    loss, metrics = _aggregated(policy_loss, batch, loss_config.agg)
    # policy_loss's token means over this micro-batch, weighted by its token count, add up to token sums over
    # the batch; its terms already divided by the whole-batch normaliser add up as they are.
    tokens = jnp.sum(batch.loss_mask)
    token_sums = {
        k: v * tokens for k, v in metrics.items() if k not in _NORMALISED_METRICS and k != "entropy"
    }
    token_sums["entropy"] = jax.lax.stop_gradient(_masked_sum(entropy, batch.loss_mask))
    token_sums.update(correction_sums)
    # The sampler's log-probs against the trainer's (this forward, before the update): no gradient.
    token_sums.update(algo.rollout_mismatch(start_logp, batch.sampler_logp, batch.loss_mask, sums=True))
    totals = {k: v for k, v in metrics.items() if k in _NORMALISED_METRICS}
    return loss, {"token_sums": token_sums, "totals": totals}


def _reference_logp(ref_params, model_config, batch: Batch, loss_config: RLLossConfig):
    """The frozen reference policy's log-probs for the KL term (None without one: ``kl_coef`` 0)."""
    if not loss_config.kl_coef:
        return None
    if ref_params is None:
        raise ValueError(f"kl_coef={loss_config.kl_coef} needs a reference policy: the state has no "
                         "ref_params")
    ref_logp, _ = _logprobs_and_entropy(jax.lax.stop_gradient(ref_params), model_config, batch,
                                        loss_config.temperature)
    return ref_logp


def _aggregated(policy_loss, batch: Batch, agg: str):
    """``policy_loss`` (its token weights still to give) aggregated as ``agg`` says: (loss, metrics)."""
    if agg != "seq_mean_token_mean":
        return policy_loss(batch.loss_mask, agg=agg)
    # Per sequence (segment), not per row: weight each loss token by 1 / its sequence's loss tokens and
    # sum; the token-mean metrics come from the plain mask.
    _, metrics = policy_loss(batch.loss_mask, agg="token_mean")
    weights = batch.loss_mask / jnp.maximum(_segment_loss_tokens(batch.loss_mask, batch.segment_ids), 1.0)
    loss, weighted = policy_loss(weights, agg="seq_mean_token_sum")
    metrics.update({k: v for k, v in weighted.items() if k in (*_NORMALISED_METRICS, "entropy")})
    return loss, metrics


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
        loss_fn = with_adapters(loss_fn, base, lora, merge_in_forward=model_config.numerics == "exact")
        rng = jax.random.fold_in(state.rng, state.step) if lora.dropout else None
    loss, _, grads = accumulate_gradients(
        loss_fn, state.params, batch, jnp.maximum(tokens, 1.0), num_microbatches, rng=rng
    )
    metrics = {"loss": loss, "grad_norm": optax.global_norm(grads), "tokens": tokens}
    return apply_update(state, grads, optimizer), metrics


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
    ppo_epochs: int = 1,
    mini_batches: int = 1,
):
    """A GRPO-RoC step on a batch of selected trajectories: one update (the default, the release's), or
    ``ppo_epochs`` passes over ``mini_batches`` strided mini-batches, an update each (``updates.
    several_updates``), against the policy the step started from: its log-probs, computed once before the
    first update, are pi_old (``old_logprobs="recompute"``) or pi_prox (the decoupled objective).

    LoRA (``lora`` given): ``state.params`` are the adapters, ``base`` the frozen base parameters, which are
    also the KL term's reference policy (the adapters off: no second copy of the weights). No dropout: the
    policy ratio needs a deterministic policy.

    Metrics: loss, grad_norm, tokens (loss tokens), and token means of entropy and the policy-loss metrics
    (clip fractions, approx KL, ratio); kl_loss with a KL term; with rollout correction rollout_is_ratio
    (mean π_train/π_rollout), rollout_is_capped (share of loss tokens whose weight was truncated),
    rollout_is_masked (share of loss tokens in masked sequences); decoupled: behaviour_ratio_mean (mean
    π_prox/π_behaviour), behaviour_ratio_capped; always the sampler-vs-trainer mismatch of the loss tokens
    (``algo.rollout_mismatch``, the log-probs before the first update against ``batch.sampler_logp``):
    mismatch_abs_log_ratio, mismatch_k3_kl, mismatch_outside_band. Several updates: each averaged over the
    epochs (and grad_norm over the updates). Sequences dropped by the rollout mask stay in the loss
    normaliser (computed over the whole batch before the forward pass).
    """
    tokens = jnp.sum(batch.loss_mask)
    normalizer = sequence_loss_normalizer(batch.loss_mask, batch.segment_ids, agg=loss_config.agg)
    lora = None if lora is None else dataclasses.replace(lora, dropout=0.0)
    merge_in_forward = model_config.numerics == "exact"  # LoRA: the engine's merged weights, layer by layer

    def adapted(loss_fn: LossFn) -> LossFn:  # of the adapters with LoRA, else as it is
        if lora is None:
            return loss_fn
        return with_adapters(loss_fn, base, lora, merge_in_forward=merge_in_forward)

    loss_fn = functools.partial(
        rl_loss,
        model_config=model_config,
        loss_config=loss_config,
        ref_params=state.ref_params if lora is None else base,
    )
    if ppo_epochs == mini_batches == 1:
        loss_fn = adapted(loss_fn)
        loss, sums, grads = accumulate_gradients(loss_fn, state.params, batch, normalizer, num_microbatches)
        grad_norm, state = optax.global_norm(grads), apply_update(state, grads, optimizer)
    else:
        policy = state.params if lora is None else models.lora.attach(base, state.params, lora,
                                                                       merge_in_forward=merge_in_forward)
        start_logp = _start_logprobs(policy, batch, model_config=model_config,
                                     temperature=loss_config.temperature, num_microbatches=num_microbatches)
        loss_fn = adapted(_with_start_logprobs(loss_fn))
        state, loss, sums, grad_norm = several_updates(
            state, (batch, start_logp), loss_fn, normalizer, optimizer=optimizer,
            num_microbatches=num_microbatches, ppo_epochs=ppo_epochs, mini_batches=mini_batches)
    count = jnp.maximum(tokens, 1.0)
    metrics = {k: v / count for k, v in sums["token_sums"].items() if k != "mismatch_tokens"}
    metrics.update(sums["totals"], loss=loss, grad_norm=grad_norm, tokens=tokens)
    return state, metrics


def _start_logprobs(params, batch: Batch, *, model_config, temperature: float, num_microbatches: int):
    """log pi(target) ``[rows, seq_len]`` of ``params`` (no gradient), a micro-batch at a time: the policy a
    step's updates start from."""

    def logprobs(micro_batch):
        return _logprobs_and_entropy(params, model_config, micro_batch, temperature)[0]

    micro_batches = strided_split(batch, num_microbatches)
    return jax.lax.stop_gradient(strided_merge(jax.lax.map(logprobs, micro_batches)))


def _with_start_logprobs(loss_fn: LossFn) -> LossFn:
    """``rl_loss`` (bound) of ``(batch, start_logp)`` pairs: ``policy_logp=start_logp``."""

    def loss(params, inputs, normalizer):
        batch, start_logp = inputs
        return loss_fn(params, batch, normalizer, policy_logp=start_logp)

    return loss


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
    loss_config: RLLossConfig = DEFAULT_LOSS,
    *,
    num_microbatches: int = 1,
    mesh: Mesh | None = None,
    shardings: TrainState | None = None,
    compiler_options: dict | None = None,
    lora: models.LoraConfig | None = None,
    ppo_epochs: int = 1,
    mini_batches: int = 1,
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
        ppo_epochs=ppo_epochs,
        mini_batches=mini_batches,
    )
    step = skip_nonfinite_updates(step)
    return _jit(step, model_config, lora, mesh=mesh, shardings=shardings, compiler_options=compiler_options)


def _jit(step, model_config, lora, *, mesh, **options):
    base_shardings = None if lora is None or mesh is None else models.param_shardings(model_config, mesh)
    return jit_step(step, mesh=mesh, base_shardings=base_shardings, **options)
