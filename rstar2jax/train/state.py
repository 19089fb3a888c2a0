"""The training state pytree and the optimizer (optax AdamW with the paper's defaults)."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import optax

from rstar2jax.config.options import OptimizerOptions
from rstar2jax.config.vocabulary import SCHEDULES


@flax.struct.dataclass
class TrainState:
    """Everything a training step changes: one immutable pytree, updated functionally and donated to the step.

    Attributes:
      params: the model parameters (a nested dict of arrays).
      opt_state: the optax optimizer state.
      step: int32 scalar, optimizer updates applied so far.
      rng: a raw ``uint32[2]`` PRNG key; the RL iteration splits it for RoC selection and rollouts, so a
        resumed run draws exactly the same numbers.
      ref_params: the frozen reference policy of a KL term (``loss.kl_coef`` > 0), or None (no leaves).
    """

    params: Any
    opt_state: Any
    step: jax.Array
    rng: jax.Array
    ref_params: Any = None


def learning_rate_schedule(
    learning_rate: float,
    *,
    warmup_steps: int = 20,
    schedule: str = "constant",
    total_steps: int | None = None,
) -> optax.Schedule:
    """Linear warm-up then constant (the paper's RL) or cosine decay to 0 (its SFT).

    lr(s) = learning_rate · min(1, (s+1)/warmup_steps) during warm-up, so the first update already moves the
    weights and update ``warmup_steps - 1`` is the first at the full rate; ``cosine`` then decays over
    ``total_steps - warmup_steps`` updates.
    """
    if learning_rate <= 0:
        raise ValueError(f"learning_rate must be positive, got {learning_rate}")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r}; expected one of {SCHEDULES}")

    def warmup(step):
        return learning_rate * jnp.minimum(1.0, (step + 1) / max(warmup_steps, 1))

    if schedule == "constant":
        return warmup
    if total_steps is None or total_steps <= warmup_steps:
        raise ValueError(
            f"cosine schedule needs total_steps > warmup_steps={warmup_steps}, got {total_steps}"
        )
    decay = optax.cosine_decay_schedule(learning_rate, total_steps - warmup_steps)
    return optax.join_schedules([warmup, decay], [warmup_steps])


def make_optimizer(
    learning_rate: float = 1e-6,
    *,
    warmup_steps: int = 20,
    schedule: str = "constant",
    total_steps: int | None = None,
    weight_decay: float = 0.01,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    max_grad_norm: float | None = 1.0,
) -> optax.GradientTransformation:
    """AdamW with global-norm gradient clipping; the defaults are the paper's RL optimizer.

    Paper (§4): AdamW, constant lr 1e-6 after a 20-step linear warm-up, weight decay 0.01, clip 1.0.
    """
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    if max_grad_norm is not None and max_grad_norm <= 0:
        raise ValueError(f"max_grad_norm must be positive or None, got {max_grad_norm}")
    lr = learning_rate_schedule(
        learning_rate, warmup_steps=warmup_steps, schedule=schedule, total_steps=total_steps
    )
    adamw = optax.adamw(lr, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    return adamw if max_grad_norm is None else optax.chain(optax.clip_by_global_norm(max_grad_norm), adamw)


def optimizer_from_options(options: OptimizerOptions, total_steps: int | None = None,
                           updates_per_step: int = 1):
    """The optimizer ``config.optimizer`` asks for (``total_steps``: the run's step count when
    ``optimizer.total_steps`` is not set). Its schedule counts updates: ``updates_per_step`` per step (an RL
    step's ``rl.ppo_epochs`` x ``rl.mini_batches``; warm-up and total steps given in steps)."""
    return make_optimizer(
        options.learning_rate,
        **options.schedule_options(total_steps, updates_per_step),
        weight_decay=options.weight_decay,
        b1=options.b1,
        b2=options.b2,
        eps=options.eps,
        max_grad_norm=options.max_grad_norm,
    )


def schedule_from_options(options: OptimizerOptions, total_steps: int | None = None,
                          updates_per_step: int = 1):
    """The learning rate of each step under :func:`optimizer_from_options` (its last update's)."""
    schedule = learning_rate_schedule(options.learning_rate,
                                      **options.schedule_options(total_steps, updates_per_step))
    return schedule if updates_per_step == 1 else lambda step: schedule(step * updates_per_step
                                                                         + updates_per_step - 1)


def init_train_state(
    params: Any, optimizer: optax.GradientTransformation, seed: int | jax.Array, *, reference: bool = False
) -> TrainState:
    """A fresh state: ``optimizer.init(params)``, step 0 and the PRNG key of ``seed``; ``reference``: a frozen
    copy of ``params`` as ``ref_params`` (the KL term's reference policy)."""
    rng = jax.random.PRNGKey(seed) if isinstance(seed, int) else seed
    ref_params = jax.tree.map(jnp.copy, params) if reference else None
    return TrainState(
        params=params,
        opt_state=optimizer.init(params),
        step=jnp.zeros((), jnp.int32),
        rng=rng,
        ref_params=ref_params,
    )


def reset_optimizer(state: TrainState, optimizer: optax.GradientTransformation) -> TrainState:
    """Fresh optimizer moments and schedule (a stage start with ``reset_optimizer``); params, step, rng kept.

    The schedule restarts too (its count lives in the optimizer state), so the warm-up runs again, as it would
    for a freshly built optimizer.
    """
    return state.replace(opt_state=optimizer.init(state.params))
