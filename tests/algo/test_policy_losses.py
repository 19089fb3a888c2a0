"""The registered policy losses: each against its float64 NumPy reference (loss, gradient in logp, metrics),
eager and under ``jax.jit``; registering a loss, its options and their checks; ``module:function``."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstar2jax import algo
from tests.algo import reference
from tests.algo.test_losses import make_batch

JIT = pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])


def _run(mode, batch, jit, behaviour_logp=None, **options):
    """compute_policy_loss of ``mode`` in float64: (loss, metrics, d loss / d logp)."""

    def loss_fn(logp):
        return algo.compute_policy_loss(mode, logp, batch["old_logp"], batch["advantages"],
                                        batch["loss_mask"], options=options, behaviour_logp=behaviour_logp)

    value_and_grad = jax.value_and_grad(loss_fn, has_aux=True)
    (loss, metrics), grad = (jax.jit(value_and_grad) if jit else value_and_grad)(batch["logp"])
    return float(loss), {k: float(v) for k, v in metrics.items()}, np.asarray(grad)


@pytest.fixture(autouse=True)
def float64():
    with jax.enable_x64(True):
        yield


def _batch(seed=3):
    batch, _, _ = make_batch(seed)
    return {k: np.asarray(v, np.float64) for k, v in batch.items()}


@JIT
@pytest.mark.parametrize("mode, options, reference_options", [
    ("ppo", {}, dict(eps_low=0.2, eps_high=0.28, dual_clip=3.0)),
    ("ppo", dict(eps_low=0.1, eps_high=0.15, dual_clip=None),
     dict(eps_low=0.1, eps_high=0.15, dual_clip=None)),
    ("gspo", dict(gspo_eps_low=0.05, gspo_eps_high=0.06),
     dict(eps_low=0.05, eps_high=0.06, dual_clip=None, importance_sampling_level="sequence")),
])
def test_clipped_surrogates_match_the_reference(jit, mode, options, reference_options):
    batch = _batch()
    loss, metrics, grad = _run(mode, batch, jit, **options)
    want, want_metrics, want_grad, _ = reference.policy_loss(**batch, **reference_options)
    np.testing.assert_allclose(loss, want, rtol=1e-10)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-9, atol=1e-12)
    for name, value in want_metrics.items():
        np.testing.assert_allclose(metrics[name], value, rtol=1e-10, atol=1e-12, err_msg=name)
    assert mode == "gspo" or metrics["clip_frac"] > 0  # the batch hits the clip


@JIT
def test_decoupled_matches_the_reference(jit):
    batch = _batch(4)
    behaviour = batch["old_logp"] + np.random.default_rng(0).normal(0.0, 0.5, batch["logp"].shape)
    loss, metrics, grad = _run("decoupled", batch, jit, behaviour_logp=behaviour, decoupled_is_cap=1.5)
    want, want_metrics, want_grad = reference.decoupled_policy_loss(
        batch["logp"], batch["old_logp"], behaviour, batch["advantages"], batch["loss_mask"], is_cap=1.5)
    np.testing.assert_allclose(loss, want, rtol=1e-10)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-9, atol=1e-12)
    for name, value in want_metrics.items():
        np.testing.assert_allclose(metrics[name], value, rtol=1e-10, atol=1e-12, err_msg=name)
    assert 0 < metrics["behaviour_ratio_capped"] < 1
    with pytest.raises(ValueError, match="needs the behaviour"):
        _run("decoupled", batch, jit)


@JIT
def test_cispo_matches_the_reference(jit):
    batch = _batch(5)
    loss, metrics, grad = _run("cispo", batch, jit, eps_high=0.2)
    want, want_grad = reference.cispo_loss(**batch, eps_high=0.2)
    np.testing.assert_allclose(loss, want, rtol=1e-10)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-9, atol=1e-12)
    mask = batch["loss_mask"]
    rho = np.exp(batch["logp"] - batch["old_logp"])
    np.testing.assert_allclose(metrics["clip_frac"], np.sum((rho > 1.2) * mask) / mask.sum(), rtol=1e-12)
    assert metrics["clip_frac"] > 0
    # Unlike the clipped surrogate, a clipped token keeps its gradient (its weight is bounded instead).
    _, _, ppo_grad = _run("ppo", batch, jit, eps_high=0.2)
    clipped = (rho > 1.2) & (mask > 0) & (np.asarray(batch["advantages"])[:, None] > 0)
    assert clipped.any() and np.all(ppo_grad[clipped] == 0) and np.all(grad[clipped] != 0)


@JIT
def test_sapo_matches_the_reference(jit):
    batch = _batch(6)
    loss, metrics, grad = _run("sapo", batch, jit, sapo_tau_pos=1.0, sapo_tau_neg=2.0)
    want, want_grad = reference.sapo_loss(**batch, tau_pos=1.0, tau_neg=2.0)
    np.testing.assert_allclose(loss, want, rtol=1e-10)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-9, atol=1e-12)
    assert 0 < metrics["gate_mean"] < 1


def test_on_policy_every_loss_has_the_policy_gradient():
    """At rho = 1 the clipped surrogate, CISPO and SAPO all give d loss / d logp = -A / N."""
    batch = _batch(7)
    batch["old_logp"] = batch["logp"]
    grads = {mode: _run(mode, batch, False)[2] for mode in ("ppo", "cispo", "sapo")}
    np.testing.assert_allclose(grads["cispo"], grads["ppo"], rtol=1e-12)
    np.testing.assert_allclose(grads["sapo"], grads["ppo"], rtol=1e-12)


def clipped_pg(inputs: algo.LossInputs, *, bound: float = 0.5, scale: float | None = None):
    """l_t = -A_t min(rho_t, 1 + bound) (x scale): the docs' example of a loss of one's own."""
    ratio = jnp.exp(inputs.log_ratio)
    token_loss = -inputs.advantages * jnp.minimum(ratio, 1.0 + bound) * (1.0 if scale is None else scale)
    return token_loss, {"ratio_mean": inputs.mean(ratio)}


def unregistered_pg(inputs, *, bound: float = 0.5):
    """Loaded by ``module:function`` without registering."""
    return clipped_pg(inputs, bound=bound)


@pytest.fixture
def registered():
    """``clipped_pg`` registered as "test_clipped_pg" for the test (the registry is the process's)."""
    checks = {"bound": (lambda v: v > 0, "must be > 0")}
    algo.register_policy_loss("test_clipped_pg", checks=checks)(clipped_pg)
    yield algo.POLICY_LOSSES["test_clipped_pg"]
    del algo.POLICY_LOSSES["test_clipped_pg"]


def test_registering_a_loss_its_options_and_checks(registered):
    entry = registered
    assert entry.options == {"bound": 0.5, "scale": None} and entry.nullable == {"scale"}
    assert entry.resolve({"bound": 2, "other_loss_option": "x"}) == {"bound": 2, "scale": None}
    assert algo.registered_loss_options()["bound"] == (0.5, "test_clipped_pg")
    for value, message in ((-1.0, "bound=-1.0: must be > 0 (an option of loss 'test_clipped_pg')"),
                           ("x", "bound='x': must be a finite number"),
                           (None, "bound=None: must be a number"),
                           (True, "bound=True: must be a finite number")):
        with pytest.raises(ValueError) as error:
            entry.resolve({"bound": value})
        assert str(error.value).startswith(message), str(error.value)
    batch = _batch()
    loss, metrics, _ = _run("test_clipped_pg", batch, True, bound=0.1)
    assert np.isfinite(loss) and set(metrics) == {"pg_loss", "ratio_mean", "approx_kl"}
    with pytest.raises(ValueError, match="already registered"):
        algo.register_policy_loss("test_clipped_pg")(clipped_pg)
    with pytest.raises(TypeError, match="option 'eps' .* needs a default"):
        algo.register_policy_loss("test_no_default")(lambda inputs, *, eps: None)
    with pytest.raises(TypeError, match="checks name 'nope'"):
        algo.register_policy_loss("test_bad_check", checks={"nope": (bool, "x")})(clipped_pg)


def test_a_loss_by_module_and_function(registered):
    here = __name__
    assert algo.get_policy_loss(f"{here}:clipped_pg") is algo.POLICY_LOSSES["test_clipped_pg"]
    entry = algo.get_policy_loss(f"{here}:unregistered_pg")
    assert entry.options == {"bound": 0.5} and entry.name == f"{here}:unregistered_pg"
    for mode, message in (("nope", r"mode='nope': not a registered policy loss \('ppo'"),
                          ("no_such_module:f", "mode='no_such_module:f': cannot load it"),
                          (f"{here}:missing", "cannot load it"),
                          ("tests.algo.reference:surrogate", "needs a default")):
        with pytest.raises(ValueError, match=message):
            algo.get_policy_loss(mode)
