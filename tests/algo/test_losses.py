import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

from rstar2jax import algo
from tests.algo import reference

# Term configurations: GRPO-RoC's default (dual-clip c = 3); no dual clip; dual-clip with a k3 KL and entropy;
# straight-through KLs; GSPO (sequence-level ratio, its paper's clip range).
CONFIGS = {
    "roc": {},
    "no_dual_clip": dict(dual_clip=None),
    "dual_k3_entropy": dict(dual_clip=3.0, kl="k3", kl_coef=0.1, entropy_coef=0.01),
    "k1_straight_through": dict(kl="k1+", kl_coef=0.05, eps_low=0.1, eps_high=0.15),
    "k3_straight_through": dict(kl="k3+", kl_coef=0.05),
    "k2_per_token_adv": dict(kl="k2", kl_coef=0.2, entropy_coef=0.02),
    "gspo": dict(importance_sampling_level="sequence", eps_low=3e-4, eps_high=4e-4, dual_clip=None),
}


def make_batch(seed, batch=6, horizon=10, per_token=False):
    rng = np.random.default_rng(seed)
    logp = -np.abs(rng.normal(1.0, 0.5, (batch, horizon))).astype(np.float32)
    old_logp = (logp + rng.normal(0.0, 0.35, (batch, horizon))).astype(np.float32)
    ref_logp = (logp + rng.normal(0.0, 0.5, (batch, horizon))).astype(np.float32)
    entropy = rng.uniform(0.1, 2.0, (batch, horizon)).astype(np.float32)
    adv_shape = (batch, horizon) if per_token else (batch,)
    advantages = rng.normal(0.0, 1.0, adv_shape).astype(np.float32)
    # Make sure every branch is hit: an upper clip (row 0), a lower clip and a dual clip (row 2).
    advantages[0], advantages[2] = 1.2, -0.8
    old_logp[0, 0] = logp[0, 0] - 0.5  # rho = 1.65
    old_logp[2, 1] = logp[2, 1] + 0.5  # rho = 0.61
    old_logp[2, 2] = logp[2, 2] - 1.5  # rho = 4.5
    lengths = rng.integers(1, horizon + 1, batch)
    lengths[1] = 0  # a padding row (e.g. a slot RoC left empty)
    lengths[2] = horizon
    mask = (np.arange(horizon)[None, :] < lengths[:, None]).astype(np.float32)
    mask[3, 0] = 0.0  # a hole inside a sequence (a tool-output token)
    return dict(logp=logp, old_logp=old_logp, advantages=advantages, loss_mask=mask), ref_logp, entropy


def loss_and_grads(batch, ref_logp, entropy, **kwargs):
    def loss_fn(logp, entropy):
        return algo.policy_loss(logp, batch["old_logp"], batch["advantages"], batch["loss_mask"],
                                ref_logp=ref_logp, entropy=entropy, **kwargs)

    (loss, metrics), grads = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(batch["logp"], entropy)
    return loss, metrics, grads


@pytest.mark.parametrize("agg", algo.AGG_MODES)
@pytest.mark.parametrize("config", CONFIGS)
def test_matches_float64_reference_with_gradients(agg, config):
    kwargs = dict(CONFIGS[config], agg=agg)
    batch, ref_logp, entropy = make_batch(seed=len(config) + 7 * len(agg), per_token=config.endswith("adv"))
    uses_kl = "kl_coef" in kwargs
    ref_logp = ref_logp if uses_kl else None
    entropy = entropy if "entropy_coef" in kwargs else None
    loss, metrics, (grad_logp, grad_entropy) = loss_and_grads(batch, ref_logp, entropy, **kwargs)
    want_loss, want_metrics, want_grad_logp, want_grad_entropy = reference.policy_loss(
        **batch, ref_logp=ref_logp, entropy=entropy, **kwargs
    )
    assert loss.dtype == jnp.float32 and loss.shape == ()
    np.testing.assert_allclose(loss, want_loss, rtol=2e-5, atol=1e-6)
    assert set(metrics) == set(want_metrics)
    for name, value in want_metrics.items():
        np.testing.assert_allclose(metrics[name], value, rtol=2e-5, atol=1e-6, err_msg=name)
    np.testing.assert_allclose(grad_logp, want_grad_logp, rtol=2e-5, atol=1e-7)
    if entropy is not None:
        np.testing.assert_allclose(grad_entropy, want_grad_entropy, rtol=2e-5, atol=1e-7)
    if config == "gspo":  # few sequences: some are clipped, not necessarily on both sides for every seed
        assert metrics["clip_frac"] > 0
    else:
        assert metrics["clip_frac_high"] > 0 and metrics["clip_frac_low"] > 0
    assert (metrics["dual_clip_frac"] > 0) == (kwargs.get("dual_clip", 3.0) is not None)


