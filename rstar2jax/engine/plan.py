"""What passes between the engine's rooms: the scheduler's decision for one device step (:class:`StepPlan`),
the new weights queued for the steps to come (:class:`WeightUpdate`) and what one decode row of a collected
step gave (:class:`DecodeResult`).

A plan is a value (as vLLM V1's ``SchedulerOutput``): slot ids, token tuples and per-slot snapshots
(:class:`~rstar2jax.engine.outbox.SlotRecord`), never the scheduler's live sequences. The runner may build
it whenever it likes and keeps no reference into the scheduler; the scheduler pairs each collected decode
row with the sequence it planned it for itself."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import numpy as np

from rstar2jax.engine.buckets import StepLayout
from rstar2jax.engine.outbox import StepUpdates
from rstar2jax.engine.records import Chunk

__all__ = ["ON_UPDATE", "DecodeResult", "PrefillRun", "StepPlan", "WeightUpdate", "check_policy_version"]

#: What running sequences do when new weights arrive (``EngineCore.update_weights``): ``"keep"`` decodes on
#: with their keys/values as written (by the old weights); ``"recompute"`` prefills them again with the new
#: weights first (suspending running segments meanwhile).
ON_UPDATE = ("keep", "recompute")


def check_policy_version(policy_version) -> int:
    """``policy_version`` as an int; raises ValueError unless it is an int >= 0."""
    if not isinstance(policy_version, (int, np.integer)) or isinstance(policy_version, bool) or (
            policy_version < 0):
        raise ValueError(f"policy_version must be an int >= 0, got {policy_version!r}")
    return int(policy_version)


@dataclasses.dataclass(frozen=True)
class WeightUpdate:
    """New weights, prepared for the engine's programs (same shapes, dtypes and shardings), the policy version
    they sample as, and what running sequences do with their keys/values (:data:`ON_UPDATE`)."""

    params: dict
    policy_version: int
    on_update: str = "keep"

    def __post_init__(self):
        check_policy_version(self.policy_version)
        if self.on_update not in ON_UPDATE:
            raise ValueError(f"on_update={self.on_update!r}; expected one of {ON_UPDATE}")


@dataclasses.dataclass(frozen=True)
class PrefillRun:
    """Tokens of one slot's sequence fed at positions ``start, start + 1, ...`` (their keys/values written,
    nothing sampled), as single-query rows (``as_singles``) or whole tiles."""

    slot: int
    start: int
    tokens: tuple[int, ...]
    as_singles: bool


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """One device step as the scheduler decided it.

    Attributes:
      layout: the token bucket (and so the compiled program) the step runs.
      decoding: the slots of running sequences, one decode row each, in row order.
      prefills: prefill runs after them (prompts, appended tool outputs).
      iterations: device iterations: 1 with prefill, else up to ``decode_chunk`` pure decode ones.
      updates: the update data the step applies first.
      policy_version: the version of the weights the step runs on (its tokens carry it).
      weights: new weights this step starts running on (the runner keeps them for the later steps); None:
        those of the step before.
      compile_ahead: the decode bucket the steps after this prefill will likely need (compiled meanwhile).
    """

    layout: StepLayout
    decoding: tuple[int, ...]
    prefills: tuple[PrefillRun, ...]
    iterations: int
    updates: StepUpdates
    policy_version: int
    weights: WeightUpdate | None = None
    compile_ahead: StepLayout | None = None


class DecodeResult(NamedTuple):
    """One decode row of a collected step: its slot and the chunk it sampled (None: nothing)."""

    slot: int
    chunk: Chunk | None
