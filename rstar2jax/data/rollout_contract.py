"""What the trainer needs of a rollout, named: one protocol per capability, checked by type.

A rollout is any object with one or more of them (:class:`~rstar2jax.agent.PolicyRollout` has all; a plain
function is a :class:`BatchRollout`):

* :class:`BatchRollout`: called, it rolls problems out with the given parameters and returns trajectories
  (the synchronous and one-step off-policy schedules, the hard-problem filter);
* :class:`SupportsPartial`: ``partial(...)`` stops at a token budget and resumes earlier unfinished rollouts
  (``rollout.partial_token_budget``);
* :class:`SupportsStream`: ``stream(...)`` opens a :class:`TrajectoryStream`, an engine that runs in the
  background and takes new weights in flight (``rl.schedule="async"``);
* :class:`SupportsStats`: ``last_stats``, the counts of the last call, logged as ``rollout/<name>``;
* :class:`SupportsPolicyParams`: ``policy_params(params)``, the weights the engine samples with when they
  are not the trainer's own (a LoRA run's merged policy);
* :class:`SupportsClose`: ``close()``, for whoever built the rollout.

The trainer decides once, when it builds the schedule (``rstar2jax.train.make_schedule``), what the rollout
must have; a rollout without it is refused in one line naming the capability. The protocols are
``runtime_checkable``: ``isinstance`` looks for the named members, not at their signatures.
"""

from __future__ import annotations

import inspect
from collections.abc import Hashable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from rstar2jax.data.problems import Problem
from rstar2jax.data.trajectory import Trajectory


@runtime_checkable
class BatchRollout(Protocol):
    """``samples_per_problem`` trajectories per problem (fewer where some were dropped), rewards filled in,
    sampled with ``params``; ``policy_version`` tags the sampled tokens (a rollout that tags none has them
    tagged by the trainer)."""

    def __call__(self, params, problems: Sequence[Problem], *, samples_per_problem: int,
                 max_response_length: int, max_turns: int, seed: int, policy_version: int
                 ) -> list[Trajectory]: ...


@runtime_checkable
class UnfinishedRollout(Protocol):
    """What the trainer reads of a rollout a token budget stopped (:class:`~rstar2jax.agent.PartialRollout`
    is one); the rollout that made it resumes it."""

    problem_id: str
    num_tokens: int


#: The format of ``unfinished_to_dict``'s records (a later format reads the earlier ones).
UNFINISHED_FORMAT = 1
# The record types a checkpoint may hold, by class name (``declare_record_types``).
_RECORD_TYPES: dict[str, type] = {}


def declare_record_types(types: Mapping[str, type]) -> None:
    """Declares, by name, the classes of a rollout's unfinished records and of what they hold, so that a
    checkpoint keeps them: a top-level record has ``to_dict()`` and ``from_dict(record)``; the names also
    admit them (old names included) out of the pickles of checkpoints written before the declared form."""
    _RECORD_TYPES.update(types)


def record_types() -> dict[str, type]:
    """The declared record classes by name (``declare_record_types``)."""
    return dict(_RECORD_TYPES)


def unfinished_to_dict(record: UnfinishedRollout) -> dict[str, Any]:
    """``record`` as versioned JSON data: its declared type's name and its ``to_dict()``."""
    name = type(record).__name__
    if _RECORD_TYPES.get(name) is not type(record) or not hasattr(record, "to_dict"):
        raise TypeError(f"unfinished rollout of undeclared type {name}: a checkpoint keeps only the types "
                        f"declared with declare_record_types, with to_dict/from_dict")
    return {"format": UNFINISHED_FORMAT, "type": name, "record": record.to_dict()}


def unfinished_from_dict(data: Mapping[str, Any]) -> UnfinishedRollout:
    """The record ``unfinished_to_dict`` wrote (its type declared in this process)."""
    if data.get("format") != UNFINISHED_FORMAT:
        raise ValueError(f"unfinished rollout format {data.get('format')!r}; this code reads format "
                         f"{UNFINISHED_FORMAT}")
    kind = _RECORD_TYPES.get(data.get("type"))
    if kind is None or not hasattr(kind, "from_dict"):
        raise ValueError(f"unfinished rollout of undeclared type {data.get('type')!r} (declared: "
                         f"{sorted(_RECORD_TYPES)}); import the rollout that writes it first")
    return kind.from_dict(data["record"])


@runtime_checkable
class SupportsPartial(Protocol):
    """Partial rollouts: ``problems`` opened and ``resume`` continued until the sessions sampled
    ``token_budget`` tokens together; returns ``(finished trajectories, unfinished rollouts)``. Finished
    trajectories carry ``policy_versions`` (a resumed one mixes versions)."""

    def partial(self, params, problems: Sequence[Problem], *, samples_per_problem: int,
                max_response_length: int, max_turns: int, seed: int, policy_version: int, token_budget: int,
                resume: Sequence[UnfinishedRollout]
                ) -> tuple[list[Trajectory], list[UnfinishedRollout]]: ...


class TrajectoryStream(Protocol):
    """An open stream (:class:`SupportsStream`): one engine from its opening to :meth:`close`."""

    def submit(self, key: Hashable, problem: Problem, *, seed: int, index: int) -> None:
        """Starts ``problem``'s group, seeded as group ``index`` of a call seeded ``seed``."""

    def update_weights(self, params, policy_version: int) -> None:
        """Samples with ``params`` from the engine's next step on; returns once they are queued."""

    def wait(self, timeout: float | None) -> list[tuple[Hashable, list[Trajectory]]]:
        """The groups finished since the last call (up to ``timeout`` s for the first; None: until one);
        raises what failed a group."""

    def stats(self) -> Mapping[str, float]:
        """Counts since the stream opened: ``busy_s``, ``generated_tokens``, the sandbox's."""

    def close(self) -> None:
        """Cancels what runs and stops the engine; closing twice is harmless."""


@runtime_checkable
class SupportsStream(Protocol):
    """Rollouts as a stream on ``device`` (None: the default one) starting from ``params`` at
    ``policy_version``; ``on_update``: what running sequences do when new weights arrive."""

    def stream(self, params, *, policy_version: int, samples_per_problem: int, max_response_length: int,
               max_turns: int, on_update: str, device: Any) -> TrajectoryStream: ...


@runtime_checkable
class SupportsStats(Protocol):
    """The counts of the last call (None or empty: none)."""

    last_stats: Mapping[str, float] | None


@runtime_checkable
class SupportsPolicyParams(Protocol):
    """The weights the engine samples with, from the trainer's ``params``."""

    def policy_params(self, params) -> Any: ...


@runtime_checkable
class SupportsClose(Protocol):
    """A rollout that holds resources (an engine, a sandbox client): ``close()`` frees them; whoever built
    the rollout calls it."""

    def close(self) -> None: ...


#: A rollout the trainer can schedule: one or more of the capabilities above.
Rollout = BatchRollout | SupportsPartial | SupportsStream


def rollout_stats(rollout: object) -> Mapping[str, float]:
    """The counts of ``rollout``'s last call: its ``last_stats`` when it keeps them, else none."""
    return (rollout.last_stats or {}) if isinstance(rollout, SupportsStats) else {}


def describe(rollout: object) -> str:
    """How an error names ``rollout``: its class, or for a function its qualified name."""
    if inspect.isfunction(rollout) or inspect.ismethod(rollout):
        return f"the function {rollout.__qualname__}"
    return type(rollout).__name__
