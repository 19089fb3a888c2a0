"""SFT / RL steps: micro-batch accumulation equals the full batch, sharded equals single-device, old log-prob
sources agree on-policy, the optimizer schedule and reset."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from rstar2jax import algo, models
from rstar2jax.train import (
    RLLossConfig,
    accumulate_gradients,
    build_batch,
    init_train_state,
    learning_rate_schedule,
    make_optimizer,
    make_rl_step,
    make_sft_step,
    reset_optimizer,
    rl_loss,
    sft_loss,
    state_shardings,
)
from tests.train.conftest import FAST_COMPILE, copy_tree, random_sequences


def _assert_trees_close(a, b, rtol=1e-5, atol=1e-6):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


@pytest.mark.parametrize("agg, pack", [("token_mean", True), ("seq_mean_token_mean", False)])
def test_microbatch_gradients_equal_full_batch(tiny_model, agg, pack):
    config, params = tiny_model
    sequences = random_sequences(1, 8 if not pack else 16)
    batch = jax.device_put(build_batch(sequences, seq_len=32, num_rows=8, pack=pack, with_rl_fields=True))
    loss_fn = functools.partial(rl_loss, model_config=config, loss_config=RLLossConfig(agg=agg))

    @functools.partial(jax.jit, compiler_options=FAST_COMPILE)
    def full_and_micro(params, batch):
        normalizer = algo.loss_normalizer(batch.loss_mask, agg=agg)
        full = accumulate_gradients(loss_fn, params, batch, normalizer, 1)
        micro = accumulate_gradients(loss_fn, params, batch, normalizer, 4)
        # The full-batch pass is policy_loss itself on the whole batch.
        logits, _ = models.forward(
            params, config, batch.tokens, positions=batch.positions, segment_ids=batch.segment_ids
        )
        logp = models.token_logprobs(logits, batch.targets)
        reference = algo.policy_loss(logp, batch.old_logp, batch.advantages, batch.loss_mask, agg=agg)
        return full, micro, reference

    full, micro, (loss, metrics) = full_and_micro(params, batch)
    _assert_trees_close(full, micro)
    assert float(jnp.max(jnp.abs(jax.tree.leaves(full[2])[0]))) > 0  # the gradient is not trivially zero
    tokens = jnp.sum(batch.loss_mask)
    np.testing.assert_allclose(full[0], loss, rtol=1e-5)
    np.testing.assert_allclose(micro[1]["token_sums"]["clip_frac"] / tokens, metrics["clip_frac"], rtol=1e-5)
    np.testing.assert_allclose(micro[1]["token_sums"]["approx_kl"] / tokens, metrics["approx_kl"], rtol=1e-5)


def test_sft_loss_over_microbatches_and_learning(tiny_model):
    config, params = tiny_model
    batch = build_batch(random_sequences(2, 12), seq_len=32, num_rows=8)
    direct = jax.jit(functools.partial(sft_loss, model_config=config), compiler_options=FAST_COMPILE)(
        params, jax.device_put(batch), jnp.sum(batch.loss_mask)
    )[0]
    optimizer = make_optimizer(1e-2, warmup_steps=1)
    step = make_sft_step(config, optimizer, num_microbatches=4, compiler_options=FAST_COMPILE)
    state = init_train_state(copy_tree(params), optimizer, 0)
    losses = []
    for _ in range(6):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    # The first (pre-update) loss is the whole batch's mean NLL per assistant token, ~ln(vocab) at init.
    np.testing.assert_allclose(losses[0], direct, rtol=1e-6)
    assert losses[0] == pytest.approx(np.log(config.vocab_size), rel=0.05)
    assert losses[-1] < losses[0] - 0.5, losses
    assert int(state.step) == 6 and float(metrics["tokens"]) == float(batch.loss_mask.sum())


@pytest.mark.needs_devices(8)
def test_sharded_step_equals_single_device(tiny_model, rl_batch):
    config, params = tiny_model
    optimizer = make_optimizer(1e-3, warmup_steps=1)
    loss_config = RLLossConfig()
    single = make_rl_step(config, optimizer, loss_config, num_microbatches=2, compiler_options=FAST_COMPILE)
    expected_state, expected = single(init_train_state(copy_tree(params), optimizer, 0), rl_batch)

    mesh = models.make_mesh(data=2, fsdp=2, tensor=2)
    shardings = state_shardings(config, optimizer, mesh)
    sharded = make_rl_step(
        config,
        optimizer,
        loss_config,
        num_microbatches=2,
        mesh=mesh,
        shardings=shardings,
        compiler_options=FAST_COMPILE,
    )
    state = jax.device_put(init_train_state(copy_tree(params), optimizer, 0), shardings)
    new_state, metrics = sharded(state, rl_batch)
    assert new_state.params["layers"]["gate_proj"].sharding == shardings.params["layers"]["gate_proj"]
    assert not new_state.params["layers"]["gate_proj"].sharding.is_fully_replicated
    # Adam's first update is ~lr·sign(g): near-zero gradients amplify float-summation-order noise to ~1e-6.
    _assert_trees_close(new_state.params, expected_state.params, atol=1e-5)
    _assert_trees_close(new_state.opt_state, expected_state.opt_state, rtol=1e-4, atol=1e-8)
    for key in expected:
        np.testing.assert_allclose(metrics[key], expected[key], rtol=2e-5, atol=1e-6, err_msg=key)
    with pytest.raises(RuntimeError, match="deleted"):
        np.asarray(state.params["embed"])  # the input state was donated


def test_recomputed_old_logprobs_match_onpolicy_sampler(tiny_model, rl_batch):
    config, params = tiny_model
    logits, _ = models.forward(
        params, config, rl_batch.tokens, positions=rl_batch.positions, segment_ids=rl_batch.segment_ids
    )
    on_policy = rl_batch.replace(sampler_logp=np.asarray(models.token_logprobs(logits, rl_batch.targets)))
    optimizer = make_optimizer(1e-3, warmup_steps=1)
    steps = {
        source: make_rl_step(
            config, optimizer, RLLossConfig(old_logprobs=source), compiler_options=FAST_COMPILE
        )
        for source in ("sampler", "recompute")
    }
    results = {
        source: step(init_train_state(copy_tree(params), optimizer, 0), on_policy)
        for source, step in steps.items()
    }
    (state_s, m_s), (state_r, m_r) = results["sampler"], results["recompute"]
    _assert_trees_close(state_s.params, state_r.params, atol=1e-5)
    np.testing.assert_allclose(m_r["ratio_mean"], 1.0, rtol=1e-6)
    np.testing.assert_allclose(m_s["ratio_mean"], 1.0, rtol=1e-4)
    assert float(m_r["clip_frac"]) == 0.0 and abs(float(m_r["approx_kl"])) < 1e-7
    assert float(m_r["entropy"]) > 0 and float(m_r["grad_norm"]) > 0
    assert float(m_r["tokens"]) == float(rl_batch.loss_mask.sum())

    # With random sampler log-probs the ratios are far from 1 and the clip fires.
    _, off_policy = steps["sampler"](init_train_state(copy_tree(params), optimizer, 0), rl_batch)
    assert float(off_policy["clip_frac"]) > 0.05


def test_learning_rate_schedule_and_optimizer_reset(tiny_model):
    lr = learning_rate_schedule(1e-6, warmup_steps=20)
    np.testing.assert_allclose(
        [lr(0), lr(9), lr(19), lr(20), lr(500)], [5e-8, 5e-7, 1e-6, 1e-6, 1e-6], rtol=1e-6
    )
    cosine = learning_rate_schedule(1e-3, warmup_steps=4, schedule="cosine", total_steps=104)
    np.testing.assert_allclose(
        [cosine(3), cosine(4), cosine(54), cosine(104)], [1e-3, 1e-3, 5e-4, 0], atol=1e-9
    )
    with pytest.raises(ValueError, match="total_steps"):
        learning_rate_schedule(1e-3, schedule="cosine")
    with pytest.raises(ValueError, match="schedule"):
        learning_rate_schedule(1e-3, schedule="linear")

    config, params = tiny_model
    optimizer = make_optimizer()  # the paper's AdamW
    batch = build_batch(random_sequences(3, 8), seq_len=32, num_rows=4)
    state, _ = make_sft_step(config, optimizer, compiler_options=FAST_COMPILE)(
        init_train_state(copy_tree(params), optimizer, 5), batch
    )
    fresh = optimizer.init(state.params)
    reset = reset_optimizer(state, optimizer)
    _assert_trees_close(reset.opt_state, fresh, atol=0)
    assert int(reset.step) == 1 and reset.params is state.params
    assert np.array_equal(reset.rng, jax.random.PRNGKey(5))
    counts = [x for x in jax.tree.leaves(state.opt_state) if x.dtype == jnp.int32]
    assert counts and all(int(c) == 1 for c in counts)


def test_step_input_errors(tiny_model):
    config, params = tiny_model
    optimizer = make_optimizer()
    batch = build_batch(random_sequences(4, 6), seq_len=32, num_rows=6)
    with pytest.raises(ValueError, match="num_microbatches"):
        make_sft_step(config, optimizer, num_microbatches=4)(
            init_train_state(copy_tree(params), optimizer, 0), batch
        )
    with pytest.raises(ValueError, match="old_logprobs"):
        RLLossConfig(old_logprobs="engine")
    with pytest.raises(ValueError, match="state shardings"):
        make_rl_step(config, optimizer, mesh=models.make_mesh())
    assert dataclasses.replace(RLLossConfig(), eps_high=0.3).eps_high == 0.3
    assert isinstance(optimizer, optax.GradientTransformation)


def test_loss_options_in_rl_step_match_algo_and_accumulate(tiny_model):
    """GSPO + rollout correction + KL to a reference policy on a packed batch: the micro-batched step equals
    the full batch, and the full batch equals the algo functions called on the model's log-probs."""
    config, params = tiny_model
    batch = build_batch(random_sequences(4, 16), seq_len=32, num_rows=8, pack=True, with_rl_fields=True)
    logits, _ = models.forward(
        params, config, batch.tokens, positions=batch.positions, segment_ids=batch.segment_ids
    )
    # Sampler log-probs near the trainer's: some token weights get capped, some sequences masked.
    noise = np.random.default_rng(0).normal(0.0, 0.4, batch.tokens.shape).astype(np.float32)
    sampler_logp = np.asarray(models.token_logprobs(logits, batch.targets)) + noise
    batch = jax.device_put(batch.replace(sampler_logp=sampler_logp))
    ref_params = jax.tree.map(lambda x: x * 1.05, params)
    loss_config = RLLossConfig(
        importance_sampling_level="sequence",
        gspo_eps_low=0.05,
        gspo_eps_high=0.06,
        kl_coef=0.1,
        kl="k2",
        old_logprobs="recompute",
        rollout_is_cap=1.5,
        rollout_mask="geometric",
        rollout_mask_threshold=1.2,
    )
    loss_fn = functools.partial(rl_loss, model_config=config, loss_config=loss_config, ref_params=ref_params)

    @functools.partial(jax.jit, compiler_options=FAST_COMPILE)
    def full_and_micro(params, batch):
        normalizer = algo.loss_normalizer(batch.loss_mask)
        full = accumulate_gradients(loss_fn, params, batch, normalizer, 1)
        micro = accumulate_gradients(loss_fn, params, batch, normalizer, 4)
        def logp_of(p):
            out, _ = models.forward(
                p, config, batch.tokens, positions=batch.positions, segment_ids=batch.segment_ids
            )
            return models.token_logprobs(out, batch.targets)

        logp = logp_of(params)
        weights, sums = algo.rollout_correction(
            logp, batch.old_logp, batch.loss_mask, token_cap=1.5, sequence_mask="geometric",
            mask_threshold=1.2, segment_ids=batch.segment_ids,
        )
        reference = algo.policy_loss(
            logp, logp, batch.advantages, batch.loss_mask, eps_low=0.05, eps_high=0.06, dual_clip=None,
            ref_logp=logp_of(ref_params), kl="k2", kl_coef=0.1, importance_sampling_level="sequence",
            segment_ids=batch.segment_ids, is_weights=weights,
        )
        return full, micro, reference, sums, algo.rollout_mismatch(logp, batch.old_logp, batch.loss_mask)

    full, micro, (loss, metrics), sums, mismatch = full_and_micro(params, batch)
    _assert_trees_close(full, micro)
    np.testing.assert_allclose(full[0], loss, rtol=1e-5)
    np.testing.assert_allclose(full[1]["totals"]["kl_loss"], metrics["kl_loss"], rtol=1e-5)
    assert float(metrics["kl_loss"]) > 0
    for name, value in sums.items():
        np.testing.assert_allclose(micro[1]["token_sums"][name], value, rtol=1e-5, err_msg=name)
    tokens = float(batch.loss_mask.sum())
    assert 0 < float(sums["rollout_is_capped"]) < tokens and 0 < float(sums["rollout_is_masked"]) < tokens

    # The jitted step: the state carries the reference; without it the KL term is an error.
    optimizer = make_optimizer(1e-3, warmup_steps=1)
    step = make_rl_step(config, optimizer, loss_config, num_microbatches=2, compiler_options=FAST_COMPILE)
    state = init_train_state(copy_tree(params), optimizer, 0, reference=True)
    state = state.replace(ref_params=copy_tree(ref_params))
    new_state, step_metrics = step(state, batch)
    np.testing.assert_allclose(step_metrics["loss"], loss, rtol=1e-5)
    np.testing.assert_allclose(step_metrics["rollout_is_masked"], float(sums["rollout_is_masked"]) / tokens,
                               rtol=1e-5)
    # The sampler-vs-trainer mismatch of the loss tokens: summed over the micro-batches, then divided.
    assert "mismatch_tokens" not in step_metrics and float(mismatch["mismatch_outside_band"]) > 0
    for name in ("mismatch_abs_log_ratio", "mismatch_k3_kl", "mismatch_outside_band"):
        np.testing.assert_allclose(step_metrics[name], mismatch[name], rtol=1e-5, err_msg=name)
    _assert_trees_close(new_state.ref_params, ref_params, rtol=0, atol=0)  # frozen
    with pytest.raises(ValueError, match="kl_coef=0.1 needs a reference policy"):
        step(init_train_state(copy_tree(params), optimizer, 0), batch)


