"""Float64 NumPy references, written loop-by-loop from the formulas (one group / one sequence at a time)."""

from __future__ import annotations

import itertools
import math

import numpy as np


def group_advantages(rewards, mask, *, estimator, std, eps):
    rewards = np.asarray(rewards, np.float64)
    out = np.zeros_like(rewards)
    for g in range(rewards.shape[0]):
        idx = np.flatnonzero(np.asarray(mask[g]) != 0)
        r = rewards[g, idx]
        n = len(r)
        if n <= 1 or r.max() == r.min():
            continue
        mean = r.mean()
        if estimator == "grpo":
            sd = r.std(ddof=0 if std == "population" else 1)
            out[g, idx] = (r - mean) / (sd + eps)
        elif estimator == "dr_grpo":
            out[g, idx] = r - mean
        elif estimator == "rloo":
            out[g, idx] = [r[i] - (r.sum() - r[i]) / (n - 1) for i in range(n)]
        else:
            raise ValueError(estimator)
    return out


def _kl(x, kind):
    """Value and d/dx of the per-token KL estimate, x = logp - ref_logp."""
    base = kind.rstrip("+")
    if base == "k1":
        value, grad = x, 1.0
    elif base == "k2":
        value, grad = 0.5 * x * x, x
    else:
        y = -min(max(x, -20.0), 20.0)
        raw = math.exp(y) - y - 1.0
        value = min(max(raw, -10.0), 10.0)
        grad = (1.0 - math.exp(y)) if (-10.0 < raw < 10.0 and -20.0 < x < 20.0) else 0.0
    if kind.endswith("+"):
        grad = x  # straight-through: the gradient of k2
    return value, grad


def log_ratio(logp, old_logp, mask, level="token"):
    """The bounded log-ratio of every loss token (0 elsewhere): token level logp - old_logp; sequence level
    (GSPO) the mean of the row's loss-token log-ratios, at each of its tokens; clipped to +-20."""
    logp, old_logp, mask = (np.asarray(a, np.float64) for a in (logp, old_logp, mask))
    out = np.zeros_like(logp)
    for b in range(logp.shape[0]):
        tokens = [t for t in range(logp.shape[1]) if mask[b, t]]
        mean = sum(logp[b, t] - old_logp[b, t] for t in tokens) / max(len(tokens), 1)
        for t in tokens:
            raw = mean if level == "sequence" else logp[b, t] - old_logp[b, t]
            out[b, t] = min(max(raw, -20.0), 20.0)
    return out


def surrogate(a, rho, eps_low, eps_high):
    """One token's clipped surrogate max(-A rho, -A clip(rho, 1 - eps_low, 1 + eps_high)) and its
    derivative in rho."""
    unclipped = -a * rho
    clipped = -a * min(max(rho, 1 - eps_low), 1 + eps_high)
    return max(unclipped, clipped), (-a if unclipped >= clipped else 0.0)


def dual_clipped(loss, a, c):
    """One token's dual-clipped loss min(loss, -A c) for A < 0, and whether the clip holds it (then its
    derivative is 0)."""
    if c is not None and a < 0 and -a * c < loss:
        return -a * c, True
    return loss, False


