"""Several updates per rollout batch (``rl.ppo_epochs`` x ``rl.mini_batches``): the clip acts against the
policy the step started from, CISPO's update then differs from the clipped surrogate's, mini-batch losses
add up to the batch's token mean, the optimizer and its schedule count updates, LoRA and the decoupled
objective take part. One update per batch (the default) is the step as it was: ``test_steps``."""

import functools

import jax
import numpy as np
import optax
import pytest

from rstar2jax import models
from rstar2jax.config.options import OptimizerOptions
from rstar2jax.train import (
    RLLossConfig,
    init_train_state,
    learning_rate_schedule,
    make_optimizer,
    make_rl_step,
)
from rstar2jax.train.state import optimizer_from_options, schedule_from_options
from rstar2jax.train.updates import several_updates
from tests.train.conftest import FAST_COMPILE, copy_tree

LORA = models.LoraConfig(rank=4, alpha=8.0)


def _on_policy(config, params, batch, noise=0.0):
    """``batch`` with the model's own log-probs as the sampler's (plus Gaussian ``noise``)."""
    logits, _ = models.forward(params, config, batch.tokens, positions=batch.positions,
                               segment_ids=batch.segment_ids)
    logp = np.asarray(models.token_logprobs(logits, batch.targets))
    noise = np.random.default_rng(0).normal(0.0, noise, logp.shape).astype(np.float32)
    return batch.replace(sampler_logp=logp + noise)


def _update_counts(opt_state) -> set[int]:
    """The optimizer's counters (Adam's, the schedule's): the updates it applied."""
    return {int(x) for x in jax.tree.leaves(opt_state) if np.asarray(x).dtype == np.int32 and np.ndim(x) == 0}


def _step(config, params, batch, optimizer, loss, **options):
    step = make_rl_step(config, optimizer, loss, num_microbatches=2, compiler_options=FAST_COMPILE, **options)
    return step(init_train_state(copy_tree(params), optimizer, 0), batch)


def test_with_two_epochs_the_clip_acts_and_cispo_differs(tiny_model, rl_batch):
    config, params = tiny_model
    batch = _on_policy(config, params, rl_batch)
    optimizer = make_optimizer(3e-2, warmup_steps=1)
    runs = {mode: _step(config, params, batch, optimizer, RLLossConfig(old_logprobs="recompute", mode=mode),
                        ppo_epochs=2, mini_batches=2)
            for mode in ("ppo", "cispo")}
    (ppo_state, ppo), (cispo_state, cispo) = runs["ppo"], runs["cispo"]
    # pi_old is the policy before the first update: the later updates see ratios away from 1.
    assert float(ppo["clip_frac"]) > 0 and float(cispo["clip_frac"]) > 0
    assert abs(float(ppo["ratio_mean"]) - 1.0) > 1e-3 and float(ppo["mismatch_abs_log_ratio"]) < 1e-5
    assert int(ppo_state.step) == 1 and _update_counts(ppo_state.opt_state) == {4}  # 2 epochs x 2 minis
    differences = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), ppo_state.params,
                                               cispo_state.params))
    assert max(differences) > 1e-4 and float(ppo["grad_norm"]) != float(cispo["grad_norm"])


def test_mini_batch_losses_add_up_to_the_batch_token_mean(tiny_model, rl_batch):
    """With a learning rate of 0 the policy stays put: mini-batches over one epoch give the whole batch's loss
    and token means (each divided by the whole batch's normaliser, not its own)."""
    config, params = tiny_model
    optimizer = optax.sgd(0.0)
    loss = RLLossConfig(agg="token_mean")
    _, whole = _step(config, params, rl_batch, optimizer, loss)
    _, minis = _step(config, params, rl_batch, optimizer, loss, mini_batches=2)
    for name in ("loss", "pg_loss", "clip_frac", "ratio_mean", "entropy", "approx_kl", "tokens"):
        np.testing.assert_allclose(minis[name], whole[name], rtol=2e-6, err_msg=name)


def test_lora_and_the_decoupled_objective_over_several_updates(tiny_model, rl_batch):
    """pi_prox is the policy the step started from (the merged adapters): clipped against it from the second
    update on, tokens weighted by the sampler's ratio to it."""
    config, params = tiny_model
    batch = _on_policy(config, params, rl_batch, noise=0.3)
    optimizer = make_optimizer(3e-2, warmup_steps=1)
    loss = RLLossConfig(off_policy_correction="decoupled", decoupled_is_cap=1.5, eps_low=0.01, eps_high=0.01)
    step = make_rl_step(config, optimizer, loss, num_microbatches=2, lora=LORA, ppo_epochs=3,
                        compiler_options=FAST_COMPILE)
    adapters = jax.tree.map(lambda x: x + 0.05, models.lora.init_lora(config, LORA, jax.random.key(1)))
    state, metrics = step(init_train_state(copy_tree(adapters), optimizer, 0), batch, params)
    assert float(metrics["clip_frac"]) > 0 and 0 < float(metrics["behaviour_ratio_capped"]) < 1
    assert float(metrics["update_skipped"]) == 0 and float(metrics["mismatch_abs_log_ratio"]) > 0.1
    assert max(jax.tree.leaves(jax.tree.map(lambda a, b: float(np.max(np.abs(a - b))), state.params,
                                            adapters))) > 1e-3


def test_the_schedule_counts_updates():
    """Warm-up and total in RL steps, the schedule in updates; a step's logged rate is its last update's."""
    options = OptimizerOptions(learning_rate=1.0, warmup_steps=2, schedule="cosine", total_steps=10,
                               weight_decay=0.0, b1=0.9, b2=0.999, eps=1e-8, max_grad_norm=None)
    per_update = learning_rate_schedule(1.0, warmup_steps=6, schedule="cosine", total_steps=30)
    per_step = schedule_from_options(options, updates_per_step=3)
    for step in range(10):
        np.testing.assert_allclose(per_step(step), per_update(3 * step + 2), rtol=1e-6)
    np.testing.assert_allclose(per_step(0), 0.5)  # update 3 of a 6-update warm-up
    assert schedule_from_options(options)(0) == 0.5  # one update per step: update 1 of 2
    params = {"w": np.ones(3, np.float32)}
    optimizer = optimizer_from_options(options, updates_per_step=3)
    state = optimizer.init(params)
    for _ in range(3):  # the first step's three updates: warm-up rates 1/6, 2/6, 3/6
        _, state = optimizer.update({"w": np.ones(3, np.float32)}, state, params)
    assert _update_counts(state) == {3}


def test_rows_must_divide_into_mini_and_micro_batches(tiny_model, rl_batch):
    loss_fn = functools.partial(lambda params, batch, normalizer: (0.0, {}))
    state = init_train_state({"w": np.zeros(2, np.float32)}, optax.sgd(0.1), 0)
    with pytest.raises(ValueError, match=r"batch rows \(8\) must be a multiple of mini_batches x "
                                         r"num_microbatches \(3 x 2\)"):
        several_updates(state, rl_batch, loss_fn, 1.0, optimizer=optax.sgd(0.1), num_microbatches=2,
                        ppo_epochs=1, mini_batches=3)
