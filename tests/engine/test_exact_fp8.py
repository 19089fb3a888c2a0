"""Exact numerics with an FP8 rollout (issue 52 item 1): FP8 weights (the output head too, reference or native
float8 matmuls) and FP8 KV pages, separately and together, in float32 and bfloat16 compute (and bfloat16
pages under float32 compute). The trainer's exact forward computes through the rollout's quantized weights
and keys/values (``ModelConfig.rollout_precision``), so every sampled token's engine log-prob is the
trainer's bit for bit, LoRA included (merged, then quantized); the ``rl_step``'s mismatch metrics read 0;
the run config takes exact + FP8 and hands the precision to the trainer; the gradient passes straight
through the rounding.

Speed: five engine configs, one trainer shape per (dtype, precision), as in ``test_exact.py``."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from experiments.configs import tiny_cpu
from rstar2jax import models
from rstar2jax.engine import generate
from rstar2jax.models import RolloutPrecision, exact_kernels, quantization
from rstar2jax.train import init_train_state, make_rl_step, parse
from rstar2jax.train import lora as lora_lib
from tests.engine.test_exact import FOUR_SLOTS, _assert_sampled_are_the_trainers, _rl_batch, _trainer_logprobs
from tests.engine.test_exact_lora import LORA, _adapters
from tests.train.scripted import set_fields

WEIGHTS = dict(weight_dtype="fp8", weight_block=32)  # 32 divides every tiny weight's matrix view
ALL = dict(WEIGHTS, quantize_head=True, kv_dtype="fp8")
CASES = {  # (compute dtype, the engine's precision fields)
    "weights-float32": ("float32", WEIGHTS),
    "kv-bfloat16": ("bfloat16", dict(kv_dtype="fp8")),
    "all-native-float32": ("float32", dict(ALL, fp8_matmul="native")),
    "all-bfloat16": ("bfloat16", ALL),
    "bfloat16-pages-float32": ("float32", dict(kv_dtype="bfloat16")),  # a float page dtype: a rounding
}


def _configs(tiny_qwen3, case):
    """(model config with the rollout's precision, the same without it, engine config, params)."""
    dtype, fields = CASES[case]
    engine = dataclasses.replace(FOUR_SLOTS, **fields)
    plain = models.preset("tiny", numerics="exact", compute_dtype=dtype)
    return (dataclasses.replace(plain, rollout_precision=engine.rollout_precision), plain, engine,
            tiny_qwen3.params)


@pytest.mark.parametrize("case", list(CASES))
def test_fp8_rollout_logprobs_are_the_trainers_bit_for_bit(tiny_qwen3, case):
    """Prompts of random lengths sampled on four slots (they wait for pages; freed pages poisoned): each
    token's engine log-prob is the quantized trainer's exactly, and not the unquantized trainer's."""
    config, plain, engine, params = _configs(tiny_qwen3, case)
    rng = np.random.default_rng(len(case))
    prompts = [rng.integers(0, 256, n).tolist() for n in (4, 23, 9)]
    gens = generate(params, config, prompts, max_new_tokens=10, temperature=1.0, engine_config=engine, seed=3)
    records = [(p, g.tokens, [1] * len(g.tokens), g.logprobs) for p, g in zip(prompts, gens, strict=True)]
    _assert_sampled_are_the_trainers(params, config, records, row_of=[1, 0, 1])
    sequences = [list(p) + list(g.tokens) for p, g in zip(prompts, gens, strict=True)]
    unquantized = _trainer_logprobs(params, plain, sequences, [1, 0, 1])
    gaps = [np.abs(np.asarray(g.logprobs, np.float32) - u[len(p) - 1:]).max()
            for p, g, u in zip(prompts, gens, unquantized, strict=True)]
    assert max(gaps) > 1e-3  # the rollout's precision changes the numbers: the trainer follows it


def test_rl_step_mismatch_metrics_read_zero_with_an_fp8_rollout(tiny_qwen3):
    """FP8 weights, head and KV pages, native float8 matmuls: engine samples packed into rows and split into
    two micro-batches, the ``rl_step``'s sampler-vs-trainer mismatch metrics read exactly 0."""
    config, _, engine, params = _configs(tiny_qwen3, "all-native-float32")
    rng = np.random.default_rng(11)
    prompts = [rng.integers(0, 256, n).tolist() for n in (5, 12, 3, 20)]
    gens = generate(params, config, prompts, max_new_tokens=8, temperature=1.0, engine_config=engine, seed=2)
    batch = _rl_batch(prompts, gens)
    optimizer = optax.sgd(1e-3)
    step = make_rl_step(config, optimizer, num_microbatches=2)
    state, metrics = step(init_train_state(jax.tree.map(jnp.copy, params), optimizer, 0), batch)
    assert float(metrics["tokens"]) == 8 * len(prompts)
    assert float(metrics["mismatch_abs_log_ratio"]) == float(metrics["mismatch_k3_kl"]) == 0.0
    assert all(bool(jnp.isfinite(leaf).all()) for leaf in jax.tree.leaves(state.params))


def test_lora_merged_then_quantized_is_the_trainers_bit_for_bit(tiny_qwen3):
    """LoRA with FP8 weights, head and pages: the engine quantizes the merged ``W + s A B`` a LoRA run's
    rollout builds; the trainer, adapters attached, merges each layer and quantizes that: the same bits."""
    config, _, engine, params = _configs(tiny_qwen3, "all-native-float32")
    adapters = _adapters(config)
    rng = np.random.default_rng(21)
    prompts = [rng.integers(0, 256, n).tolist() for n in (6, 17, 3)]
    merged = lora_lib.FrozenBase(params, config, LORA).rollout(generate).policy_params(adapters)
    gens = generate(merged, config, prompts, max_new_tokens=8, temperature=1.0, engine_config=engine, seed=4)
    records = [(p, g.tokens, [1] * len(g.tokens), g.logprobs) for p, g in zip(prompts, gens, strict=True)]
    attached = models.lora.attach(params, adapters, LORA, merge_in_forward=True)
    _assert_sampled_are_the_trainers(attached, config, records, row_of=[1, 0, 1])


def test_the_gradient_passes_straight_through_the_rounding(tiny_qwen3):
    """A quantized projection's gradient is the plain product's against the dequantized weight (reference and
    native); the model's gradient with FP8 weights, head and pages is finite and close to the unquantized
    one."""
    x, w = jax.random.normal(jax.random.key(0), (8, 64)), jax.random.normal(jax.random.key(1), (64, 4, 16))
    cotangent, spec = jax.random.normal(jax.random.key(2), (8, 4, 16)), "nd,dhk->nhk"
    for native in (False, True):
        q = quantization.quantize_weight(w, in_axes=1, block=32, native=native)
        through = lambda x, w, q=q: quantization.einsum(spec, x, quantization.StraightThroughFp8(w, q))
        np.testing.assert_array_equal(through(x, w), quantization.einsum(spec, x, q))  # the quantized product
        got = jax.vjp(through, x, w)[1](cotangent)
        want = jax.vjp(lambda x, d: jnp.einsum(spec, x, d), x, quantization.dequantize(q))[1](cotangent)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)

    # Initial weights: the largest relative error of a parameter's gradient measured 0.12 (0.07 with FP8
    # weights alone); the engine tests' larger weights, whose rounding moves more, 0.38.
    config, plain_config, _, _ = _configs(tiny_qwen3, "all-native-float32")
    params = models.init_params(config, jax.random.key(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, (1, 33)), jnp.int32)

    def gradient(config):
        loss = lambda p: models.sequence_logprobs(p, config, tokens[:, :-1], tokens[:, 1:])[0].sum()
        return jax.jit(jax.grad(loss))(params)

    quantized, unquantized = gradient(config), gradient(plain_config)
    for (path, g), u in zip(jax.tree_util.tree_leaves_with_path(quantized), jax.tree.leaves(unquantized),
                            strict=True):
        assert bool(jnp.isfinite(g).all()), path
        assert float(jnp.linalg.norm(g - u) / jnp.linalg.norm(u)) < 0.25, path


