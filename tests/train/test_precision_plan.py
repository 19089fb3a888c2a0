"""The memory plan of an FP8 rollout engine: KV pool bytes by the engine's KV dtype, engine weight bytes
by its weight dtype, and the table naming both (no step compiled: the plan's arithmetic only)."""

import dataclasses
import types

import jax
import numpy as np
import pytest

from rstar2jax import models
from rstar2jax.engine.paged_attention import kv_bytes_per_token
from rstar2jax.train import memory_plan, parse
from tests.train.scripted import tiny_rl_config


def _plan(options, model_config, **engine_fields):
    """The plan of ``options`` with its rollout engine's fields replaced, for abstract float32 params."""
    rl = options.rl
    engine = dataclasses.replace(rl.rollout.engine, **engine_fields)
    options = dataclasses.replace(options, rl=dataclasses.replace(
        rl, rollout=dataclasses.replace(rl.rollout, engine=engine)))
    params = jax.eval_shape(lambda: models.init_params(model_config, jax.random.key(0)))
    state = types.SimpleNamespace(params=params, opt_state={})
    report = dict(devices=1, platform="cpu", peak_estimate_bytes=0, temp_size_in_bytes=0)
    return memory_plan.memory_plan(options, model_config, state, report), params


def test_fp8_engine_halves_the_kv_pool_and_shrinks_the_engine_weights(tmp_path):
    options = parse(tiny_rl_config(str(tmp_path)))
    model_config = dataclasses.replace(options.model, compute_dtype="bfloat16")
    base, params = _plan(options, model_config)
    fp8, _ = _plan(options, model_config, kv_dtype="fp8", weight_dtype="fp8", weight_block=32)
    L, K, Dh = model_config.num_layers, model_config.num_kv_heads, model_config.head_dim
    assert memory_plan.kv_bytes_per_token(model_config, "fp8") == 2 * L * K * (Dh + 2)
    assert kv_bytes_per_token(model_config) == 2 * L * K * Dh * 2
    assert fp8["kv_pool_gib"] / base["kv_pool_gib"] == pytest.approx((Dh + 2) / (2 * Dh))
    assert (base["kv_dtype"], fp8["kv_dtype"], fp8["engine_weight_dtype"]) == ("bfloat16", "fp8", "fp8")
    # float32 params: the bfloat16 engine casts every leaf; the FP8 one makes a byte (and a float32 scale
    # per 32 x 32 block) per projection value and casts the rest.
    projections = sum(np.prod(v.shape) for k, v in params["layers"].items() if k.endswith("_proj"))
    total = sum(np.prod(x.shape) for x in jax.tree.leaves(params))
    assert base["engine_weight_cast_gib"] * 2**30 == 2 * total
    assert fp8["engine_weight_cast_gib"] * 2**30 == projections * (1 + 4 / 32**2) + 2 * (total - projections)
    table = memory_plan.format_plan(fp8)
    assert "engine weights (fp8)" in table and "KV page pool (fp8)" in table
    head, _ = _plan(options, model_config, weight_dtype="fp8", weight_block=32, quantize_head=True)
    embed = np.prod(params["embed"].shape)  # tied: an FP8 head copy beside the bfloat16 embedding
    assert (head["engine_weight_cast_gib"] - fp8["engine_weight_cast_gib"]) * 2**30 == pytest.approx(
        embed * (1 + 4 / 32**2))


def test_the_asynchronous_engine_is_counted_beside_the_trainer(tmp_path):
    """Colocated, the asynchronous producer's engine (a whole fresh copy in the compute dtype, its pool)
    decodes through the update: both peaks count it. Split, the rollout device holds the engine alone."""
    config = tiny_rl_config(str(tmp_path))
    config.rl.schedule = "async"
    colocated = parse(config)
    config.rl.placement = "split"
    split = parse(config)
    model_config = dataclasses.replace(colocated.model, compute_dtype="float32")
    step = dict(devices=1, platform="cpu", peak_estimate_bytes=10 * 2**20, temp_size_in_bytes=0)
    params = jax.eval_shape(lambda: models.init_params(model_config, jax.random.key(0)))
    state = types.SimpleNamespace(params=params, opt_state={})
    total = sum(np.prod(x.shape) * 4 for x in jax.tree.leaves(params))
    plan = memory_plan.memory_plan(colocated, model_config, state, step)
    engine = (plan["engine_weight_cast_gib"] + plan["kv_pool_gib"] + plan["decode_temporaries_gib"]) * 2**30
    assert plan["engine_weight_cast_gib"] * 2**30 == total  # float32 kept, yet a copy of its own
    assert plan["train_peak_gib"] * 2**30 == pytest.approx(10 * 2**20 + engine)
    assert plan["rollout_peak_gib"] == plan["train_peak_gib"]
    assert not plan["optimizer_offloaded_during_rollout"]
    assert "engine weights (float32)" in memory_plan.format_plan(plan)
    apart = memory_plan.memory_plan(split, model_config, state, step)
    assert apart["rollout_peak_gib"] * 2**30 == pytest.approx(engine)
    assert apart["train_peak_gib"] * 2**30 == 10 * 2**20