def policy_loss(logp, old_logp, advantages, loss_mask, *, eps_low=0.2, eps_high=0.28, dual_clip=3.0,
                ref_logp=None, kl="k3", kl_coef=0.0, entropy=None, entropy_coef=0.0, agg="token_mean",
                normalizer=None, importance_sampling_level="token", is_weights=None):
    """Loss, metrics and the gradients d loss / d logp and d loss / d entropy.

    ``importance_sampling_level="sequence"``: GSPO-token, one ratio s_b = exp(mean of row b's loss-token
    log-ratios) for the whole row, and d s_bt / d logp_bt = s_b (the token's own log-prob only).
    """
    logp, old_logp, mask = (np.asarray(a, np.float64) for a in (logp, old_logp, loss_mask))
    weights_is = np.ones_like(logp) if is_weights is None else np.asarray(is_weights, np.float64)
    adv = np.asarray(advantages, np.float64)
    if adv.ndim == 1:
        adv = np.repeat(adv[:, None], logp.shape[1], axis=1)
    batch, horizon = logp.shape
    lengths = mask.sum(axis=1)
    if normalizer is None:
        if agg == "token_mean":
            normalizer = mask.sum()
        elif agg == "seq_mean_token_sum_norm":  # verl: sum over sequences of token sums, / T
            normalizer = float(horizon)
        else:
            normalizer = float(np.sum(lengths > 0))
    # weight[b, t]: d loss / d (token value) for a loss token under this aggregation.
    weight = np.zeros_like(logp)
    for b in range(batch):
        if agg in ("token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm"):
            per_token = 1.0
        elif agg == "seq_mean_token_mean":
            per_token = 1.0 / max(lengths[b], 1.0)
        else:
            per_token = 1.0 / horizon
        weight[b] = mask[b] * per_token / normalizer if normalizer > 0 else 0.0

    pg = np.zeros_like(logp)
    grad_logp = np.zeros_like(logp)
    counts = dict(high=0.0, low=0.0, dual=0.0, kl=0.0, ratio=0.0)
    kl_value = np.zeros_like(logp)
    seq_log_ratio = [
        sum(logp[b, t] - old_logp[b, t] for t in range(horizon) if mask[b, t]) / max(lengths[b], 1.0)
        for b in range(batch)
    ]
    for b, t in itertools.product(range(batch), range(horizon)):
        if not mask[b, t]:
            continue
        a = adv[b, t]
        token_raw = logp[b, t] - old_logp[b, t]
        raw = seq_log_ratio[b] if importance_sampling_level == "sequence" else token_raw
        rho = math.exp(min(max(raw, -20.0), 20.0))
        loss, d_rho = surrogate(a, rho, eps_low, eps_high)
        d = d_rho * rho if -20.0 < raw < 20.0 else 0.0
        loss, held = dual_clipped(loss, a, dual_clip)
        d = 0.0 if held else d
        pg[b, t] = loss * weights_is[b, t]
        grad_logp[b, t] += weight[b, t] * d * weights_is[b, t]
        if ref_logp is not None:
            kl_value[b, t], dk = _kl(logp[b, t] - ref_logp[b, t], kl)
            grad_logp[b, t] += kl_coef * weight[b, t] * dk
        if mask[b, t]:
            counts["high"] += a > 0 and rho > 1 + eps_high
            counts["low"] += a < 0 and rho < 1 - eps_low
            counts["dual"] += dual_clip is not None and a < 0 and rho > dual_clip
            counts["kl"] += -min(max(token_raw, -20.0), 20.0)
            counts["ratio"] += rho
    pg_loss = float(np.sum(weight * pg))
    total = pg_loss
    tokens = max(mask.sum(), 1.0)
    metrics = {
        "pg_loss": pg_loss,
        "clip_frac_high": counts["high"] / tokens,
        "clip_frac_low": counts["low"] / tokens,
        "clip_frac": (counts["high"] + counts["low"]) / tokens,
        "dual_clip_frac": counts["dual"] / tokens,
        "approx_kl": counts["kl"] / tokens,
        "ratio_mean": counts["ratio"] / tokens,
    }
    if ref_logp is not None:
        metrics["kl_loss"] = float(np.sum(weight * kl_value))
        total += kl_coef * metrics["kl_loss"]
    grad_entropy = None
    if entropy is not None:
        metrics["entropy"] = float(np.sum(weight * np.asarray(entropy, np.float64)))
        total -= entropy_coef * metrics["entropy"]
        grad_entropy = -entropy_coef * weight
    return total, metrics, grad_logp, grad_entropy


def release_budgets(n_neg, n_pos, keep, min_negatives, min_positives):
    """The released code's per-class budgets (Python ``round``), with rstar2jax's documented completion."""
    n = n_neg + n_pos
    if n == 0:
        return 0, 0
    neg, pos = round(n_neg * keep / n), round(n_pos * keep / n)
    if neg <= min(min_negatives, n_neg):
        neg = min(min_negatives, n_neg)
        pos = keep - neg
    if pos <= min(min_positives, n_pos):
        pos = min(min_positives, n_pos)
        neg = keep - pos
    neg = max(0, min(neg, n_neg, keep))
    pos = max(0, min(pos, n_pos, keep - neg))
    missing = min(keep, n) - neg - pos
    extra = min(missing, n_pos - pos)
    return neg + missing - extra, pos + extra


def inclusion_probabilities(weights, k):
    """P(i among k successive draws without replacement, each P ∝ weight), by enumerating ordered draws."""
    weights = np.asarray(weights, np.float64)
    probs = np.zeros(len(weights))
    for order in itertools.permutations(range(len(weights)), k):
        p, remaining = 1.0, weights.sum()
        for i in order:
            p *= weights[i] / remaining
            remaining -= weights[i]
        probs[list(order)] += p
    return probs