def test_run_config_takes_exact_fp8_and_the_trainer_computes_through_it():
    """``rollout.numerics='exact'`` with FP8 weights, head and pages: parsed, the policy's model carries the
    engine's precision, 'auto' pi_old is the sampler's without TIS (no gap to correct), with LoRA too; a
    model whose precision the engine does not sample in, a ValueError before any work."""
    fp8 = {"rollout.numerics": "exact", "rollout.weight_dtype": "fp8", "rollout.weight_block": 32,
           "rollout.quantize_head": True, "rollout.kv_dtype": "fp8"}
    parsed = lambda **fields: parse(set_fields(tiny_cpu.get_config(), {**fp8, **fields}))  # a fresh config
    options = parsed()
    precision = options.policy.model.rollout_precision
    assert precision == options.rl.rollout.engine.rollout_precision == RolloutPrecision(**ALL)
    assert (options.rl.loss.old_logprobs, options.rl.loss.rollout_is_cap) == ("sampler", None)
    default = parsed(**{"rollout.numerics": "default"})
    assert default.policy.model.rollout_precision == RolloutPrecision()
    assert default.rl.loss.old_logprobs == "recompute"  # the default numerics keep their correction
    lora = parsed(**{"model.lora.rank": 2})  # the trainer quantizes the merged weights, as the engine does
    assert lora.policy.model.rollout_precision == precision
    with pytest.raises(ValueError, match="rollout_precision=.* is for numerics='exact'"):
        dataclasses.replace(default.policy.model, rollout_precision=precision)
    exact_plain = models.preset("tiny", numerics="exact")
    with pytest.raises(ValueError, match="the engine samples with .*weight_dtype='fp8'"):
        generate(models.init_params(exact_plain, jax.random.key(0)), exact_plain, [[1, 2]], max_new_tokens=1,
                 engine_config=dataclasses.replace(FOUR_SLOTS, **WEIGHTS))


def test_the_exact_kernels_leave_fp8_rollouts_to_xla():
    """The Pallas kernels take neither FP8 weights nor FP8 pages: ``"auto"`` runs XLA's exact programs for an
    FP8 rollout, a forced ``"pallas_triton"`` is a ValueError naming why."""
    for fields in (WEIGHTS, dict(kv_dtype="fp8")):
        config = models.preset("tiny", numerics="exact", rollout_precision=RolloutPrecision(**fields))
        assert "FP8 rollout" in exact_kernels.unsupported_reason(config)
        assert exact_kernels.resolve(config) == "xla"
        with pytest.raises(ValueError, match="exact_kernels='pallas_triton' cannot run this model: an FP8"):
            exact_kernels.resolve(dataclasses.replace(config, exact_kernels="pallas_triton"))
