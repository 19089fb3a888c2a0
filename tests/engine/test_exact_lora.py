"""Exact numerics with LoRA (issue 52): the engine samples from the merged ``W + s A B``
(``models.lora.merge``, what a LoRA run's rollout does); the trainer's exact forward merges each layer's
adapters the same way (``attach(..., merge_in_forward=True)``), so every sampled token's log-prob is the
trainer's bit for bit in float32 and bfloat16, the ``rl_step``'s mismatch metrics read 0, and the adapters'
gradient is the attached formulation's. Dropout, which no merged weight can hold, is refused.

The model, weights and engine configs are ``test_exact``'s (its compiled engine programs are reused)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments.configs import tiny_cpu
from rstar2jax import models
from rstar2jax.engine import generate
from rstar2jax.train import ConfigError, init_train_state, make_rl_step, parse
from rstar2jax.train import lora as lora_lib
from tests.engine.test_exact import FOUR_SLOTS, _assert_sampled_are_the_trainers, _rl_batch, exact  # noqa: F401
from tests.train.scripted import set_fields

LORA = models.LoraConfig(rank=4, alpha=8.0)


def _adapters(config, lora=LORA):
    """Adapters with A and B both random and non-zero (a fresh B is zero: the merge would change nothing)."""
    fresh = models.lora.init_lora(config, lora, jax.random.key(1))
    keys = iter(jax.random.split(jax.random.key(2), len(jax.tree.leaves(fresh))))
    return jax.tree.map(lambda x: x + 0.2 * jax.random.normal(next(keys), x.shape, x.dtype), fresh)


def _sampled(config, params, adapters, prompts, seed):
    """The engine's samples from the merged weights, built as a LoRA run's rollout builds them."""
    merged = lora_lib.FrozenBase(params, config, LORA).rollout(generate).policy_params(adapters)
    return generate(merged, config, prompts, max_new_tokens=8, temperature=1.0, engine_config=FOUR_SLOTS,
                    seed=seed)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_merged_engine_logprobs_are_the_trainers_with_adapters(exact, dtype):  # noqa: F811
    """Float32 base weights, compute in ``dtype``: the engine's log-prob of every sampled token equals the
    trainer's (``sequence_logprobs`` of the base with the adapters attached) bit for bit."""
    config, params = exact[dtype]
    adapters = _adapters(config)
    rng = np.random.default_rng(21)
    prompts = [rng.integers(0, 256, n).tolist() for n in (6, 17, 3)]
    gens = _sampled(config, params, adapters, prompts, seed=4)
    records = [(p, g.tokens, [1] * len(g.tokens), g.logprobs) for p, g in zip(prompts, gens, strict=True)]
    attached = models.lora.attach(params, adapters, LORA, merge_in_forward=True)
    _assert_sampled_are_the_trainers(attached, config, records, row_of=[1, 0, 1])
    # The adapters matter: the base alone samples other tokens or other log-probs.
    plain = generate(params, config, prompts, max_new_tokens=8, temperature=1.0, engine_config=FOUR_SLOTS,
                     seed=4)
    assert [g.logprobs for g in plain] != [g.logprobs for g in gens]


@pytest.mark.parametrize("mini_batches", [1, 2])
def test_lora_rl_step_mismatch_metrics_read_zero(exact, mini_batches):  # noqa: F811
    """Engine samples of the merged policy, packed and split into two micro-batches (or two mini-batches:
    two updates, the mismatch from the log-probs the updates start from): the LoRA ``rl_step``'s
    sampler-vs-trainer mismatch metrics read exactly 0, and the adapters move."""
    config, params = exact["float32"]
    adapters = _adapters(config)
    rng = np.random.default_rng(12)
    prompts = [rng.integers(0, 256, n).tolist() for n in (5, 12, 3, 20)]
    gens = _sampled(config, params, adapters, prompts, seed=3)
    batch = _rl_batch(prompts, gens)
    optimizer = optax.sgd(1e-2)
    step = make_rl_step(config, optimizer, num_microbatches=3 - mini_batches, mini_batches=mini_batches,
                        lora=LORA)
    state, metrics = step(init_train_state(adapters, optimizer, 0), batch, params)
    assert float(metrics["tokens"]) == 8 * len(prompts)
    assert float(metrics["mismatch_abs_log_ratio"]) == float(metrics["mismatch_k3_kl"]) == 0.0
    assert float(metrics["grad_norm"]) > 0
    assert not np.array_equal(state.params["layers"]["q_proj"]["b"], adapters["layers"]["q_proj"]["b"])