def rollout_correction(train_logp, rollout_logp, loss_mask, *, token_cap, sequence_mask, mask_threshold):
    """Weights and metric sums of verl's truncated (token) / masked (sequence) importance sampling, row by
    row: r_t = pi_train / pi_rollout; w_t = min(r_t, C); a row is dropped when its product ("sequence") or
    geometric mean ("geometric") of r_t over loss tokens leaves [1/C', C']."""
    train_logp, rollout_logp = np.asarray(train_logp, np.float64), np.asarray(rollout_logp, np.float64)
    mask = np.asarray(loss_mask, np.float64)
    weights = np.zeros_like(mask)
    sums = dict(rollout_is_ratio=0.0, rollout_is_capped=0.0, rollout_is_masked=0.0)
    for b in range(mask.shape[0]):
        idx = np.flatnonzero(mask[b])
        r = np.exp(train_logp[b, idx] - rollout_logp[b, idx])
        sums["rollout_is_ratio"] += r.sum()
        w = np.ones_like(r)
        if token_cap is not None:
            w = np.minimum(r, token_cap)
            sums["rollout_is_capped"] += np.sum(r > token_cap)
        if sequence_mask is not None and len(idx):
            seq = np.prod(r) if sequence_mask == "sequence" else np.prod(r) ** (1.0 / len(idx))
            if not 1.0 / mask_threshold <= seq <= mask_threshold:
                w[:] = 0.0
                sums["rollout_is_masked"] += len(idx)
        weights[b, idx] = w
    return weights, sums


def decoupled_policy_loss(logp, proximal_logp, behaviour_logp, advantages, loss_mask, *, is_cap, **options):
    """AReaL's decoupled objective: :func:`policy_loss` against the proximal log-probs with each token
    weighted by w_t = min(pi_prox / pi_behav, C); plus the behaviour ratios' mean and capped share."""
    mask = np.asarray(loss_mask, np.float64)
    ratio = np.exp(np.asarray(proximal_logp, np.float64) - np.asarray(behaviour_logp, np.float64))
    weights = np.where(mask > 0, np.minimum(ratio, is_cap), 0.0)
    total, metrics, grad_logp, _ = policy_loss(logp, proximal_logp, advantages, loss_mask, is_weights=weights,
                                               **options)
    tokens = max(mask.sum(), 1.0)
    metrics["behaviour_ratio_mean"] = float(np.sum(ratio * mask)) / tokens
    metrics["behaviour_ratio_capped"] = float(np.sum((ratio > is_cap) * mask)) / tokens
    return total, metrics, grad_logp


def _token_mean_loss(logp, old_logp, advantages, loss_mask, token_loss_and_grad):
    """Token-mean of ``token_loss_and_grad(a, rho, logp) -> (l, dl/dlogp)`` over the loss tokens: the loss
    and d loss / d logp (float64), with rho = exp(clip(logp - old_logp, -20, 20))."""
    logp, old_logp, mask = (np.asarray(a, np.float64) for a in (logp, old_logp, loss_mask))
    adv = np.asarray(advantages, np.float64)
    if adv.ndim == 1:
        adv = np.repeat(adv[:, None], logp.shape[1], axis=1)
    tokens = mask.sum()
    total, grad = 0.0, np.zeros_like(logp)
    for b, t in itertools.product(range(logp.shape[0]), range(logp.shape[1])):
        if mask[b, t]:
            rho = math.exp(min(max(logp[b, t] - old_logp[b, t], -20.0), 20.0))
            value, d = token_loss_and_grad(adv[b, t], rho, logp[b, t])
            total += value / tokens
            grad[b, t] = d / tokens
    return total, grad


def cispo_loss(logp, old_logp, advantages, loss_mask, *, eps_high):
    """CISPO: l = -min(rho, 1 + eps_high) A logp, the weight a constant: dl/dlogp = -min(rho, 1 + eps) A."""

    def token(a, rho, lp):
        weight = min(rho, 1.0 + eps_high)
        return -weight * a * lp, -weight * a

    return _token_mean_loss(logp, old_logp, advantages, loss_mask, token)


def sapo_loss(logp, old_logp, advantages, loss_mask, *, tau_pos, tau_neg):
    """SAPO: l = -A (4 / tau) sigmoid(tau (rho - 1)); dl/dlogp = -A 4 s (1 - s) rho."""

    def token(a, rho, lp):
        tau = tau_pos if a > 0 else tau_neg
        s = 1.0 / (1.0 + math.exp(-tau * (rho - 1.0)))
        return -a * 4.0 / tau * s, -a * 4.0 * s * (1.0 - s) * rho

    return _token_mean_loss(logp, old_logp, advantages, loss_mask, token)
