"""The built-in policy losses, each registered by name (``algo.register_policy_loss``), and
:func:`compute_policy_loss`, which runs any registered loss with the shared aggregation, importance weights,
KL and entropy terms (``rstar2jax.algo.losses``).

  name        per-token loss l_t (to minimise), rho_t = exp(x_t) the importance ratio
  ppo         max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high)), min(., -A c) for A < 0    (the paper's)
  gspo        ppo's surrogate with GSPO's sequence ratio and clip range, no dual clip
  decoupled   AReaL: ppo against pi_prox, weighted by min(pi_prox / pi_behaviour, C)
  cispo       -sg(min(rho, 1 + eps_high)) A logp                                              (MiniMax-M1)
  sapo        -A (4 / tau) sigmoid(tau (rho - 1)), tau = tau_pos (A > 0) or tau_neg          (Qwen's SAPO)

:func:`policy_loss` and :func:`decoupled_policy_loss` are the clipped surrogate's and the decoupled
objective's keyword APIs (``algo.policy_loss``), the registered ``ppo`` / ``gspo`` / ``decoupled`` run.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from rstar2jax.algo import _checks
from rstar2jax.algo._checks import masked as _masked
from rstar2jax.algo.corrections import rollout_correction
from rstar2jax.algo.losses import (
    IS_LEVELS,
    KL_ESTIMATORS,
    _aggregate,
    _check_policy_loss_options,
    _checked_tokens,
    _require_term,
    _token_advantages,
    _token_array,
    _with_kl_and_entropy,
    clipped_surrogate,
    dual_clipped,
    importance_log_ratio,
    importance_weighted,
)
from rstar2jax.algo.registry import (
    POLICY_LOSSES,
    LossInputs,
    PolicyLoss,
    as_policy_loss,
    get_policy_loss,
    register_policy_loss,
)

_DUAL_CLIP_CHECK = (lambda c: _checks.concrete_value(c) is None or c > 1.0,
                    "must be > 1 (it bounds -A*rho at -A*c for A < 0), or None")
_POSITIVE = (lambda v: v > 0, "must be > 0")


def _clipped(inputs: LossInputs, *, level: str = "token", eps_low: float = 0.2, eps_high: float = 0.28,
             dual_clip: float | None = 3.0) -> tuple[jax.Array, dict]:
    """The clipped surrogate at importance-sampling ``level`` with its clip metrics (``policy_loss``)."""
    log_ratio = importance_log_ratio(inputs.logp, inputs.old_logp, inputs.mask, level=level,
                                     segment_ids=inputs.segment_ids)
    ratio = jnp.exp(log_ratio)
    advantages = inputs.advantages
    token_loss = clipped_surrogate(advantages, ratio, eps_low=eps_low, eps_high=eps_high)
    if dual_clip is not None:
        token_loss = dual_clipped(token_loss, advantages, dual_clip)
    dtype, negative = inputs.mask.dtype, advantages < 0
    # clip_frac from its two disjoint parts rather than another pass over [B, T].
    clip_frac_high = inputs.mean(((advantages > 0) & (ratio > 1.0 + eps_high)).astype(dtype))
    clip_frac_low = inputs.mean((negative & (ratio < 1.0 - eps_low)).astype(dtype))
    dual_clip_frac = 0.0 if dual_clip is None else inputs.mean((negative & (ratio > dual_clip)).astype(dtype))
    return token_loss, {
        "clip_frac_high": clip_frac_high,
        "clip_frac_low": clip_frac_low,
        "clip_frac": clip_frac_high + clip_frac_low,
        "dual_clip_frac": jnp.asarray(dual_clip_frac, dtype),
        "ratio_mean": inputs.mean(ratio),
    }


_PPO_CHECKS = {"eps_low": _POSITIVE, "eps_high": _POSITIVE, "dual_clip": _DUAL_CLIP_CHECK}


@register_policy_loss("ppo", checks=_PPO_CHECKS)
def ppo(inputs: LossInputs, *, eps_low: float = 0.2, eps_high: float = 0.28, dual_clip: float | None = 3.0):
    """PPO/GRPO's clipped surrogate with clip-higher and dual clip (rStar2-Agent Eq. 6, DAPO; Ye et al.):

      rho_t = exp(clip(logp_t - old_logp_t, -20, 20))
      l_t = max(-A_t rho_t, -A_t clip(rho_t, 1 - eps_low, 1 + eps_high))
      l_t = min(l_t, -A_t c)   where A_t < 0, c = ``dual_clip`` > 1 (None: off)

    Metrics: clip_frac_high (A > 0, rho > 1 + eps_high), clip_frac_low (A < 0, rho < 1 - eps_low), clip_frac
    (their sum), dual_clip_frac (A < 0, rho > c), ratio_mean."""
    return _clipped(inputs, level="token", eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip)


@register_policy_loss("gspo", checks={"gspo_eps_low": _POSITIVE, "gspo_eps_high": _POSITIVE})
def gspo(inputs: LossInputs, *, gspo_eps_low: float = 3e-4, gspo_eps_high: float = 4e-4):
    """GSPO-token (Zheng et al. 2025): ppo's surrogate (no dual clip) with the sequence's ratio as value and
    each token's own gradient (``corrections.gspo_log_ratio``):

      x_t = sg[mean_{s in seq(t)} (logp_s - old_logp_s)] + logp_t - sg[logp_t],  rho_t = exp(clip(x_t, +-20))
      l_t = max(-A_t rho_t, -A_t clip(rho_t, 1 - gspo_eps_low, 1 + gspo_eps_high))

    Metrics: ppo's (of the sequence ratios)."""
    return _clipped(inputs, level="sequence", eps_low=gspo_eps_low, eps_high=gspo_eps_high, dual_clip=None)


