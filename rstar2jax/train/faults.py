"""What a training run does when a step goes wrong, in pieces the loops compose.

* :func:`skip_nonfinite_updates` wraps a train step (before ``jit``): a step whose loss or gradient norm is
  not finite keeps the parameters and optimizer state it was given (its step still counts, as a skipped one:
  ``update_skipped`` = 1 in its metrics), so one bad batch never writes NaN into the weights or the Adam
  moments.
* :class:`NonFiniteStreak` counts skipped updates in a row and stops the run (:class:`NonFiniteUpdates`)
  after ``rl.max_nonfinite_steps`` of them: something is wrong beyond one batch.
* :class:`RunFault` is the base of the errors that stop a run on purpose with a one-line message (the
  launchers print it and exit with status 3), after the loop saved the last finished step's checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

#: The metric of a step whose update was skipped (1.0) or applied (0.0).
UPDATE_SKIPPED = "update_skipped"


class RunFault(RuntimeError):
    """A fault the run cannot ride out: it stopped after keeping the last finished step's checkpoint; the
    message is one line saying what happened and which option governs it."""


class NonFiniteUpdates(RunFault):
    """``rl.max_nonfinite_steps`` steps in a row had a non-finite loss or gradient."""


class EmptyRollout(RunFault):
    """A step's rollout left no trajectory to train on (every one failed for the sandbox's reasons)."""


def skip_nonfinite_updates(step_fn: Callable[..., tuple[Any, dict]]):
    """``step_fn(state, batch, *rest) -> (state, metrics)`` (``rest``: a LoRA step's frozen base) that keeps
    ``state.params`` and ``state.opt_state`` when ``metrics["loss"]`` or ``metrics["grad_norm"]`` is not
    finite (NaN or Inf), and adds ``metrics["update_skipped"]`` (1.0 then, else 0.0). The rest of the new
    state (step, RNG) is taken as the step made it. Wrap before ``jax.jit``: the selection is one elementwise
    ``where`` per leaf, which XLA fuses into the update itself (no second copy of the state)."""

    def guarded(state, batch, *rest):
        new_state, metrics = step_fn(state, batch, *rest)
        finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])

        def keep_if_bad(new, old):
            return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)

        new_state = new_state.replace(
            params=keep_if_bad(new_state.params, state.params),
            opt_state=keep_if_bad(new_state.opt_state, state.opt_state),
        )
        return new_state, {**metrics, UPDATE_SKIPPED: jnp.logical_not(finite).astype(jnp.float32)}

    return guarded


class NonFiniteStreak:
    """Skipped updates in a row (:func:`skip_nonfinite_updates`), kept across a resume by the caller
    (``in_a_row``, from the checkpoint meta): :meth:`observe` each step's metrics, record the step, then
    :meth:`check`, which raises :class:`NonFiniteUpdates` once ``limit`` updates in a row were skipped."""

    def __init__(self, limit: int, in_a_row: int = 0):
        if not isinstance(limit, int) or limit < 1:
            raise ValueError(f"limit must be a positive int, got {limit!r}")
        self.limit, self.in_a_row = limit, in_a_row

    def observe(self, metrics: Mapping[str, float]) -> int:
        """Counts one step; returns the updates skipped in a row so far (0 after an applied update)."""
        self.in_a_row = self.in_a_row + 1 if metrics.get(UPDATE_SKIPPED, 0.0) else 0
        return self.in_a_row

    def check(self, step: int, checkpoints: object) -> None:
        """Raises :class:`NonFiniteUpdates` (naming step ``step`` and the ``checkpoints`` folder) at the
        limit."""
        if self.in_a_row >= self.limit:
            raise NonFiniteUpdates(
                f"{self.in_a_row} steps in a row (to step {step}) had a non-finite loss or gradient and "
                f"skipped their updates (rl.max_nonfinite_steps={self.limit}); the checkpoint of step {step} "
                f"in {checkpoints} holds the parameters of step {step - self.in_a_row}, the last applied "
                "update"
            )