def test_decoupled_objective_in_the_step_is_algos_and_accumulates(tiny_model):
    """off_policy_correction="decoupled": the proximal log-probs recomputed by the trainer, the sampler's
    as the behaviour policy; micro-batches add up to the full batch, which equals
    ``algo.decoupled_policy_loss`` on the model's log-probs."""
    config, params = tiny_model
    batch = build_batch(random_sequences(5, 16), seq_len=32, num_rows=8, pack=True, with_rl_fields=True)
    logits, _ = models.forward(params, config, batch.tokens, positions=batch.positions,
                               segment_ids=batch.segment_ids)
    noise = np.random.default_rng(1).normal(0.0, 0.6, batch.tokens.shape).astype(np.float32)
    batch = jax.device_put(batch.replace(sampler_logp=np.asarray(models.token_logprobs(logits, batch.targets))
                                         + noise))
    loss_config = RLLossConfig(off_policy_correction="decoupled", decoupled_is_cap=1.5)
    loss_fn = functools.partial(rl_loss, model_config=config, loss_config=loss_config)

    @functools.partial(jax.jit, compiler_options=FAST_COMPILE)
    def full_micro_and_algo(params, batch):
        normalizer = algo.loss_normalizer(batch.loss_mask)
        full = accumulate_gradients(loss_fn, params, batch, normalizer, 1)
        micro = accumulate_gradients(loss_fn, params, batch, normalizer, 4)
        out, _ = models.forward(params, config, batch.tokens, positions=batch.positions,
                                segment_ids=batch.segment_ids)
        logp = models.token_logprobs(out, batch.targets)
        return full, micro, algo.decoupled_policy_loss(logp, logp, batch.old_logp, batch.advantages,
                                                       batch.loss_mask, is_cap=1.5)

    full, micro, (loss, metrics) = full_micro_and_algo(params, batch)
    _assert_trees_close(full, micro)
    np.testing.assert_allclose(full[0], loss, rtol=1e-5)
    tokens = float(batch.loss_mask.sum())
    for name in ("behaviour_ratio_mean", "behaviour_ratio_capped", "clip_frac"):
        np.testing.assert_allclose(micro[1]["token_sums"][name] / tokens, metrics[name], rtol=1e-5)
    assert 0 < float(metrics["behaviour_ratio_capped"]) < 1