def decoupled_objective(base: PolicyLoss) -> PolicyLoss:
    """``base`` made AReaL's decoupled objective (Fu et al. 2025, Eq. 5): ``inputs.old_logp`` is the proximal
    policy pi_prox the update starts from, ``inputs.behaviour_logp`` the sampler's pi_behav, and

      l_t = w_t l^base_t,   w_t = min(exp(clip(prox_t - behav_t, -20, 20)), C)   (a constant; C =
      ``decoupled_is_cap``)

    Metrics: base's plus behaviour_ratio_mean (mean pi_prox / pi_behav before the cap) and
    behaviour_ratio_capped (the share of loss tokens over C)."""

    def loss(inputs: LossInputs, *, decoupled_is_cap: float = 5.0, **options):
        if inputs.behaviour_logp is None:
            raise ValueError("the decoupled objective needs the behaviour (sampler) log-probs")
        weights, sums = rollout_correction(inputs.old_logp, inputs.behaviour_logp, inputs.mask,
                                           token_cap=decoupled_is_cap, segment_ids=inputs.segment_ids)
        token_loss, metrics = base(inputs, **options)
        tokens = jnp.maximum(jnp.sum(inputs.mask), 1.0)
        metrics["behaviour_ratio_mean"] = sums["rollout_is_ratio"] / tokens
        metrics["behaviour_ratio_capped"] = sums["rollout_is_capped"] / tokens
        return importance_weighted(token_loss, weights, inputs.mask), metrics

    # Its options: base's and the cap, as keyword arguments with defaults (what the registry reads).
    base_signature = inspect.signature(base.fn)
    cap = inspect.Parameter("decoupled_is_cap", inspect.Parameter.KEYWORD_ONLY, default=5.0, annotation=float)
    loss.__signature__ = base_signature.replace(parameters=[*base_signature.parameters.values(), cap])
    loss.__doc__ = decoupled_objective.__doc__
    return as_policy_loss(loss, f"decoupled {base.name}",
                          {**base.checks, "decoupled_is_cap": (lambda v: v > 1, "must be > 1")})


@register_policy_loss("cispo", checks={"eps_high": _POSITIVE})
def cispo(inputs: LossInputs, *, eps_high: float = 0.28):
    """CISPO (MiniMax-M1, 2025): REINFORCE with the importance weight clipped and held constant, so every
    token keeps a gradient (the clip bounds its weight instead of dropping it):

      l_t = -sg[min(rho_t, 1 + eps_high)] A_t logp_t,   rho_t = exp(clip(logp_t - old_logp_t, -20, 20))

    Metrics: clip_frac (rho > 1 + eps_high, any advantage), ratio_mean."""
    ratio = jnp.exp(inputs.log_ratio)
    weight = jax.lax.stop_gradient(jnp.minimum(ratio, 1.0 + eps_high))
    token_loss = -weight * inputs.advantages * inputs.logp
    return token_loss, {"clip_frac": inputs.mean((ratio > 1.0 + eps_high).astype(inputs.mask.dtype)),
                        "ratio_mean": inputs.mean(ratio)}