def test_gradient_matches_finite_differences_in_float64():
    batch, ref_logp, entropy = make_batch(seed=11)
    with jax.enable_x64(True):
        args = {k: jnp.asarray(v, jnp.float64) for k, v in batch.items()}

        def loss_fn(logp, entropy):
            loss, _ = algo.policy_loss(logp, args["old_logp"], args["advantages"], args["loss_mask"],
                                       ref_logp=jnp.asarray(ref_logp, jnp.float64), kl_coef=0.1,
                                       entropy=entropy, entropy_coef=0.01, agg="seq_mean_token_mean")
            return loss

        check_grads(loss_fn, (args["logp"], jnp.asarray(entropy, jnp.float64)), order=1, modes=("rev",),
                    eps=1e-6, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("agg", algo.AGG_MODES)
def test_micro_batches_accumulate_to_the_full_batch(agg):
    batch, ref_logp, entropy = make_batch(seed=5, batch=8, horizon=12)
    kwargs = dict(CONFIGS["dual_k3_entropy"], agg=agg)
    full_loss, _, full_grads = loss_and_grads(batch, ref_logp, entropy, **kwargs)
    normalizer = algo.loss_normalizer(batch["loss_mask"], agg=agg)

    def accumulate(normalizer):
        loss, grads = 0.0, [[], []]
        for rows in np.split(np.arange(8), 4):
            micro = {k: v[rows] for k, v in batch.items()}
            micro_loss, _, micro_grads = loss_and_grads(micro, ref_logp[rows], entropy[rows],
                                                        normalizer=normalizer, **kwargs)
            loss += micro_loss
            for acc, g in zip(grads, micro_grads, strict=True):
                acc.append(g)
        return loss, [np.concatenate(g) for g in grads]

    loss, grads = accumulate(normalizer)
    np.testing.assert_allclose(loss, full_loss, rtol=1e-5, atol=1e-7)
    for got, want in zip(grads, full_grads, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-8)
    # Each micro-batch normalising by itself does not give the full-batch loss, except under verl's
    # seq_mean_token_sum_norm, whose N = T does not depend on the rows.
    local_loss, _ = accumulate(None)
    if agg == "seq_mean_token_sum_norm":
        np.testing.assert_allclose(local_loss, full_loss, rtol=1e-5, atol=1e-7)
    else:
        assert abs(float(local_loss) - float(full_loss)) > 1e-3


def test_normalizer_per_mode():
    mask = np.array([[1, 1, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]], np.float32)
    assert float(algo.loss_normalizer(mask, agg="token_mean")) == 6.0
    for agg in ("seq_mean_token_mean", "seq_mean_token_sum", "seq_mean_token_sum_norm_drgrpo"):
        assert float(algo.loss_normalizer(mask, agg=agg)) == 2.0  # the empty row is not a sequence
    assert float(algo.loss_normalizer(mask, agg="seq_mean_token_sum_norm")) == 4.0  # verl: T
    values = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_allclose(algo.aggregate_loss(values, mask, agg="token_mean"), (1 + 38) / 6)
    np.testing.assert_allclose(algo.aggregate_loss(values, mask, agg="seq_mean_token_mean"), (0.5 + 9.5) / 2)
    np.testing.assert_allclose(algo.aggregate_loss(values, mask, agg="seq_mean_token_sum"), (1 + 38) / 2)
    # verl's seq-mean-token-sum-norm: sum(seq sums) / T; TRL's Dr. GRPO: sum / (n_seq * T).
    np.testing.assert_allclose(algo.aggregate_loss(values, mask, agg="seq_mean_token_sum_norm"), 39 / 4)
    np.testing.assert_allclose(
        algo.aggregate_loss(values, mask, agg="seq_mean_token_sum_norm_drgrpo"), 39 / 4 / 2
    )
    np.testing.assert_allclose(algo.aggregate_loss(values, np.zeros_like(mask)), 0.0)


def test_clip_higher_and_dual_clip_gradients():
    # rows: A > 0 at rho 1.25 (inside the 0.28 upper clip) and 1.3 (outside); A < 0 at rho 0.75 (lower clip
    # active) and rho 5 (dual-clipped at c = 3).
    log_rho = np.log(np.array([[1.25], [1.3], [0.75], [5.0]], np.float32))
    old_logp = np.full((4, 1), -1.0, np.float32)
    adv = np.array([1.0, 1.0, -1.0, -2.0], np.float32)
    mask = np.ones((4, 1), np.float32)

    def loss_fn(logp):
        return algo.policy_loss(logp, old_logp, adv, mask, dual_clip=3.0, agg="seq_mean_token_sum")

    (loss, metrics), grad = jax.value_and_grad(loss_fn, has_aux=True)(old_logp + log_rho)
    np.testing.assert_allclose(grad[:, 0], [-1.25 / 4, 0.0, 0.0, 0.0], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(loss, (-1.25 - 1.28 + 0.8 + 6.0) / 4, rtol=1e-5)
    np.testing.assert_allclose(
        [metrics["clip_frac_high"], metrics["clip_frac_low"], metrics["dual_clip_frac"]], [0.25, 0.25, 0.25]
    )


@pytest.mark.parametrize("kind", sorted(algo.KL_ESTIMATORS))
def test_kl_estimators(kind):
    x = jnp.linspace(-2.0, 2.0, 9)
    value, grad = jax.vmap(jax.value_and_grad(algo.KL_ESTIMATORS[kind]))(x)
    for xi, vi, gi in zip(np.asarray(x, np.float64), value, grad, strict=True):
        want_value, want_grad = reference._kl(float(xi), kind)
        np.testing.assert_allclose(vi, want_value, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(gi, want_grad, rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(value)[x.tolist().index(0.0)] == 0.0)


def test_jit_vmap_and_bfloat16():
    batch, ref_logp, _ = make_batch(seed=2)
    kwargs = dict(ref_logp=ref_logp, kl_coef=0.1, dual_clip=3.0)
    eager, _ = algo.policy_loss(**batch, **kwargs)
    jitted, _ = jax.jit(lambda b: algo.policy_loss(**b, **kwargs))(batch)
    np.testing.assert_allclose(jitted, eager, rtol=1e-6)

    other, _, _ = make_batch(seed=3)
    stacked = jax.tree.map(lambda a, b: np.stack([a, b]), batch, other)
    losses, metrics = jax.vmap(lambda b: algo.policy_loss(**b))(stacked)
    assert losses.shape == (2,) and metrics["clip_frac"].shape == (2,)
    np.testing.assert_allclose(losses[1], algo.policy_loss(**other)[0], rtol=1e-6)

    half = {k: jnp.asarray(v, jnp.bfloat16) for k, v in batch.items()}
    loss_fn = lambda logp: algo.policy_loss(logp, half["old_logp"], half["advantages"], half["loss_mask"])[0]
    loss, grad = jax.value_and_grad(loss_fn)(half["logp"])
    assert loss.dtype == jnp.float32 and grad.dtype == jnp.bfloat16
    np.testing.assert_allclose(loss, algo.policy_loss(**batch)[0], rtol=0.05, atol=2e-3)
    assert np.all(np.isfinite(np.asarray(grad, np.float32)))


def test_bad_inputs_raise_clear_errors():
    batch, ref_logp, _ = make_batch(seed=0)
    with pytest.raises(ValueError, match=r"advantages must be per sequence \(6,\) or per token \(6, 10\)"):
        algo.policy_loss(**{**batch, "advantages": np.zeros(5, np.float32)})
    with pytest.raises(TypeError, match="logp must be a floating-point array"):
        algo.policy_loss(**{**batch, "logp": np.zeros((6, 10), np.int32)})
    with pytest.raises(ValueError, match="old_logp must have the shape of loss_mask"):
        algo.policy_loss(**{**batch, "old_logp": batch["old_logp"][:, :5]})
    with pytest.raises(ValueError, match="kl_coef=0.1 needs ref_logp"):
        algo.policy_loss(**batch, kl_coef=0.1)
    with pytest.raises(ValueError, match="entropy_coef=0.01 needs entropy"):
        algo.policy_loss(**batch, entropy_coef=0.01)
    with pytest.raises(ValueError, match="unknown agg 'seq_mean'"):
        algo.policy_loss(**batch, agg="seq_mean")
    with pytest.raises(ValueError, match="unknown kl 'k4'"):
        algo.policy_loss(**batch, ref_logp=ref_logp, kl="k4")
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        algo.policy_loss(**batch, dual_clip=0.5)
    with pytest.raises(ValueError, match="loss_mask must have rank 2"):
        algo.policy_loss(**{**batch, "loss_mask": batch["loss_mask"][0]})
