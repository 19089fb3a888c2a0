"""Rollout schedules: when the trainer's rollouts are drawn and which policy samples them. Synchronous,
refined by one-step off-policy or partial rollouts (``schedule``: :func:`make_schedule`), the asynchronous
producer (``async_schedule``), where its engines run (``placement``), the colocated phases' memory hand-off
(``colocate``) and the gathering across processes (``multihost``).

Layering: the schedules sit above ``config`` (they read the run's options) and below the trainer (``train``
drives them step by step). Importing the package starts nothing: names load on use.
"""

import importlib

_NAMES = {
    "rstar2jax.schedules.async_schedule": ["AsyncSchedule"],
    "rstar2jax.schedules.schedule": [
        "OneStepOffPolicy", "Partial", "RolloutFn", "RolloutSchedule", "Synchronous", "make_schedule",
    ],  # fmt: skip
}
_MODULE_OF = {name: module for module, names in _NAMES.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(_MODULE_OF[name])
    for attr in _NAMES[_MODULE_OF[name]]:  # the module's other names too: one import, one lookup
        globals()[attr] = getattr(module, attr)
    return globals()[name]


def __dir__():
    return __all__
