"""The per-device memory plan of an RL run: what the rollout phase and the training phase each hold.

Colocated RL alternates two phases on the same devices (``rstar2jax.schedules.colocate``):

  rollout peak = params + engine weights + KV page pool + decode temporaries
                 [+ optimizer state + reference params, unless they wait in host memory]
  (LoRA: params are the adapters; the frozen base waits in host memory with the optimizer state or stays,
  and the engine's weights are the merged copy ``W + s A B`` in the compute dtype)
  (engine weights: the engine's own copy, a cast to the compute dtype where that differs, or with
  ``rollout.engine.weight_dtype="fp8"`` the projections in FP8, a byte per value plus a float32 scale per
  128 x 128 block; the KV pool: ``rollout.engine.kv_dtype``'s bytes per token, about half for FP8 pages)
  train peak   = compiled step peak (arguments + outputs - aliased + temporaries: params, optimizer state,
                 batch, gradients, activations); the KV page pool lives only while the engine runs

The asynchronous schedule (``rl.schedule="async"``) keeps its engine running through the update, whole on
one device of each process, with its own copy of the weights in fresh buffers: colocated, that device holds
both phases at once (both peaks: the larger of the rollout peak and the step's peak plus the engine's
weights, KV pool and decode temporaries; the optimizer state never leaves the device); split
(``rl.placement="split"``), the rollout peak is the rollout device's (the engine alone).

Sizes are per device, from the abstract train state's shardings and XLA's memory analysis of the compiled
``rl_step`` (``runner.dry_run``); the KV pool and the decode temporaries follow from the engine's shapes. A
plan whose larger peak exceeds ``config.device_memory_gib`` fails at start-up with the table, instead of
running out of memory in the middle of a run.
"""

from __future__ import annotations

import json
import math
import pathlib
from typing import Any

import jax
import numpy as np

from rstar2jax.config.options import ConfigError, RunOptions
from rstar2jax.engine import paged_attention
from rstar2jax.models.config import FP8
from rstar2jax.models.quantization import LINEAR_WEIGHTS, fp8_weight_bytes
from rstar2jax.schedules.colocate import resolve_offload

GIB = float(2**30)


class MemoryPlanError(ConfigError):
    """The configured run does not fit its devices; the message holds the whole plan (launchers exit 2)."""


def _elements_per_device(leaf, whole: bool = False) -> int:
    sharding = None if whole else getattr(leaf, "sharding", None)
    return math.prod(sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape)


def tree_bytes_per_device(tree: Any) -> int:
    """Bytes one device holds of an (abstract or concrete) array tree placed with ``NamedSharding``s."""
    return sum(_elements_per_device(leaf) * np.dtype(leaf.dtype).itemsize for leaf in jax.tree.leaves(tree))


def kv_bytes_per_token(model_config, dtype: str | None = None) -> int:
    """Keys and values of one token over all layers: ``2 * layers * kv_heads * head_dim * itemsize``; for
    ``dtype="fp8"`` (an engine's ``kv_dtype``) ``2 * layers * kv_heads * (head_dim + 2)``, a byte per element
    and a bfloat16 scale per head (``engine.paged_attention.kv_bytes_per_token``)."""
    return paged_attention.kv_bytes_per_token(model_config, dtype)


def engine_weight_bytes(weights: Any, model_config, engine_config, *, merged: bool = False,
                        whole: bool = False) -> int:
    """Per-device bytes of the engine's own copy of ``weights`` (an abstract or concrete, sharded tree):
    with ``engine_config.weight_dtype="fp8"`` each projection in FP8 (a byte per value, a float32 scale per
    block) and the output head too with ``quantize_head`` (tied: an FP8 copy beside the embedding); every
    other leaf cast to the compute dtype where its dtype differs, or always for a LoRA run's ``merged``
    copy; leaves the engine uses as they are cost nothing. ``whole``: the copy is a full replica on one
    device (the asynchronous producer's engine), always in fresh buffers."""
    fp8 = engine_config.weight_dtype == FP8
    compute = np.dtype(model_config.compute_dtype)
    total = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(weights):
        names = [getattr(key, "key", None) for key in path]
        elements = _elements_per_device(leaf, whole)
        projection = names[0] == "layers" and names[-1] in LINEAR_WEIGHTS
        if fp8 and (projection or (engine_config.quantize_head and names[0] == "lm_head")):
            total += fp8_weight_bytes(elements, engine_config.weight_block)
            continue
        if merged or whole or np.dtype(leaf.dtype) != compute:
            total += elements * compute.itemsize
        if fp8 and engine_config.quantize_head and names[0] == "embed" and model_config.tie_word_embeddings:
            total += fp8_weight_bytes(elements, engine_config.weight_block)
    return total