def test_loss_config_errors():
    with pytest.raises(ValueError, match="rollout_is_cap must be None"):
        RLLossConfig(off_policy_correction="decoupled", rollout_is_cap=2.0, old_logprobs="recompute")
    with pytest.raises(ValueError, match="off_policy_correction='tis'"):
        RLLossConfig(off_policy_correction="tis")
    with pytest.raises(ValueError, match="decoupled_is_cap must be > 1"):
        RLLossConfig(off_policy_correction="decoupled", decoupled_is_cap=1.0)
    with pytest.raises(ValueError, match="needs old_logprobs='recompute'"):
        RLLossConfig(rollout_is_cap=2.0)
    with pytest.raises(ValueError, match="importance_sampling_level='seq'"):
        RLLossConfig(importance_sampling_level="seq")
    with pytest.raises(ValueError, match="rollout_mask='row'"):
        RLLossConfig(rollout_mask="row", old_logprobs="recompute")
    with pytest.raises(ValueError, match="rollout_is_cap must be > 1"):
        RLLossConfig(rollout_is_cap=1.0, old_logprobs="recompute")
    with pytest.raises(ValueError, match="kl='k9'"):
        RLLossConfig(kl="k9")
    assert RLLossConfig().dual_clip == 3.0


def test_nan_in_masked_positions_stays_out_of_the_step(tiny_model, rl_batch):
    config, params = tiny_model
    masked_out = rl_batch.loss_mask == 0
    dirty = rl_batch.replace(
        sampler_logp=np.where(masked_out, np.nan, rl_batch.sampler_logp).astype(np.float32),
        advantages=np.where(masked_out, np.inf, rl_batch.advantages).astype(np.float32),
    )
    optimizer = make_optimizer(1e-3, warmup_steps=1)
    step = make_rl_step(config, optimizer, RLLossConfig(entropy_coef=0.01), compiler_options=FAST_COMPILE)
    clean_state, clean = step(init_train_state(copy_tree(params), optimizer, 0), rl_batch)
    dirty_state, got = step(init_train_state(copy_tree(params), optimizer, 0), dirty)
    assert all(np.isfinite(float(v)) for v in got.values())
    for key, value in clean.items():
        np.testing.assert_allclose(got[key], value, rtol=1e-6, err_msg=key)
    _assert_trees_close(dirty_state.params, clean_state.params, rtol=0, atol=0)
