"""Compile-and-report without allocating: the per-device memory of a run's train step on its mesh
(``dry_run``, ``format_dry_run``) and the RL memory plan check at start-up (``check_memory_plan``)."""

from __future__ import annotations

import logging
import math
import time
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from rstar2jax import models
from rstar2jax.config.options import RunOptions
from rstar2jax.data.batch import Batch
from rstar2jax.policy import adapters as lora_lib
from rstar2jax.train import memory_plan as memory_plan_lib
from rstar2jax.train.run import abstract_state
from rstar2jax.train.runtime import mesh_from_config
from rstar2jax.train.state import optimizer_from_options
from rstar2jax.train.steps import batch_sharding, make_rl_step, make_sft_step, state_shardings

logger = logging.getLogger(__name__)


def _abstract_batch(rows: int, seq_len: int, sharding, *, rl: bool) -> Batch:
    def leaf(dtype):
        return jax.ShapeDtypeStruct((rows, seq_len), dtype, sharding=sharding)

    extra = dict(advantages=leaf(np.float32), sampler_logp=leaf(np.float32)) if rl else {}
    return Batch(
        tokens=leaf(np.int32),
        targets=leaf(np.int32),
        positions=leaf(np.int32),
        segment_ids=leaf(np.int32),
        loss_mask=leaf(np.float32),
        **extra,
    )


def dry_run(options: RunOptions, *, cpu_stand_in: bool = True) -> dict[str, Any]:
    """Compiles the run's train step (RL or SFT, ``options.kind``) for the configured mesh on abstract shapes
    (nothing is allocated) and returns per-device memory of the compiled executable plus the shapes it was
    built for. ``options``: ``rstar2jax.config.parse``'s (with ``check_data=False`` no data need exist).

    RL plans for the worst case: every kept trajectory at full length (the longest stage's) on its own row.
    CPU devices stand in for accelerators (``cpu_stand_in``): see ``_stand_in_options``.
    """
    kind = options.kind
    if kind == "rl":
        optimizer = optimizer_from_options(options.optimizer, updates_per_step=options.rl.updates_per_step)
        rows = options.rl.prompts_per_step * options.rl.keep
        seq_len = options.longest_stage.seq_len
    else:
        optimizer = optimizer_from_options(options.optimizer, total_steps=options.sft.steps or 1000)
        rows, seq_len = options.sft.batch_size, options.sft.seq_len
    multiple = options.row_multiple
    rows = -(-rows // multiple) * multiple
    mesh = mesh_from_config(options, allow_emulated=True)
    model_config, lora = options.model, options.lora
    shardings = state_shardings(model_config, optimizer, mesh, reference=options.uses_reference, lora=lora)
    state = abstract_state(model_config, optimizer, shardings, options.seed, lora)
    batch = _abstract_batch(rows, seq_len, batch_sharding(mesh), rl=kind == "rl")
    # LoRA: the frozen base is the step's third argument.
    base = () if lora is None else (abstract_base_params(model_config, mesh),)
    step_options = dict(num_microbatches=options.num_microbatches, mesh=mesh, shardings=shardings, lora=lora,
                        compiler_options=_stand_in_options(model_config, mesh) if cpu_stand_in else None)
    if kind == "rl":
        step = make_rl_step(model_config, optimizer, options.rl.loss, ppo_epochs=options.rl.ppo_epochs,
                            mini_batches=options.rl.mini_batches, **step_options)
    else:
        step = make_sft_step(model_config, optimizer, **step_options)
    start = time.perf_counter()
    compiled = step.lower(state, batch, *base).compile()
    memory = compiled.memory_analysis()
    fields = (
        "argument_size_in_bytes",
        "output_size_in_bytes",
        "alias_size_in_bytes",
        "temp_size_in_bytes",
        "generated_code_size_in_bytes",
    )
    report = {name: int(getattr(memory, name, 0) or 0) for name in fields}
    report["peak_estimate_bytes"] = (
        report["argument_size_in_bytes"]
        + report["output_size_in_bytes"]
        - report["alias_size_in_bytes"]
        + report["temp_size_in_bytes"]
    )
    num_params = sum(math.prod(x.shape) for x in jax.tree.leaves(state.params))
    frozen_params = sum(math.prod(x.shape) for x in jax.tree.leaves(base))
    report.update(
        devices=mesh.size,
        platform=mesh.devices.flat[0].platform,
        mesh=dict(mesh.shape),
        batch_shape=[rows, seq_len],
        microbatch_rows=rows // options.num_microbatches,
        num_params=num_params,
        frozen_params=frozen_params,
        lora=None if lora is None else lora_lib.describe(lora),
        compile_seconds=time.perf_counter() - start,
        attention=models.attention.resolve_implementation(model_config.attention),
        remat_policy=model_config.remat_policy,
        logprobs="vocabulary chunks (models.sequence_logprobs)",
    )
    if kind == "rl":
        report["memory_plan"] = memory_plan_lib.memory_plan(options, model_config, state, report, *base)
    return report


def _stand_in_options(model_config, mesh: Mesh) -> dict | None:
    """XLA options of a dry run on CPU devices standing in for accelerators. XLA:CPU has no bfloat16 / float16
    matmul: it computes them in float32 and hoists the upcast of the layer-stacked weights out of the layer
    loop, an extra float32 copy of every weight that no accelerator makes (55 GiB for Qwen3-14B in bfloat16).
    With weights stored in 16 bits, the CPU compiles the plan without that hoisting, so it counts what the
    accelerator holds; float32 weights compile as they are."""
    if mesh.devices.flat[0].platform != "cpu" or model_config.param_dtype == "float32":
        return None
    return {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}


def abstract_base_params(model_config, mesh: Mesh):
    """Shapes, dtypes and shardings of the model's parameters (a LoRA run's frozen base), unallocated."""
    shapes = jax.eval_shape(lambda: models.init_params(model_config, jax.random.PRNGKey(0)))
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        shapes,
        models.param_shardings(model_config, mesh),
    )


