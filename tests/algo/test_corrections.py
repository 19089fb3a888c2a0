"""Rollout correction, GSPO over packed rows, importance weights in the loss, and masked NaN/Inf inputs."""

import jax
import numpy as np
import pytest

from rstar2jax import algo
from tests.algo import reference
from tests.algo.test_losses import make_batch


def rollout_batch(seed, batch=6, horizon=10, spread=0.4):
    rng = np.random.default_rng(seed)
    rollout_logp = -np.abs(rng.normal(1.0, 0.5, (batch, horizon))).astype(np.float32)
    train_logp = (rollout_logp + rng.normal(0.0, spread, (batch, horizon))).astype(np.float32)
    lengths = rng.integers(1, horizon + 1, batch)
    lengths[1] = 0
    mask = (np.arange(horizon)[None, :] < lengths[:, None]).astype(np.float32)
    return train_logp, rollout_logp, mask


@pytest.mark.parametrize("sequence_mask", [None, "sequence", "geometric"])
@pytest.mark.parametrize("token_cap", [None, 2.0, 1.2])
def test_rollout_correction_matches_reference(token_cap, sequence_mask):
    train_logp, rollout_logp, mask = rollout_batch(seed=3)
    threshold = 1.5 if sequence_mask == "sequence" else 1.1
    kwargs = dict(token_cap=token_cap, sequence_mask=sequence_mask, mask_threshold=threshold)
    weights, sums = jax.jit(lambda a, b, m: algo.rollout_correction(a, b, m, **kwargs))(
        train_logp, rollout_logp, mask
    )
    want_weights, want_sums = reference.rollout_correction(train_logp, rollout_logp, mask, **kwargs)
    np.testing.assert_allclose(weights, want_weights, rtol=1e-5, atol=1e-6)
    assert set(sums) == set(want_sums)
    for name, value in want_sums.items():
        np.testing.assert_allclose(sums[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    if token_cap == 1.2:
        assert want_sums["rollout_is_capped"] > 0
    if sequence_mask is not None:
        assert 0 < want_sums["rollout_is_masked"] < mask.sum()  # some rows kept, some dropped


def pack(rows, mask):
    """Rows [B, T] laid end to end in one row per pair of sequences: ([B/2, 2T] arrays, segment ids)."""
    b, t = mask.shape
    packed = [np.concatenate([r[0::2], r[1::2]], axis=1) for r in rows]
    segment_ids = np.concatenate([np.ones((b // 2, t), np.int32), np.full((b // 2, t), 2, np.int32)], axis=1)
    return packed, segment_ids


def test_packed_rows_give_the_unpacked_sequence_ratios():
    train_logp, rollout_logp, mask = rollout_batch(seed=5, batch=6)
    kwargs = dict(token_cap=2.0, sequence_mask="geometric", mask_threshold=1.1)
    weights, sums = algo.rollout_correction(train_logp, rollout_logp, mask, **kwargs)
    (p_train, p_rollout, p_mask, p_weights), segment_ids = pack(
        [train_logp, rollout_logp, mask, np.asarray(weights)], mask
    )
    packed_weights, packed_sums = algo.rollout_correction(
        p_train, p_rollout, p_mask, segment_ids=segment_ids, **kwargs
    )
    np.testing.assert_allclose(packed_weights, p_weights, rtol=1e-6)
    for name in sums:
        np.testing.assert_allclose(packed_sums[name], sums[name], rtol=1e-6)
    # Without segment ids, a packed row would be one sequence: the masking decision changes.
    merged, _ = algo.rollout_correction(p_train, p_rollout, p_mask, **kwargs)
    assert not np.allclose(merged, p_weights)


def test_gspo_over_packed_rows_equals_unpacked():
    batch, _, _ = make_batch(seed=4, batch=6)
    kwargs = dict(importance_sampling_level="sequence", eps_low=3e-4, eps_high=4e-4, dual_clip=None)
    adv_tokens = np.broadcast_to(batch["advantages"][:, None], batch["logp"].shape)

    def loss(logp, old_logp, adv, mask, **extra):
        return algo.policy_loss(logp, old_logp, adv, mask, **kwargs, **extra)[0]

    want, want_grad = jax.value_and_grad(loss)(
        batch["logp"], batch["old_logp"], adv_tokens, batch["loss_mask"]
    )
    (logp, old_logp, adv, mask, grad), segment_ids = pack(
        [batch["logp"], batch["old_logp"], adv_tokens, batch["loss_mask"], np.asarray(want_grad)],
        batch["loss_mask"],
    )
    got, got_grad = jax.value_and_grad(loss)(logp, old_logp, adv, mask, segment_ids=segment_ids)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(got_grad, grad, rtol=1e-5, atol=1e-8)
    merged = loss(logp, old_logp, adv, mask)
    assert abs(float(merged) - float(want)) > 1e-4


@pytest.mark.parametrize("level", algo.IS_LEVELS)
def test_is_weights_scale_the_policy_term(level):
    batch, ref_logp, _ = make_batch(seed=8)
    weights = np.random.default_rng(0).uniform(0.0, 2.0, batch["logp"].shape).astype(np.float32)
    kwargs = dict(importance_sampling_level=level, ref_logp=ref_logp, kl_coef=0.1, agg="seq_mean_token_mean")

    def loss_fn(logp):
        return algo.policy_loss(logp, batch["old_logp"], batch["advantages"], batch["loss_mask"],
                                is_weights=weights, **kwargs)

    (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(batch["logp"])
    want_loss, want_metrics, want_grad, _ = reference.policy_loss(**batch, is_weights=weights, **kwargs)
    np.testing.assert_allclose(loss, want_loss, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(metrics["pg_loss"], want_metrics["pg_loss"], rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nan_and_inf_in_masked_positions_do_not_reach_the_loss(bad, jit):
    batch, ref_logp, entropy = make_batch(seed=9, per_token=True)
    mask = batch["loss_mask"]
    weights = np.ones_like(mask)
    kwargs = dict(kl_coef=0.1, entropy_coef=0.01, agg="seq_mean_token_mean")

    def loss_fn(logp, old_logp, advantages, ref_logp, entropy, weights, level):
        return algo.policy_loss(logp, old_logp, advantages, mask, ref_logp=ref_logp, entropy=entropy,
                                is_weights=weights, importance_sampling_level=level, **kwargs)[0]

    grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 4))
    if jit:
        grad_fn = jax.jit(grad_fn, static_argnums=6)
    clean = (batch["logp"], batch["old_logp"], batch["advantages"], ref_logp, entropy, weights)
    dirty = tuple(np.where(mask > 0, x, np.float32(bad)).astype(np.float32) for x in clean)
    for level in algo.IS_LEVELS:
        want, want_grads = grad_fn(*clean, level)
        got, got_grads = grad_fn(*dirty, level)
        assert np.isfinite(float(want))
        np.testing.assert_allclose(got, want, rtol=1e-6)
        for g, w in zip(got_grads, want_grads, strict=True):
            np.testing.assert_array_equal(np.isfinite(g), True)
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-9)
    values = np.where(mask > 0, entropy, np.float32(bad))
    for agg in algo.AGG_MODES:
        np.testing.assert_allclose(
            algo.aggregate_loss(values, mask, agg=agg), algo.aggregate_loss(entropy, mask, agg=agg), rtol=1e-6
        )
    train_logp = np.where(mask > 0, batch["logp"], np.float32(bad))
    w, sums = algo.rollout_correction(train_logp, batch["old_logp"], mask, sequence_mask="geometric")
    assert np.all(np.isfinite(w)) and all(np.isfinite(float(v)) for v in sums.values())


def test_bad_inputs_name_the_argument():
    batch, _, _ = make_batch(seed=0)
    mask = batch["loss_mask"]
    with pytest.raises(ValueError, match="is_weights must have the shape of loss_mask"):
        algo.policy_loss(**batch, is_weights=mask[:, :3])
    with pytest.raises(TypeError, match="is_weights must be a floating-point array"):
        algo.policy_loss(**batch, is_weights=mask.astype(np.int32))
    with pytest.raises(ValueError, match="unknown importance_sampling_level 'seq'"):
        algo.policy_loss(**batch, importance_sampling_level="seq")
    with pytest.raises(TypeError, match="segment_ids must be an integer array"):
        algo.gspo_log_ratio(batch["logp"], batch["old_logp"], mask, segment_ids=mask)
    with pytest.raises(ValueError, match="segment_ids must have the shape of loss_mask"):
        algo.rollout_correction(batch["logp"], batch["old_logp"], mask, segment_ids=np.ones((6, 3), np.int32))
    with pytest.raises(ValueError, match="rollout_logp must have the shape of loss_mask"):
        algo.rollout_correction(batch["logp"], batch["old_logp"][:2], mask)
    with pytest.raises(TypeError, match="train_logp must be a floating-point array"):
        algo.rollout_correction(mask.astype(np.int32), batch["old_logp"], mask)
    with pytest.raises(ValueError, match="token_cap must be > 1"):
        algo.rollout_correction(batch["logp"], batch["old_logp"], mask, token_cap=0.5)
    with pytest.raises(ValueError, match="unknown sequence_mask 'row'"):
        algo.rollout_correction(batch["logp"], batch["old_logp"], mask, sequence_mask="row")


def test_rollout_mismatch_on_a_hand_made_pair():
    """Four loss tokens with log-ratios 0, ln 1.5, -ln 4, ln 3 (ratios 1, 1.5, 1/4, 3); the second row's
    tokens are masked out, one of them NaN: every figure worked out by hand."""
    d = np.log([1.0, 1.5, 0.25, 3.0])
    rollout = np.array([[-1.0, -2.0, -2.5, -3.0], [-1.0, -1.5, np.nan, -7.0]], np.float32)
    train = np.array([rollout[0] + d, [-1.0, 5.0, -1.0, -1.0]], np.float32)
    mask = np.array([[1, 1, 1, 1], [0, 0, 0, 0]], np.float32)
    metrics = jax.jit(algo.rollout_mismatch)(train, rollout, mask)
    assert float(metrics["mismatch_tokens"]) == 4
    np.testing.assert_allclose(metrics["mismatch_abs_log_ratio"], np.log(1.5 * 4 * 3) / 4, rtol=1e-5)
    # k3 = r - 1 - ln r per token: 0, 0.5 - ln 1.5, -0.75 + ln 4, 2 - ln 3.
    np.testing.assert_allclose(metrics["mismatch_k3_kl"], (1.75 - np.log(1.5) + np.log(4) - np.log(3)) / 4,
                               rtol=1e-5)
    np.testing.assert_allclose(metrics["mismatch_outside_band"], 2 / 4, rtol=1e-6)  # 1/4 and 3 leave [0.5, 2]
    sums = algo.rollout_mismatch(train, rollout, mask, sums=True)
    np.testing.assert_allclose(sums["mismatch_abs_log_ratio"], np.log(18.0), rtol=1e-5)
    assert float(sums["mismatch_outside_band"]) == 2 and float(sums["mismatch_tokens"]) == 4


def test_rollout_mismatch_is_zero_for_equal_log_probs_and_checks_its_input():
    train_logp, _, mask = rollout_batch(seed=7)
    metrics = algo.rollout_mismatch(train_logp, train_logp, mask)
    for name in ("mismatch_abs_log_ratio", "mismatch_k3_kl", "mismatch_outside_band"):
        assert float(metrics[name]) == 0.0, name
    empty = algo.rollout_mismatch(train_logp, train_logp + 1, np.zeros_like(mask))
    assert float(empty["mismatch_tokens"]) == 0 and float(empty["mismatch_abs_log_ratio"]) == 0
    with pytest.raises(ValueError, match="band"):
        algo.rollout_mismatch(train_logp, train_logp, mask, band=(2.0, 0.5))
    with pytest.raises(ValueError, match="rollout_logp must have the shape of loss_mask"):
        algo.rollout_mismatch(train_logp, train_logp[:, :3], mask)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean"])
@pytest.mark.parametrize("dual_clip", [3.0, None])
def test_decoupled_loss_matches_a_numpy_reference(agg, dual_clip):
    """AReaL's decoupled objective: clipped against the proximal policy, weighted by the truncated
    behaviour-to-proximal ratio; value, gradient and the ratio statistics against float64 NumPy."""
    batch, _, _ = make_batch(seed=11)
    rng = np.random.default_rng(4)
    proximal = batch["old_logp"]
    behaviour = (proximal + rng.normal(0.0, 0.8, proximal.shape)).astype(np.float32)  # a stale sampler
    options = dict(agg=agg, dual_clip=dual_clip, eps_low=0.2, eps_high=0.28)

    def loss_fn(logp):
        return algo.decoupled_policy_loss(logp, proximal, behaviour, batch["advantages"], batch["loss_mask"],
                                          is_cap=2.0, **options)

    (loss, metrics), grad = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))(batch["logp"])
    want_loss, want_metrics, want_grad = reference.decoupled_policy_loss(
        batch["logp"], proximal, behaviour, batch["advantages"], batch["loss_mask"], is_cap=2.0, **options)
    np.testing.assert_allclose(loss, want_loss, rtol=2e-5, atol=1e-6)
    np.testing.assert_allclose(grad, want_grad, rtol=2e-5, atol=1e-7)
    assert set(metrics) == set(want_metrics)
    for name, value in want_metrics.items():
        np.testing.assert_allclose(metrics[name], value, rtol=2e-5, atol=1e-6, err_msg=name)
    assert 0 < want_metrics["behaviour_ratio_capped"] < 1  # some tokens truncated, not all
    # On-policy (behaviour = proximal) every weight is 1: the plain clipped loss.
    on_policy, _ = algo.decoupled_policy_loss(batch["logp"], proximal, proximal, batch["advantages"],
                                              batch["loss_mask"], **options)
    plain, _ = algo.policy_loss(batch["logp"], proximal, batch["advantages"], batch["loss_mask"], **options)
    np.testing.assert_allclose(on_policy, plain, rtol=1e-6)
