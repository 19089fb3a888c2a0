"""The pieces ``policy_loss`` is composed of, each alone against the float64 NumPy reference, eager and
under ``jax.jit``; composed by hand they give ``policy_loss``'s own result, bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstar2jax import algo
from tests.algo import reference
from tests.algo.test_losses import make_batch

JIT = pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])


def _maybe_jit(fn, jit):
    return jax.jit(fn) if jit else fn


def _ratios_and_advantages(seed=0, shape=(5, 7)):
    rng = np.random.default_rng(seed)
    rho = np.exp(rng.normal(0.0, 0.6, shape)).astype(np.float32)
    rho[0, :4] = [0.5, 0.81, 1.27, 1.4]  # both sides of both clip bounds
    advantages = rng.normal(0.0, 1.0, shape).astype(np.float32)
    advantages[0, :4] = [-1.0, -1.0, 1.0, 1.0]
    return rho, advantages


@JIT
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_importance_log_ratio_matches_the_reference(jit, level):
    batch, _, _ = make_batch(seed=4)
    logp, old_logp, mask = batch["logp"], batch["old_logp"], batch["loss_mask"]
    old_logp = old_logp.copy()
    old_logp[0, 0] = logp[0, 0] + 30.0  # a log-ratio of -30: bounded at -20
    masked = lambda x: np.where(mask > 0, x, 0.0).astype(np.float32)  # the caller masks its inputs
    ratio = _maybe_jit(lambda a, b, m: algo.importance_log_ratio(a, b, m, level=level), jit)
    got = np.asarray(ratio(masked(logp), masked(old_logp), mask))
    want = reference.log_ratio(logp, old_logp, mask, level=level)
    np.testing.assert_allclose(got * mask, want, rtol=1e-5, atol=1e-6)
    if level == "token":
        assert got[0, 0] == -20.0


@JIT
def test_gspo_ratio_carries_each_tokens_own_gradient(jit):
    batch, _, _ = make_batch(seed=6)
    logp, old_logp, mask = (jnp.asarray(batch[k]) for k in ("logp", "old_logp", "loss_mask"))
    ratio = lambda lp: jnp.exp(algo.importance_log_ratio(lp, old_logp, mask, level="sequence"))
    grad = np.asarray(_maybe_jit(jax.grad(lambda lp: jnp.sum(ratio(lp) * mask)), jit)(logp))
    rows = np.exp(reference.log_ratio(logp, old_logp, mask, level="sequence"))
    np.testing.assert_allclose(grad, rows * np.asarray(mask), rtol=1e-5, atol=1e-7)  # d s_bt/d logp_bt = s_b


@JIT
def test_clipped_surrogate_matches_the_reference_with_its_gradient(jit):
    rho, advantages = _ratios_and_advantages()
    surrogate = lambda r: algo.clipped_surrogate(jnp.asarray(advantages), r, eps_low=0.2, eps_high=0.28)
    value = np.asarray(_maybe_jit(surrogate, jit)(rho))
    grad = np.asarray(_maybe_jit(jax.grad(lambda r: jnp.sum(surrogate(r))), jit)(rho))
    for index in np.ndindex(rho.shape):
        want_value, want_grad = reference.surrogate(float(advantages[index]), float(rho[index]), 0.2, 0.28)
        np.testing.assert_allclose(value[index], want_value, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(grad[index], want_grad, rtol=1e-6, atol=1e-7)
    assert value[0, 1] == pytest.approx(0.81) and grad[0, 0] == 0.0  # A < 0 held at 1 - eps_low


@JIT
def test_dual_clipped_bounds_negative_advantages_only(jit):
    rho, advantages = _ratios_and_advantages(seed=1)
    rho[0, :3] = [5.0, 5.0, 0.5]
    advantages[0, :3] = [-1.0, 1.0, -1.0]
    token_loss = np.asarray(algo.clipped_surrogate(advantages, rho, eps_low=0.2, eps_high=0.28))
    clipped = lambda loss: algo.dual_clipped(loss, jnp.asarray(advantages), 3.0)
    value = np.asarray(_maybe_jit(clipped, jit)(token_loss))
    grad = np.asarray(_maybe_jit(jax.grad(lambda loss: jnp.sum(clipped(loss))), jit)(token_loss))
    for index in np.ndindex(rho.shape):
        want, held = reference.dual_clipped(float(token_loss[index]), float(advantages[index]), 3.0)
        np.testing.assert_allclose(value[index], want, rtol=1e-6)
        assert grad[index] == (0.0 if held else 1.0)
    assert value[0, 0] == 3.0 and value[0, 1] == token_loss[0, 1]  # -A c = 3 holds A < 0; A > 0 untouched


@JIT
def test_importance_weighted_scales_by_constants_and_masks_their_nan(jit):
    token_loss = np.arange(6, dtype=np.float32).reshape(2, 3)
    weights = np.array([[0.5, 2.0, np.nan], [1.0, 1.5, 3.0]], np.float32)
    mask = np.array([[1, 1, 0], [1, 1, 1]], np.float32)
    weighted = _maybe_jit(algo.importance_weighted, jit)
    np.testing.assert_allclose(weighted(token_loss, weights, mask), [[0.0, 2.0, 0.0], [3.0, 6.0, 15.0]])
    grad_w = jax.grad(lambda w: jnp.sum(weighted(jnp.asarray(token_loss), w, mask)))(jnp.asarray(weights))
    assert np.all(np.asarray(grad_w) == 0.0)  # the weights are constants of the loss


@JIT
@pytest.mark.parametrize("estimator", sorted(algo.KL_ESTIMATORS))
def test_kl_penalty_matches_the_reference_per_token(jit, estimator):
    rng = np.random.default_rng(2)
    logp = -np.abs(rng.normal(1.0, 0.5, (3, 5))).astype(np.float32)
    ref_logp = (logp + rng.normal(0.0, 1.0, (3, 5))).astype(np.float32)
    kl = lambda lp: algo.kl_penalty(lp, jnp.asarray(ref_logp), estimator=estimator)
    value = np.asarray(_maybe_jit(kl, jit)(logp))
    grad = np.asarray(_maybe_jit(jax.grad(lambda lp: jnp.sum(kl(lp))), jit)(logp))
    for index in np.ndindex(logp.shape):
        want_value, want_grad = reference._kl(float(logp[index]) - float(ref_logp[index]), estimator)
        np.testing.assert_allclose(value[index], want_value, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(grad[index], want_grad, rtol=1e-5, atol=1e-6)


@JIT
@pytest.mark.parametrize("agg", algo.AGG_MODES)
def test_the_pieces_composed_by_hand_are_policy_loss(jit, agg):
    """The GRPO-RoC loss (clip-higher, dual clip, importance weights) built from the public pieces equals
    ``policy_loss``'s, bit for bit; so does its KL term."""
    batch, ref_logp, _ = make_batch(seed=9)
    weights = np.random.default_rng(9).uniform(0.5, 1.5, batch["loss_mask"].shape).astype(np.float32)
    mask = jnp.asarray(batch["loss_mask"])

    def by_hand(logp, old_logp, advantages):
        logp, old_logp = algo.masked_values(logp, mask), algo.masked_values(old_logp, mask)
        advantages = algo.masked_values(jnp.broadcast_to(advantages[:, None], mask.shape), mask)
        ratio = jnp.exp(algo.importance_log_ratio(logp, old_logp, mask))
        token_loss = algo.clipped_surrogate(advantages, ratio, eps_low=0.2, eps_high=0.28)
        token_loss = algo.importance_weighted(algo.dual_clipped(token_loss, advantages, 3.0), weights, mask)
        kl = algo.kl_penalty(logp, algo.masked_values(jnp.asarray(ref_logp), mask), estimator="k3")
        return algo.aggregate_loss(token_loss, mask, agg=agg), algo.aggregate_loss(kl, mask, agg=agg)

    def composed(logp, old_logp, advantages):
        _, metrics = algo.policy_loss(logp, old_logp, advantages, mask, agg=agg, is_weights=weights,
                                      ref_logp=ref_logp, kl_coef=0.1)
        return metrics["pg_loss"], metrics["kl_loss"]

    args = (batch["logp"], batch["old_logp"], batch["advantages"])
    got, want = _maybe_jit(by_hand, jit)(*args), _maybe_jit(composed, jit)(*args)
    for a, b in zip(got, want, strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_the_pieces_name_bad_inputs():
    x = np.zeros((2, 3), np.float32)
    with pytest.raises(ValueError, match=r"ratio must have the shape of advantages \(2, 3\)"):
        algo.clipped_surrogate(x, np.zeros((2, 4), np.float32), eps_low=0.2, eps_high=0.28)
    with pytest.raises(ValueError, match="token_loss must have the shape of advantages"):
        algo.dual_clipped(np.zeros((3, 3), np.float32), x, 3.0)
    with pytest.raises(ValueError, match="weights must have the shape of token_loss"):
        algo.importance_weighted(x, np.zeros(3, np.float32), x)
    with pytest.raises(ValueError, match="estimator"):
        algo.kl_penalty(x, x, estimator="k4")
    with pytest.raises(ValueError, match="level"):
        algo.importance_log_ratio(x, x, x, level="segment")
    with pytest.raises(ValueError, match="old_logp must have the shape of logp"):
        algo.importance_log_ratio(x, np.zeros((2, 2), np.float32), x)
