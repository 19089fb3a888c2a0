"""What a training run keeps on the host between steps, as one typed value (``HostState``): the JSON record a
checkpoint holds beside the ``TrainState`` (``to_meta`` / ``from_meta``, versioned; records written before it
are read and upgraded)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from rstar2jax.policy.adapters import META_KEY as LORA_BASE_META_KEY

#: The format of ``HostState.to_meta`` (a later format reads the earlier ones).
HOST_STATE_FORMAT = 1
#: Keys a rollout schedule kept at the record's top level before ``schedule`` held them.
_LEGACY_SCHEDULE_KEYS = ("rollout_carry", "async_groups")


@dataclasses.dataclass(frozen=True)
class HostState:
    """A run's host state between steps (the trainer's own state is ``TrainState``; ``state.step`` counts).

    Attributes:
      stage: the RL stage running (its index); ``stage_start``: the step it started at.
      optimizer_start: the step the optimizer (and its learning-rate schedule) was last reset at.
      position: the data iterator's position in the stage's problems (SFT: in its examples).
      problem_ids: the stage's problems the hard-problem filter kept (None: not filtered yet).
      nonfinite_in_a_row: steps in a row with a non-finite loss or gradient (``faults.NonFiniteStreak``).
      history: the metrics logged so far, one record per step.
      schedule: what the rollout schedule hands to the next step (its ``checkpoint_meta``: declared JSON).
      lora_base: a LoRA run's record of its frozen base (``lora.base_record``), else None.
    """

    stage: int = 0
    stage_start: int = 0
    optimizer_start: int = 0
    position: int = 0
    problem_ids: tuple[str, ...] | None = None
    nonfinite_in_a_row: int = 0
    history: tuple[dict, ...] = ()
    schedule: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    lora_base: Mapping[str, Any] | None = None

    def replace(self, **changes) -> HostState:
        return dataclasses.replace(self, **changes)

    def to_meta(self) -> dict[str, Any]:
        """The checkpoint's JSON record."""
        meta = {"host_state_format": HOST_STATE_FORMAT, "stage": self.stage, "stage_start": self.stage_start,
                "optimizer_start": self.optimizer_start, "position": self.position,
                "problem_ids": None if self.problem_ids is None else list(self.problem_ids),
                "nonfinite_in_a_row": self.nonfinite_in_a_row, "history": list(self.history),
                "schedule": dict(self.schedule)}
        if self.lora_base is not None:
            meta[LORA_BASE_META_KEY] = dict(self.lora_base)
        return meta

    @classmethod
    def from_meta(cls, meta: Mapping[str, Any], step: int) -> HostState:
        """The host state of a checkpoint's record at ``step``, of any format: records written before the step
        counters became one kept counts of their own (``optimizer_steps``, ``stage_step``); records written
        before this type kept the schedule's entries at the top level."""
        fmt = meta.get("host_state_format", 0)
        if fmt > HOST_STATE_FORMAT:
            raise ValueError(f"checkpoint host state format {fmt}; this code reads up to {HOST_STATE_FORMAT}")
        optimizer_start = meta.get("optimizer_start", step - meta.get("optimizer_steps", step))
        stage_start = meta.get("stage_start", step - meta.get("stage_step", step))
        schedule = meta.get("schedule")
        if schedule is None:
            schedule = {k: meta[k] for k in _LEGACY_SCHEDULE_KEYS if meta.get(k) is not None}
        problem_ids = meta.get("problem_ids")
        return cls(stage=meta.get("stage", 0), stage_start=stage_start, optimizer_start=optimizer_start,
                   position=meta.get("position", 0),
                   problem_ids=None if problem_ids is None else tuple(problem_ids),
                   nonfinite_in_a_row=meta.get("nonfinite_in_a_row", 0),
                   history=tuple(meta.get("history", ())),
                   schedule=schedule, lora_base=meta.get(LORA_BASE_META_KEY))
