"""Rollout schedules: when the trainer's rollouts are drawn and which policy samples them. Synchronous,
refined by one-step off-policy or partial rollouts (``schedule``), the asynchronous producer
(``async_schedule``), the one choice among them checked against the rollout (``schedule_choice``:
:func:`make_schedule`), where its engines run (``placement``), the colocated phases' memory hand-off
(``colocate``) and the gathering across processes (``multihost``).

Layering: the schedules sit above ``config`` (they read the run's options) and below the trainer (``train``
drives them step by step). Importing the package starts nothing: names load on use.
"""

from rstar2jax.config.lazy import LazyNames

_NAMES = {
    "rstar2jax.schedules.async_schedule": ["AsyncSchedule"],
    "rstar2jax.schedules.schedule": [
        "OneStepOffPolicy", "Partial", "RolloutFn", "RolloutSchedule", "Synchronous",
    ],  # fmt: skip
    "rstar2jax.schedules.schedule_choice": ["make_schedule"],
}
_LAZY = LazyNames(globals(), _NAMES).install()
__all__ = sorted([*_LAZY.names])  # griffe (the API pages) reads a list here