@register_policy_loss("sapo", checks={"sapo_tau_pos": _POSITIVE, "sapo_tau_neg": _POSITIVE})
def sapo(inputs: LossInputs, *, sapo_tau_pos: float = 1.0, sapo_tau_neg: float = 1.05):
    """SAPO (Gao et al. 2025, Soft Adaptive Policy Optimization): a smooth gate in place of the hard clip,
    steeper for negative advantages; its gradient weight 4 s (1 - s) is 1 on-policy and fades off-policy:

      tau_t = sapo_tau_pos if A_t > 0 else sapo_tau_neg,   s_t = sigmoid(tau_t (rho_t - 1))
      l_t = -A_t (4 / tau_t) s_t

    Metrics: gate_mean (mean of 4 s (1 - s), the gradient's weight), ratio_mean."""
    ratio = jnp.exp(inputs.log_ratio)
    tau = jnp.where(inputs.advantages > 0, sapo_tau_pos, sapo_tau_neg).astype(inputs.mask.dtype)
    gate = jax.nn.sigmoid(tau * (ratio - 1.0))
    token_loss = -inputs.advantages * gate * (4.0 / tau)
    return token_loss, {"gate_mean": inputs.mean(4.0 * gate * (1.0 - gate)), "ratio_mean": inputs.mean(ratio)}


_DECOUPLED_PPO = decoupled_objective(POLICY_LOSSES["ppo"])
register_policy_loss("decoupled", checks=_DECOUPLED_PPO.checks)(_DECOUPLED_PPO.fn)


