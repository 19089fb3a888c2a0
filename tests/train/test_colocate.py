"""Colocation: host offload round trips, the RL loop with the optimizer in host memory, memory plans."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from rstar2jax import models
from rstar2jax.schedules import colocate
from rstar2jax.train import memory_plan, parse, train_rl
from rstar2jax.train.dry_run_report import dry_run
from tests.train.scripted import MAIN_HISTORY, make_scripted_rollout, tiny_rl_config

TIMING = ("time/", "throughput/")


def _device_bytes() -> int:
    return sum(x.nbytes for x in jax.live_arrays() if x.sharding.memory_kind == "device")


@pytest.mark.needs_devices(8)
def test_offload_round_trip_is_bit_identical_and_frees_device_memory():
    mesh = models.make_mesh(data=2, tensor=4)
    sharding = NamedSharding(mesh, PartitionSpec("data", "tensor"))
    tree = {
        "mu": jax.device_put(jax.random.normal(jax.random.key(0), (256, 512)), sharding),
        "count": jnp.int32(7),
        "nu": jax.device_put(jnp.arange(256 * 512, dtype=jnp.bfloat16).reshape(256, 512), sharding),
    }
    expected = jax.tree.map(np.asarray, tree)
    before = _device_bytes()
    parked = colocate.to_host(tree)
    assert colocate.memory_kinds(parked) == {"pinned_host"}
    assert all(x.is_deleted() for x in jax.tree.leaves(tree))
    assert before - _device_bytes() >= sum(x.nbytes for x in jax.tree.leaves(parked))
    back = colocate.to_device(parked)
    assert colocate.memory_kinds(back) == {"device"}
    assert back["mu"].sharding == sharding and back["nu"].dtype == jnp.bfloat16
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, back), expected)
    # Already where it belongs: nothing is copied or deleted.
    assert colocate.to_device(back)["mu"] is back["mu"]


def test_resolve_offload():
    assert colocate.resolve_offload("auto", "cpu") is False
    assert colocate.resolve_offload("host") is True  # the CPU backend offers pinned host memory too
    assert colocate.resolve_offload("device") is False
    with pytest.raises(ValueError, match="expected one of"):
        colocate.resolve_offload("yes")


def _metrics(history):
    return [{k: v for k, v in m.items() if not k.startswith(TIMING)} for m in history]


def test_rl_with_optimizer_offloaded_matches_on_device_run(tmp_path):
    """Parking the AdamW moments in host memory during rollout changes no number of the run. On the CPU the
    on-device run is the default config's, synchronous and on-policy: it keeps the numbers main's code gave
    before rollouts could cross an update (``MAIN_HISTORY``; within 1e-6, equal on the machine that made
    them), with no policy lag."""
    histories = []
    for offload in ("device", "host"):
        config = tiny_rl_config(str(tmp_path / f"offload_{offload}"))
        config.colocate.optimizer_memory = offload
        histories.append(_metrics(train_rl(parse(config), rollout_fn=make_scripted_rollout(), max_steps=2)))
    assert len(histories[0]) == 2
    assert histories[0] == histories[1]
    if jax.default_backend() == "cpu":  # "auto" (the default) keeps the moments on the device there
        for record, expected in zip(histories[0], MAIN_HISTORY, strict=True):
            assert {k: record[k] for k in expected} == pytest.approx(expected, rel=1e-6, abs=0)
            assert record["rollout/policy_lag_mean"] == record["rollout/policy_lag_max"] == 0.0
            assert not any(k.startswith("rollout/partial") for k in record)


def test_memory_plan_adds_up_and_fails_when_too_small(tmp_path):
    config = tiny_rl_config(str(tmp_path / "run"))
    config.model.param_dtype, config.model.compute_dtype = "float32", "bfloat16"
    config.rollout.kv_cache_tokens = 4096
    config.colocate.optimizer_memory = "device"
    options = parse(config)
    report = dry_run(options)
    plan = report["memory_plan"]
    model_config = options.model
    gib = 2.0**30
    num_params = report["num_params"]
    assert plan["params_gib"] == pytest.approx(num_params * 4 / gib)
    assert plan["engine_weight_cast_gib"] == pytest.approx(num_params * 2 / gib)
    per_token = 2 * model_config.num_layers * model_config.num_kv_heads * model_config.head_dim * 2
    assert memory_plan.kv_bytes_per_token(model_config) == per_token
    assert plan["kv_pool_gib"] == pytest.approx(4096 * per_token / gib)
    parts = ("params_gib", "engine_weight_cast_gib", "kv_pool_gib", "decode_temporaries_gib")
    waiting = plan["optimizer_state_gib"] + plan["reference_params_gib"]
    assert plan["rollout_peak_gib"] == pytest.approx(sum(plan[k] for k in parts) + waiting)
    assert plan["train_peak_gib"] == pytest.approx(report["peak_estimate_bytes"] / gib)
    # None on the CPU backend; on an accelerator, the memory the device reports.
    assert plan["device_memory_gib"] == memory_plan.device_memory_gib(options)
    if plan["device_memory_gib"] is None:
        assert plan["fits"] is None

    config.colocate.optimizer_memory = "host"
    config.device_memory_gib = 1e-4
    plan = dry_run(parse(config))["memory_plan"]
    assert plan["rollout_peak_gib"] == pytest.approx(sum(plan[k] for k in parts))
    assert plan["train_peak_gib"] == pytest.approx(report["peak_estimate_bytes"] / gib)
    assert plan["fits"] is False
    with pytest.raises(memory_plan.MemoryPlanError, match="does not fit") as error:
        memory_plan.check_plan(plan)
    assert "KV page pool" in str(error.value) and "optimizer state" in str(error.value)
    path = memory_plan.write_plan(plan, tmp_path / "plan")
    written = json.loads(path.read_text())
    assert {"rollout_peak_gib", "train_peak_gib", "device_memory_gib"} <= set(written)


def test_one_gpu_config_fits_80_gib(tmp_path):
    """The shipped Qwen3-1.7B single-GPU config: both phases fit 80 GiB (compiled on the CPU, abstract)."""
    from experiments.configs import qwen3_1p7b_1gpu

    config = qwen3_1p7b_1gpu.get_config()
    config.workdir = str(tmp_path)
    plan = dry_run(parse(config, check_data=False))["memory_plan"]
    assert plan["device_memory_gib"] == 80.0 and plan["fits"] is True
    assert 0 < plan["rollout_peak_gib"] <= 80.0 and 0 < plan["train_peak_gib"] <= 80.0
    assert plan["optimizer_offloaded_during_rollout"] and plan["kv_pool_tokens"] == 256 * 1024


def test_rollout_frees_its_kv_pool(tiny_model):
    """Each rollout builds its engine's page pool and frees it when it ends: no pool buffer stays live."""
    from rstar2jax import engine

    config, params = tiny_model
    pages, page_size = 37, 16  # a pool shape no other live array has
    engine_config = engine.EngineConfig(num_slots=4, max_len=64, page_size=page_size, num_pages=pages)
    pool_shape = (config.num_kv_heads, pages, page_size, config.head_dim)

    def pool_buffers():
        return [x for x in jax.live_arrays() if x.shape == pool_shape]

    assert not pool_buffers()
    outputs = engine.generate(params, config, [[1, 2, 3]], max_new_tokens=4, engine_config=engine_config)
    assert len(outputs) == 1 and len(outputs[0].tokens) == 4
    assert not pool_buffers()