def format_dry_run(report: dict[str, Any]) -> str:
    """A readable table of a ``dry_run`` report (sizes per device, in GiB)."""
    gib = 2.0**30
    trained = f"{report['num_params'] / 1e6:,.1f}M parameters"
    if report.get("lora"):
        trained = (f"{report['num_params'] / 1e6:,.1f}M LoRA parameters (rank {report['lora']['rank']}) on "
                   f"{report['frozen_params'] / 1e6:,.1f}M frozen")
    lines = [
        f"compiled for {report['devices']} {report['platform']} devices, mesh {report['mesh']}, "
        f"{trained}, batch {report['batch_shape']} "
        f"({report['microbatch_rows']} rows per micro-batch), compile {report['compile_seconds']:.1f}s",
        f"attention {report['attention']}, remat {report['remat_policy']}, log-probs by {report['logprobs']}",
        "per-device memory of the compiled step:",
    ]
    for key in (
        "argument_size_in_bytes",
        "output_size_in_bytes",
        "alias_size_in_bytes",
        "temp_size_in_bytes",
        "generated_code_size_in_bytes",
        "peak_estimate_bytes",
    ):
        lines.append(
            f"  {key.removesuffix('_in_bytes').removesuffix('_bytes'):<24} {report[key] / gib:10.3f} GiB"
        )
    if "memory_plan" in report:
        lines.append(memory_plan_lib.format_plan(report["memory_plan"]))
    return "\n".join(lines)


def check_memory_plan(options: RunOptions, *, report: dict[str, Any] | None = None) -> None:
    """RL runs: write the per-device memory plan (``memory_plan.json`` in the work folder) and raise
    ``MemoryPlanError`` with its table when it exceeds a known device memory. Without a dry-run ``report`` (a
    real run) the plan is compiled only when the device memory is known (an accelerator, or
    ``config.device_memory_gib``): fail at start-up rather than out of memory mid-run. The extra compile of
    the step is served by XLA's compilation cache when the run compiles the same step."""
    if options.kind != "rl":
        return
    if report is None:
        if memory_plan_lib.device_memory_gib(options) is None:
            return
        report = dry_run(options)
    path = memory_plan_lib.write_plan(report["memory_plan"], options.workdir)
    logger.info("memory plan: %s", path)
    memory_plan_lib.check_plan(report["memory_plan"])