def test_adapter_gradient_is_the_attached_formulations():
    """The gradient w.r.t. A and B through the merged weights (exact) is the one through ``x W + s (x A) B``
    (default numerics), to float32 rounding."""
    config = models.preset("tiny", num_layers=1, vocab_size=256)
    params = models.init_params(config, jax.random.key(0))
    adapters = _adapters(config)
    exact_config = dataclasses.replace(config, numerics="exact")
    tokens = jax.random.randint(jax.random.key(5), (2, 13), 0, config.vocab_size)

    @jax.jit
    @jax.grad
    def attached_gradient(adapters):  # default numerics: x W + s (x A) B
        logp, _ = models.sequence_logprobs(models.lora.attach(params, adapters, LORA), config,
                                           tokens[:, :-1], tokens[:, 1:])
        return jnp.mean(logp)

    @jax.jit
    @jax.grad
    def merged_gradient(adapters):  # exact numerics: each layer's W + s A B
        policy = models.lora.attach(params, adapters, LORA, merge_in_forward=True)
        logp, _ = models.sequence_logprobs(policy, exact_config, tokens[:, :-1], tokens[:, 1:])
        return jnp.mean(logp)

    attached, merged = attached_gradient(adapters), merged_gradient(adapters)
    expected_of = dict(jax.tree_util.tree_leaves_with_path(attached))
    for path, got in jax.tree_util.tree_leaves_with_path(merged):
        expected = expected_of[path]
        assert float(jnp.abs(expected).max()) > 0, path
        np.testing.assert_allclose(got, expected, rtol=2e-4, atol=2e-6, err_msg=str(path))


def test_exact_lora_is_accepted_and_dropout_refused():
    """An exact model takes adapters, and a run config asks for both; dropout (no merged weight holds a
    mask) is a one-line error when the adapters are built or checked, and at parse (RL: dropout is 0)."""
    exact_model = models.preset("tiny", numerics="exact")
    adapters = models.lora.init_lora(exact_model, LORA, jax.random.key(0))
    dropped = models.LoraConfig(rank=2, dropout=0.1)
    models.lora.check_lora(models.preset("tiny"), dropped)
    with pytest.raises(ValueError, match=r"lora dropout=0.1 with numerics='exact'.*use dropout=0"):
        models.lora.init_lora(exact_model, dropped, jax.random.key(0))
    with pytest.raises(ValueError, match="merged in the forward take no dropout"):
        models.lora.attach({"layers": {}}, adapters, dropped, dropout_key=jax.random.key(1),
                           merge_in_forward=True)
    # Adapters attached the default way (the low-rank path) never reach an exact forward, nor the reverse.
    params = models.init_params(exact_model, jax.random.key(0))
    tokens = jnp.zeros((1, 8), jnp.int32)
    with pytest.raises(ValueError, match="attach them with merge_in_forward=True"):
        models.forward(models.lora.attach(params, adapters, LORA), exact_model, tokens)
    with pytest.raises(ValueError, match="merge_in_forward run in a numerics='exact' forward only"):
        models.forward(models.lora.attach(params, adapters, LORA, merge_in_forward=True),
                       models.preset("tiny"), tokens)

    config = set_fields(tiny_cpu.get_config(), {"rollout.numerics": "exact", "model.lora.rank": 2})
    options = parse(config)
    assert (options.policy.model.numerics, options.lora.rank) == ("exact", 2)
    with pytest.raises(ConfigError, match="config.model.lora.dropout=0.1: must be 0 in RL"):
        parse(set_fields(config, {"model.lora.dropout": 0.1}))