def compute_policy_loss(
    loss: str | PolicyLoss,
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    loss_mask: jax.Array,
    *,
    options: Mapping[str, Any] | None = None,
    behaviour_logp: jax.Array | None = None,
    ref_logp: jax.Array | None = None,
    kl: str = "k3",
    kl_coef: float | jax.Array = 0.0,
    entropy: jax.Array | None = None,
    entropy_coef: float | jax.Array = 0.0,
    agg: str = "token_mean",
    normalizer: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    is_weights: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The registered policy loss ``loss`` (a name, ``module:function`` or a ``PolicyLoss``) with its
    ``options`` (others' ignored, missing ones at their defaults), to minimise:

      loss = agg(w l) + kl_coef * agg(KL_kl(logp, ref_logp)) - entropy_coef * agg(entropy)

    l the loss's per-token loss, w the constant ``is_weights`` (1 when not given), agg ``aggregate_loss``
    with ``agg`` and ``normalizer``. Inputs ``[B, T]`` (``advantages`` also ``[B]``), masked and checked as
    :func:`policy_loss`'s; ``old_logp``, ``behaviour_logp``, ``ref_logp``, ``advantages`` are constants.
    Metrics (no gradient): the loss's, approx_kl (mean(old_logp - logp) per token), pg_loss = agg(w l), and
    kl_loss / entropy when those terms are present. Returns (loss, metrics), scalars in float32 (float64
    for float64 inputs)."""
    loss_mask, logp, old_logp, advantages = _checked_tokens(loss_mask, logp, old_logp, advantages, agg=agg)
    _checks.check_option("kl", kl, KL_ESTIMATORS)
    _require_term("kl_coef", kl_coef, "ref_logp", ref_logp)
    _require_term("entropy_coef", entropy_coef, "entropy", entropy)
    entry = loss if isinstance(loss, PolicyLoss) else get_policy_loss(loss)
    resolved = entry.resolve(options or {})
    dtype = _checks.compute_dtype(logp.dtype)
    mask = loss_mask.astype(dtype)

    def constant(name, x):
        return None if x is None else jax.lax.stop_gradient(
            _masked(_token_array(name, x, mask.shape).astype(dtype), mask))

    logp = _masked(logp.astype(dtype), mask)
    inputs = LossInputs(logp, constant("old_logp", old_logp), _token_advantages(advantages, mask), mask,
                        segment_ids, constant("behaviour_logp", behaviour_logp))
    token_loss, loss_metrics = entry(inputs, **resolved)
    if is_weights is not None:
        token_loss = importance_weighted(token_loss, _token_array("is_weights", is_weights, mask.shape), mask)
    pg_loss = _aggregate(token_loss, mask, agg, normalizer)
    metrics = {"pg_loss": pg_loss, **loss_metrics, "approx_kl": inputs.mean(-inputs.log_ratio)}
    total = _with_kl_and_entropy(pg_loss, metrics, logp, mask, ref_logp=ref_logp, kl=kl, kl_coef=kl_coef,
                                 entropy=entropy, entropy_coef=entropy_coef, agg=agg, normalizer=normalizer)
    return total, jax.tree.map(jax.lax.stop_gradient, metrics)




def policy_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    loss_mask: jax.Array,
    *,
    eps_low: float | jax.Array = 0.2,
    eps_high: float | jax.Array = 0.28,
    dual_clip: float | None = 3.0,
    ref_logp: jax.Array | None = None,
    kl: str = "k3",
    kl_coef: float | jax.Array = 0.0,
    entropy: jax.Array | None = None,
    entropy_coef: float | jax.Array = 0.0,
    agg: str = "token_mean",
    normalizer: jax.Array | None = None,
    importance_sampling_level: str = "token",
    segment_ids: jax.Array | None = None,
    is_weights: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO/GRPO clipped-surrogate loss (to minimise) with clip-higher (rStar2-Agent Eq. 6, DAPO).

    Per token, with rho = exp(clip(x, -20, 20)) and A the advantage (per sequence ``[B]``, broadcast over
    tokens, or per token ``[B, T]``), where x = logp - old_logp (``importance_sampling_level="token"``) or
    GSPO's x = ``gspo_log_ratio`` (``"sequence"``: the sequence's mean log-ratio as value, the token's
    gradient; sequences are rows, or the segments of ``segment_ids`` in a packed batch):

      l = max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high))
      l = min(l, -A c)   where A < 0, if ``dual_clip`` = c > 1 (Ye et al. 2020; verl's clip_ratio_c = 3, the
                         default; ``None`` turns it off)
      l = w l            with ``is_weights`` w (constants, e.g. ``rollout_correction``'s), if given

      loss = agg(l) + kl_coef * agg(KL_kl(logp, ref_logp)) - entropy_coef * agg(entropy)

    agg is ``aggregate_loss`` with mode ``agg`` and ``normalizer`` (see the module doc for micro-batching).
    The KL term needs ``ref_logp`` and the entropy term ``entropy`` (per-token policy entropy, carrying the
    gradient); both are skipped when not given. GRPO-RoC uses the defaults: no KL, no entropy, eps 0.2/0.28,
    token_mean (and, as the released code on verl, dual-clip c = 3). ``old_logp``, ``ref_logp``,
    ``advantages`` and ``is_weights`` are treated as constants (stop_gradient). Masked-out positions are
    zeroed before use (module doc), so NaN/Inf there do not reach the loss or its gradient.

    Metrics (masked token means over this call's ``loss_mask``, no gradient):
      clip_frac_high: A > 0 and rho > 1 + eps_high (the upper clip is active);
      clip_frac_low: A < 0 and rho < 1 - eps_low (the lower clip is active);
      clip_frac: their sum (verl's pg_clipfrac); dual_clip_frac: A < 0 and rho > c (verl's
      pg_clipfrac_lower; 0 without dual clip); approx_kl: mean(old_logp - logp) (verl's ppo_kl, per token at
      either level); ratio_mean: mean(rho); pg_loss; and kl_loss / entropy when those terms are present.

    Returns:
      (loss, metrics): a scalar in float32 (float64 for float64 inputs) and a dict of scalars.
    """
    return _surrogate(_CLIPPED, logp, old_logp, advantages, loss_mask, eps_low=eps_low, eps_high=eps_high,
                      dual_clip=dual_clip, ref_logp=ref_logp, kl=kl, kl_coef=kl_coef, entropy=entropy,
                      entropy_coef=entropy_coef, agg=agg, normalizer=normalizer,
                      importance_sampling_level=importance_sampling_level, segment_ids=segment_ids,
                      is_weights=is_weights)


#: ``policy_loss``'s surrogate by importance-sampling level, under its option names (eps_low, eps_high,
#: dual_clip, level-independent): the ``ppo`` loss's function at either level.
_CLIPPED = {level: as_policy_loss(functools.partial(_clipped, level=level), f"clipped surrogate ({level})")
            for level in IS_LEVELS}
_DECOUPLED_CLIPPED = {level: decoupled_objective(entry) for level, entry in _CLIPPED.items()}


def decoupled_policy_loss(
    logp: jax.Array,
    proximal_logp: jax.Array,
    behaviour_logp: jax.Array,
    advantages: jax.Array,
    loss_mask: jax.Array,
    *,
    is_cap: float = 5.0,
    is_weights: jax.Array | None = None,
    **options,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """AReaL's decoupled PPO objective (Fu et al. 2025, "AReaL", Eq. 5), to minimise: the tokens were sampled
    by an older behaviour policy pi_behav (the engine's log-probs ``behaviour_logp``), the update is clipped
    against the proximal policy pi_prox the update starts from (``proximal_logp``, recomputed by the
    trainer), and each token is weighted by the truncated behaviour-to-proximal importance ratio:

      u_t = exp(clip(logp_t - prox_t, -20, 20))                        (current over proximal)
      w_t = min(exp(clip(prox_t - behav_t, -20, 20)), C)               (C = ``is_cap``, a constant)
      l_t = w_t max(-A_t u_t, -A_t clip(u_t, 1 - eps_low, 1 + eps_high))    (dual-clipped for A_t < 0)
      loss = agg(l) (+ the KL / entropy terms of ``policy_loss``)

    ``options`` are :func:`policy_loss`'s (clip ranges, dual clip, aggregation, normaliser, KL, entropy,
    importance-sampling level); ``is_weights`` (e.g. a sequence mask of ``rollout_correction``) multiply w.
    ``proximal_logp`` and ``behaviour_logp`` are constants. With pi_behav = pi_prox (on-policy) w = 1 and this
    is ``policy_loss``. Metrics: ``policy_loss``'s (its ``ratio_mean`` and clip fractions are u's) plus
    ``behaviour_ratio_mean`` (mean of pi_prox / pi_behav over the loss tokens, before truncation) and
    ``behaviour_ratio_capped`` (the share of loss tokens whose ratio exceeded C).
    """
    return _surrogate(_DECOUPLED_CLIPPED, logp, proximal_logp, advantages, loss_mask,
                      behaviour_logp=behaviour_logp, is_cap=is_cap, is_weights=is_weights, **options)


def _surrogate(objectives, logp, old_logp, advantages, loss_mask, *, behaviour_logp=None, is_cap=None,
               eps_low=0.2, eps_high=0.28, dual_clip=3.0, ref_logp=None, kl="k3", kl_coef=0.0, entropy=None,
               entropy_coef=0.0, agg="token_mean", normalizer=None, importance_sampling_level="token",
               segment_ids=None, is_weights=None):
    """:func:`policy_loss` (``objectives``: ``_CLIPPED``) or :func:`decoupled_policy_loss`
    (``_DECOUPLED_CLIPPED``, with ``behaviour_logp`` and ``is_cap``)."""
    _check_policy_loss_options(kl=kl, importance_sampling_level=importance_sampling_level, kl_coef=kl_coef,
                               ref_logp=ref_logp, entropy_coef=entropy_coef, entropy=entropy,
                               dual_clip=dual_clip)
    options = dict(eps_low=eps_low, eps_high=eps_high, dual_clip=dual_clip, decoupled_is_cap=is_cap)
    return compute_policy_loss(
        objectives[importance_sampling_level], logp, old_logp, advantages, loss_mask, options=options,
        behaviour_logp=behaviour_logp, ref_logp=ref_logp, kl=kl, kl_coef=kl_coef, entropy=entropy,
        entropy_coef=entropy_coef, agg=agg, normalizer=normalizer, segment_ids=segment_ids,
        is_weights=is_weights)
