"""The rollout schedule of a run's options (:func:`make_schedule`): the synchronous ones
(``rstar2jax.schedules.schedule``) and the asynchronous one (``rstar2jax.schedules.async_schedule``),
chosen in one place and checked once against the rollout: each schedule declares the capability it needs
(``RolloutSchedule.needs``, a protocol of ``rstar2jax.data.rollout_contract``), and a rollout without it is
refused in one line that names it."""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any

from rstar2jax.config.options import ConfigError
from rstar2jax.config.vocabulary import ROLLOUT_SCHEDULES
from rstar2jax.data.rollout_contract import BatchRollout, SupportsPartial, SupportsStream, describe
from rstar2jax.schedules.async_schedule import AsyncSchedule
from rstar2jax.schedules.schedule import OneStepOffPolicy, Partial, RolloutSchedule, Synchronous

#: The member each capability a schedule may need is found by (what the error names).
CAPABILITY_MEMBERS = {BatchRollout: "__call__", SupportsPartial: "partial", SupportsStream: "stream"}


def check_rollout(rollout: object, needs: type, setting: str) -> None:
    """Raises a ``ConfigError`` when ``rollout`` lacks the capability ``needs`` that ``setting`` (the option
    that chose the schedule, e.g. ``"rl.schedule='async'"``) asks for; a member of a close name is
    pointed out (a misspelt method)."""
    if isinstance(rollout, needs):
        return
    member = CAPABILITY_MEMBERS[needs]
    near = difflib.get_close_matches(member, [n for n in dir(rollout) if not n.startswith("__")], n=1)
    hint = f" (it has {near[0]}(): misspelt?)" if near else ""
    raise ConfigError(f"{setting} needs a rollout with {member}(); PolicyRollout has it, "
                      f"{describe(rollout)} does not{hint}")


def make_schedule(rollout: object, *, schedule: str = "synchronous", off_policy_steps: int = 0,
                  partial_token_budget: int = 0, prompts_per_step: int = 0, max_staleness: int = 1,
                  devices: Sequence[Any] = (), dtype=None, on_update: str = "keep") -> RolloutSchedule:
    """The schedule of the options, after checking that ``rollout`` has what it needs (:func:`check_rollout`).

    ``schedule`` (``rl.schedule``): "async" builds :class:`~rstar2jax.schedules.async_schedule.AsyncSchedule`
    (``max_staleness``, its engines on ``devices`` in ``dtype``, ``on_update``); "synchronous" one of
    ``rstar2jax.schedules.schedule``'s: partial rollouts when ``partial_token_budget`` > 0
    (``rollout.partial_token_budget``; ``prompts_per_step``: the most groups open at once), one-step
    off-policy when ``off_policy_steps`` is 1 (``rl.off_policy_steps``), else each step its own rollout."""
    if schedule not in ROLLOUT_SCHEDULES:
        raise ValueError(f"schedule={schedule!r}; expected one of {ROLLOUT_SCHEDULES}")
    if off_policy_steps not in (0, 1):
        raise ValueError(f"off_policy_steps={off_policy_steps!r}; expected 0 or 1")
    if schedule == "async":
        check_rollout(rollout, AsyncSchedule.needs, "rl.schedule='async'")
        return AsyncSchedule(max_staleness, devices=devices, dtype=dtype, on_update=on_update)
    if partial_token_budget and off_policy_steps:
        raise ValueError("partial rollouts (token_budget) and off_policy_steps=1 do not combine")
    if partial_token_budget:
        check_rollout(rollout, Partial.needs, f"rollout.partial_token_budget={partial_token_budget}")
        return Partial(partial_token_budget, prompts_per_step)
    chosen = OneStepOffPolicy if off_policy_steps else Synchronous
    setting = "rl.off_policy_steps=1" if off_policy_steps else "rl.schedule='synchronous'"
    check_rollout(rollout, chosen.needs, setting)
    return chosen()
