"""Placing and compiling a training step: fresh trainable parameters, the train state's and the batch's
shardings on the mesh, and ``jax.jit`` of a step with the state donated."""

from __future__ import annotations

import jax
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from rstar2jax import models
from rstar2jax.train.state import TrainState


def trainable_params(model_config, key: jax.Array, lora: models.LoraConfig | None = None, *, mesh=None):
    """Fresh trainable parameters: the model's (``models.init_params``), or with ``lora`` its adapters
    (``models.lora.init_lora``)."""
    if lora is None:
        return models.init_params(model_config, key, mesh=mesh)
    return models.lora.init_lora(model_config, lora, key, mesh=mesh)


def state_shardings(
    model_config,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    *,
    reference: bool = False,
    lora: models.LoraConfig | None = None,
) -> TrainState:
    """``TrainState`` of ``NamedSharding``: the trainable params (the model's, or with ``lora`` the adapters)
    and the optimizer's per-parameter moments (and the reference params when ``reference``) as the logical
    rules place them; counters, step and RNG replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())
    if lora is None:
        params = models.param_shardings(model_config, mesh)
    else:
        params = models.lora.lora_shardings(model_config, lora, mesh)
    abstract_params = jax.eval_shape(lambda: trainable_params(model_config, jax.random.PRNGKey(0), lora))
    abstract_opt = jax.eval_shape(optimizer.init, abstract_params)
    opt = optax.tree_map_params(
        optimizer,
        lambda _, sharding: sharding,
        abstract_opt,
        params,
        transform_non_params=lambda _: replicated,
    )
    ref_params = params if reference else None
    return TrainState(params=params, opt_state=opt, step=replicated, rng=replicated, ref_params=ref_params)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """Rows over the data-parallel axes (``data`` x ``fsdp``), positions whole."""
    return NamedSharding(mesh, PartitionSpec(("data", "fsdp")))


def jit_step(
    step_fn,
    *,
    mesh: Mesh | None = None,
    shardings: TrainState | None = None,
    compiler_options: dict | None = None,
    base_shardings: dict | None = None,
):
    """``jax.jit`` of ``step_fn(state, batch)`` with the state donated; with a mesh, explicit in/out shardings
    (state as ``shardings``, batch rows over data x fsdp, metrics replicated). ``compiler_options`` go to XLA
    (e.g. ``{"xla_backend_optimization_level": 0}`` trades step speed for compile time). ``base_shardings``
    (LoRA): the step is ``step_fn(state, batch, base)``, the frozen base params placed so, not donated."""
    if mesh is None:
        return jax.jit(step_fn, donate_argnums=0, compiler_options=compiler_options)
    if shardings is None:
        raise ValueError("jit_step with a mesh needs the state shardings (see state_shardings)")
    replicated = NamedSharding(mesh, PartitionSpec())
    base = () if base_shardings is None else (base_shardings,)
    return jax.jit(
        step_fn,
        in_shardings=(shardings, batch_sharding(mesh), *base),
        out_shardings=(shardings, replicated),
        donate_argnums=0,
        compiler_options=compiler_options,
    )


def jit_bound_step(step, model_config, lora, *, mesh, **options):
    """:func:`jit_step` of a step bound to its options; with ``lora`` and a mesh, the frozen base placed as
    the model's parameters."""
    base_shardings = None if lora is None or mesh is None else models.param_shardings(model_config, mesh)
    return jit_step(step, mesh=mesh, base_shardings=base_shardings, **options)