def device_memory_gib(options: RunOptions) -> float | None:
    """The config's ``device_memory_gib``, else what the first device reports (accelerators), else None."""
    if options.rl is not None and options.rl.device_memory_gib:
        return float(options.rl.device_memory_gib)
    stats = jax.devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    return limit / GIB if limit else None


def memory_plan(
    options: RunOptions, model_config, abstract_state, step_report: dict[str, Any], base: Any = None
) -> dict[str, Any]:
    """The per-device plan of both phases (GiB), with ``rollout_peak_gib``, ``train_peak_gib``,
    ``device_memory_gib`` and ``fits``. ``step_report`` is ``runner.dry_run``'s compiled-step report;
    ``base``: a LoRA run's frozen base parameters (abstract), whose state holds the adapters."""
    mesh, rl = options.mesh, options.rl
    data_parallel = mesh.data_parallel
    kv_split = mesh.tensor if model_config.num_kv_heads % mesh.tensor == 0 else 1
    params = tree_bytes_per_device(abstract_state.params)
    optimizer = tree_bytes_per_device(abstract_state.opt_state)
    frozen = 0 if base is None else tree_bytes_per_device(base)
    reference = params if rl.loss.kl_coef and base is None else 0
    engine = rl.rollout.engine
    weights = abstract_state.params if base is None else base
    # The asynchronous producer's engine is whole on one device (no data or tensor split) and stays while
    # the trainer updates: colocated, the first device holds both phases at once; split, it has its own.
    producer = rl.schedule == "async"
    shards = 1 if producer else data_parallel
    cast = engine_weight_bytes(weights, model_config, engine, merged=base is not None,  # LoRA: merged copy
                               whole=producer)
    pool_tokens = rl.rollout.kv_pool_tokens
    kv_pool = pool_tokens * kv_bytes_per_token(model_config, engine.kv_dtype) // (shards * (
        1 if producer else kv_split))
    # float32 logits, probabilities and their sort for top-p, one row per engine slot.
    slots = -(-rl.rollout.engine.num_slots // shards)
    decode_temporaries = 3 * slots * model_config.vocab_size * 4
    offload = not producer and resolve_offload(rl.optimizer_memory, step_report["platform"])
    waiting = 0 if offload else optimizer + reference + frozen
    rollout_peak = params + cast + kv_pool + decode_temporaries + waiting
    gradients = params
    train_peak = step_report["peak_estimate_bytes"]  # the KV pool is freed when the rollout ends
    if producer and rl.placement == "split":  # the rollout device holds the engine only
        rollout_peak = cast + kv_pool + decode_temporaries
    elif producer:  # colocated: the engine decodes while the step runs
        rollout_peak = train_peak = max(rollout_peak, train_peak + cast + kv_pool + decode_temporaries)
    memory = device_memory_gib(options)
    plan = {
        "devices": step_report["devices"],
        "platform": step_report["platform"],
        "params_gib": params / GIB,
        "frozen_base_gib": frozen / GIB,
        "gradients_gib": gradients / GIB,
        "optimizer_state_gib": optimizer / GIB,
        "reference_params_gib": reference / GIB,
        "activations_peak_gib": max(step_report["temp_size_in_bytes"] - gradients, 0) / GIB,
        "step_temporaries_gib": step_report["temp_size_in_bytes"] / GIB,
        "engine_weight_cast_gib": cast / GIB,
        "engine_weight_dtype": engine.weight_dtype or model_config.compute_dtype,
        "kv_pool_gib": kv_pool / GIB,
        "kv_dtype": engine.kv_dtype or model_config.compute_dtype,
        "kv_pool_tokens": pool_tokens,
        "decode_temporaries_gib": decode_temporaries / GIB,
        "optimizer_offloaded_during_rollout": offload,
        "engine_beside_trainer": producer and rl.placement != "split",
        "rollout_peak_gib": rollout_peak / GIB,
        "train_peak_gib": train_peak / GIB,
        "device_memory_gib": memory,
    }
    plan["fits"] = None if memory is None else max(plan["rollout_peak_gib"], plan["train_peak_gib"]) <= memory
    return plan


def format_plan(plan: dict[str, Any]) -> str:
    """The plan as a table (GiB per device)."""
    beside = plan.get("engine_beside_trainer", False)  # the asynchronous engine decodes through the update
    engine = {k: plan[k] if beside else 0.0 for k in ("engine_weight_cast_gib", "kv_pool_gib",
                                                      "decode_temporaries_gib")}
    rows = [
        ("parameters", plan["params_gib"], plan["params_gib"]),
        (
            "frozen base (LoRA)",
            0.0 if plan["optimizer_offloaded_during_rollout"] else plan["frozen_base_gib"],
            plan["frozen_base_gib"],
        ),
        (f"engine weights ({plan['engine_weight_dtype']})", plan["engine_weight_cast_gib"],
         engine["engine_weight_cast_gib"]),
        (f"KV page pool ({plan['kv_dtype']})", plan["kv_pool_gib"], engine["kv_pool_gib"]),
        ("decode temporaries", plan["decode_temporaries_gib"], engine["decode_temporaries_gib"]),
        (
            "optimizer state",
            0.0 if plan["optimizer_offloaded_during_rollout"] else plan["optimizer_state_gib"],
            plan["optimizer_state_gib"],
        ),
        (
            "reference params",
            0.0 if plan["optimizer_offloaded_during_rollout"] else plan["reference_params_gib"],
            plan["reference_params_gib"],
        ),
        ("gradients", 0.0, plan["gradients_gib"]),
        ("activations (peak)", 0.0, plan["activations_peak_gib"]),
    ]
    lines = [
        f"memory plan per device ({plan['devices']} {plan['platform']} devices), GiB:",
        f"  {'':<27} {'rollout':>9} {'train':>9}",
    ]
    lines += [f"  {name:<27} {rollout:9.2f} {train:9.2f}" for name, rollout, train in rows]
    lines.append(f"  {'peak':<27} {plan['rollout_peak_gib']:9.2f} {plan['train_peak_gib']:9.2f}")
    memory = plan["device_memory_gib"]
    if memory is None:
        lines.append("  device memory unknown (set config.device_memory_gib to check the plan)")
    else:
        verdict = "fits" if plan["fits"] else "DOES NOT FIT"
        lines.append(f"  device memory {memory:.1f} GiB: {verdict}")
    lines.append(
        f"  (KV pool: {plan['kv_pool_tokens']:,} tokens; train peak also counts params, optimizer state and "
        "the batch, as XLA compiled the step)"
    )
    return "\n".join(lines)


def write_plan(plan: dict[str, Any], workdir: str | pathlib.Path) -> pathlib.Path:
    """Writes ``memory_plan.json`` in ``workdir`` and returns its path."""
    path = pathlib.Path(workdir) / "memory_plan.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(plan, indent=1) + "\n")
    return path


def check_plan(plan: dict[str, Any]) -> None:
    """Raises ``MemoryPlanError`` with the table when a known device memory is exceeded."""
    if plan["fits"] is False:
        raise MemoryPlanError(
            f"the run does not fit {plan['device_memory_gib']:.1f} GiB per device:\n{format_plan(plan)}\n"
            "lower config.rollout.kv_cache_tokens or engine_slots, use remat / more micro-batches, offload "
            "the optimizer state (config.colocate.optimizer_memory) or shard over more devices"
        )
