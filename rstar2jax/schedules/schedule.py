"""How rollouts are scheduled across RL steps: one object per schedule, chosen once from the options.

* ``Synchronous`` (the default): each step rolls out its own problems with its own parameters.
* ``OneStepOffPolicy`` (``rl.off_policy_steps=1``): the rollout of step n+1's problems is generated with
  step n's parameters before step n's update (sequentially here: the engine and the trainer share one
  parameter tree, so the update, which donates it, cannot run beside the rollout); step n then trains on the
  rollout made with step n-1's parameters (the first step of a stage trains on its own, on-policy rollout).
* ``Partial`` (``rollout.partial_token_budget > 0``): the rollout stops once its sessions sampled that many
  tokens, the groups whose rollouts all finished are trained on, and the unfinished rollouts are resumed in
  the next step with the new parameters (their tokens keep their versions and sampler log-probs). The
  ``rollout_fn`` needs a ``partial`` method (``SupportsPartial``,
  :meth:`~rstar2jax.agent.PolicyRollout.partial`)::

      rollout_fn.partial(params, problems, *, samples_per_problem, max_response_length, max_turns, seed,
                         policy_version, token_budget, resume) -> (finished, unfinished)

  unfinished records having a ``problem_id`` and ``num_tokens`` (:class:`~rstar2jax.agent.PartialRollout`).

A schedule draws each step's problems (``draw``), produces its groups (``rollouts``), and owns what it hands
to the next step: ``checkpoint_meta`` / ``restore`` keep that in the checkpoint meta (problems and
trajectories, and partial rollouts' own records, as declared JSON records: ``unfinished_to_dict``), so a
resumed run goes on exactly; ``end_stage`` drops it (nothing crosses a stage boundary).

The rollout is injected (``rollout_fn``), so the same iteration runs the real agent (engine + sandbox) or a
scripted rollout in tests. What each schedule needs of it is a protocol of ``rstar2jax.data.rollout_contract``
(``RolloutSchedule.needs``), checked once when ``rstar2jax.schedules.schedule_choice.make_schedule`` builds
the schedule. A batch rollout (``BatchRollout``)::

    rollout_fn(params, problems, *, samples_per_problem, max_response_length, max_turns, seed, policy_version)
        -> list[Trajectory]      # samples_per_problem per problem, rewards filled in

Policy versions: the version of parameters is the trainer step that produced them (``state.step``), passed
as ``policy_version``. A rollout may tag the tokens it samples with it (``Trajectory.policy_versions``, as
:class:`~rstar2jax.agent.PolicyRollout` does); trajectories that come back without tags get it on every
sampled token. A ``rollout_fn`` with a ``last_stats`` dict of counts (``SupportsStats``) has them summed
over a step's calls.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import jax

from rstar2jax.data.problems import Problem, ProblemIterator
from rstar2jax.data.rollout_contract import (
    BatchRollout,
    Rollout,
    SupportsPartial,
    rollout_stats,
    unfinished_from_dict,
    unfinished_to_dict,
)
from rstar2jax.data.trajectory import NO_POLICY_VERSION, trajectory_from_dict, trajectory_to_dict
from rstar2jax.schedules.multihost import gather_to_all_processes
from rstar2jax.schedules.schedule_state import read_legacy_carry

#: What the trainer takes as a rollout (``rollout_contract.Rollout``: one or more of its capabilities).
RolloutFn = Rollout

if TYPE_CHECKING:  # the agent package starts engine code on import; the trainer needs only the type
    from rstar2jax.data.trajectory import Trajectory

#: The checkpoint meta key of what a schedule carried from one step to the next in checkpoints written before
#: the declared forms (a pickle: read with ``read_legacy_carry``).
CARRY_META_KEY = "rollout_carry"
#: The checkpoint meta key of the rollout one-step off-policy hands to the next step (declared JSON).
READY_META_KEY = "off_policy_ready"
#: The checkpoint meta key of what partial rollouts carry to the next step (declared JSON), and its format.
PARTIAL_META_KEY = "partial_carry"
PARTIAL_FORMAT = 1


def _group(
    problems: Sequence[Problem], trajectories: Sequence[Trajectory], size: int
) -> list[list[Trajectory]]:
    groups: dict[str, list[Trajectory]] = {p.id: [] for p in problems}
    for t in trajectories:
        if t.problem_id not in groups:
            raise ValueError(f"rollout returned a trajectory for unknown problem {t.problem_id!r}")
        groups[t.problem_id].append(t)
    for problem_id, group in groups.items():
        if len(group) > size:
            raise ValueError(
                f"rollout returned {len(group)} trajectories for problem {problem_id!r}, "
                f"more than samples_per_problem={size}"
            )
    return [groups[p.id] for p in problems]


def tag_versions(trajectories: Sequence[Trajectory], version: int) -> list[Trajectory]:
    """``trajectories`` with ``policy_versions`` set where the rollout recorded none: ``version`` on every
    sampled token (loss mask 1), ``NO_POLICY_VERSION`` elsewhere. Tagged records are kept as they are."""
    return [
        t
        if t.policy_versions is not None
        else dataclasses.replace(
            t, policy_versions=[version if m else NO_POLICY_VERSION for m in t.loss_mask]
        )
        for t in trajectories
    ]


def collect_stats(rollout_fn: RolloutFn, into: collections.Counter | None) -> None:
    """Adds the ``last_stats`` counts of ``rollout_fn``'s last call (when it keeps them, as
    :class:`~rstar2jax.agent.PolicyRollout` does) to ``into``."""
    if into is not None:
        into.update(rollout_stats(rollout_fn))


def run_rollouts(
    rollout_fn: RolloutFn,
    params,
    problems: Sequence[Problem],
    *,
    samples_per_problem: int,
    max_response_length: int,
    max_turns: int,
    seed: int,
    policy_version: int,
    stats: collections.Counter | None = None,
) -> list[list[Trajectory]]:
    """Rollouts grouped per problem (in ``problems`` order); with several processes each rolls out a slice.

    ``policy_version``: the version of ``params``, passed to ``rollout_fn``; trajectories that come back
    without versions get it (see :func:`tag_versions`). ``stats``: gets the call's counts
    (:func:`collect_stats`)."""
    mine = problems[jax.process_index() :: jax.process_count()]
    trajectories = rollout_fn(
        params,
        list(mine),
        samples_per_problem=samples_per_problem,
        max_response_length=max_response_length,
        max_turns=max_turns,
        seed=seed + jax.process_index(),
        policy_version=policy_version,
    )
    collect_stats(rollout_fn, stats)
    trajectories = tag_versions(trajectories, policy_version)
    if jax.process_count() > 1:
        trajectories = gather_to_all_processes(list(trajectories))
    return _group(problems, trajectories, samples_per_problem)


def seed_from_key(key: jax.Array) -> int:
    """A rollout seed (a non-negative int32) drawn from ``key``."""
    return int(jax.random.randint(key, (), 0, 2**31 - 1))


def unique_problems(problems: Sequence[Problem]) -> list[Problem]:
    """``problems`` without repeats (a batch across an epoch boundary), first occurrence kept."""
    return list({p.id: p for p in problems}.values())


class RolloutSchedule:
    """The synchronous schedule, and the interface of every schedule: each step rolls out its own problems
    with its own parameters; nothing carries across steps.

    ``num_groups``: None, or the fixed number of groups a step trains on (the complete groups, a number that
    varies, are padded with empty ones to it so that nothing recompiles).
    """

    num_groups: int | None = None
    #: The capability the schedule needs of the rollout (``schedule_choice.make_schedule`` checks it).
    needs: ClassVar[type] = BatchRollout

    def draw(self, iterator: ProblemIterator, *, stage_last: bool) -> list[Problem]:
        """This step's new problems from ``iterator`` (``stage_last``: the stage's last step)."""
        del stage_last
        return next(iterator)

    def rollouts(
        self, rollout_fn: RolloutFn, params, problems: list[Problem], *, options: dict[str, int],
        rollout_key: jax.Array, version: int, stats: collections.Counter,
    ) -> tuple[list[Problem], list[list[Trajectory]], dict[str, float]]:
        """The problems this step trains on, their groups and the schedule's counts. ``options``:
        ``samples_per_problem``, ``max_response_length``, ``max_turns``; ``version``: the policy version of
        ``params``; ``stats``: gets the rollout calls' counts."""
        groups = run_rollouts(rollout_fn, params, problems, **options, seed=seed_from_key(rollout_key),
                              policy_version=version, stats=stats)
        return problems, groups, {}

    def release_versions(self, groups: Sequence[Sequence[Trajectory]], version: int) -> list[int]:
        """Per group of the last ``rollouts``, the policy version it was released at (its tokens are at least
        that new): here the oldest version of its sampled tokens (``version`` when none is tagged)."""
        return [min((v for t in g for v in (t.policy_versions or ()) if v != NO_POLICY_VERSION),
                    default=version) for g in groups]

    def begin_stage(self, steps: int, done: int) -> None:
        """A stage starts (or resumes) with ``steps`` steps to run in all, ``done`` of them run already."""

    def updated(self, params, version: int, *, update_seconds: float, trained_tokens: float) -> dict:
        """The update to ``version`` (``params``) is done; returns the schedule's figures of the step."""
        return {}

    def close(self) -> None:
        """The run stops: whatever the schedule runs in the background stops."""

    @property
    def empty(self) -> bool:
        """Whether nothing waits for the next step."""
        return True

    def end_stage(self) -> None:
        """Drops what waits for the next step (a stage's last step: nothing crosses into the next stage)."""

    def checkpoint_meta(self) -> dict[str, Any]:
        """What the checkpoint meta keeps of the schedule (merged into it at every step)."""
        return {}

    def restore(self, meta: dict[str, Any]) -> None:
        """Takes up what ``checkpoint_meta`` saved (at a stage's start, from the restored meta)."""


#: The synchronous schedule: the base schedule itself, which carries nothing from step to step.
Synchronous = RolloutSchedule


class OneStepOffPolicy(RolloutSchedule):
    """``rl.off_policy_steps=1`` (see the module doc). ``ready``: the next step's problems and their groups,
    rolled out with this step's parameters (None: the next step rolls out its own problems), checkpointed as
    JSON (problems and trajectories as declared records)."""

    def __init__(self):
        self.ready: tuple[list[Problem], list[list[Trajectory]]] | None = None
        self._ahead: list[Problem] | None = None

    def draw(self, iterator: ProblemIterator, *, stage_last: bool) -> list[Problem]:
        """Nothing new when a rollout is ready, else the next batch; plus (but on a stage's last step) the
        batch the next step trains on, rolled out by this step."""
        now = [] if self.ready is not None else next(iterator)
        self._ahead = None if stage_last else next(iterator)
        return now

    def rollouts(self, rollout_fn, params, problems, *, options, rollout_key, version, stats):
        if self.ready is not None:
            (problems, groups), self.ready = self.ready, None
        else:
            problems, groups, _ = super().rollouts(
                rollout_fn, params, problems, options=options, rollout_key=rollout_key, version=version,
                stats=stats,
            )
        if self._ahead is not None:  # the next step's rollout, made with these parameters before the update
            ahead, self._ahead = unique_problems(self._ahead), None
            seed = seed_from_key(jax.random.fold_in(rollout_key, 1))
            self.ready = (ahead, run_rollouts(rollout_fn, params, ahead, **options, seed=seed,
                                              policy_version=version, stats=stats))
        return problems, groups, {}

    @property
    def empty(self) -> bool:
        return self.ready is None

    def end_stage(self) -> None:
        self.ready, self._ahead = None, None

    def checkpoint_meta(self) -> dict[str, Any]:
        if self.ready is None:
            return {READY_META_KEY: None}
        problems, groups = self.ready
        return {READY_META_KEY: {"format": 1, "problems": [p.to_dict() for p in problems],
                                 "groups": [[trajectory_to_dict(t) for t in g] for g in groups]}}

    def restore(self, meta: dict[str, Any]) -> None:
        self.end_stage()
        record = meta.get(READY_META_KEY)
        if record is not None:
            self.ready = ([Problem.from_dict(p) for p in record["problems"]],
                          [[trajectory_from_dict(t) for t in g] for g in record["groups"]])
        elif meta.get(CARRY_META_KEY):  # a checkpoint written before the declared form
            self.ready = read_legacy_carry(meta[CARRY_META_KEY])["ready"]


class Partial(RolloutSchedule):
    """``rollout.partial_token_budget > 0`` (see the module doc): at most ``num_groups`` groups open at once.

    Attributes:
      unfinished: the records the token budget stopped, resumed by the next step.
      held: per open problem id, the finished trajectories of its group so far.
      problems: the open groups' problems, by id, in the order they were opened.
    """

    needs = SupportsPartial

    def __init__(self, token_budget: int, num_groups: int):
        if token_budget < 1 or num_groups < 1:
            raise ValueError(f"token_budget ({token_budget}) and num_groups ({num_groups}) must be positive")
        self.token_budget, self.num_groups = token_budget, num_groups
        self.end_stage()

    @property
    def open_groups(self) -> int:
        """Problems whose groups are not complete yet."""
        return len(self.problems)

    def draw(self, iterator: ProblemIterator, *, stage_last: bool) -> list[Problem]:
        """As many new problems as groups may still open."""
        return iterator.take(max(self.num_groups - self.open_groups, 0))

    def rollouts(self, rollout_fn, params, problems, *, options, rollout_key, version, stats):
        """Resumes ``unfinished``, opens ``problems`` (but ids still open) and samples until the budget;
        repeated (each call one more budget) until at least one group is complete. Returns the complete
        groups' problems and groups (the carried ones first) and counts; the rest stay open."""
        if jax.process_count() > 1:
            raise ValueError("partial rollouts (token_budget) run in one process only")
        new = [p for p in problems if p.id not in self.problems]
        for p in new:
            self.problems[p.id], self.held[p.id] = p, []
        resumed, resumed_tokens = len(self.unfinished), sum(u.num_tokens for u in self.unfinished)
        unfinished, calls, seed = self.unfinished, 0, seed_from_key(rollout_key)
        while True:
            finished, unfinished = rollout_fn.partial(
                params, new, **options, seed=seed + calls, policy_version=version,
                token_budget=self.token_budget, resume=unfinished,
            )
            collect_stats(rollout_fn, stats)
            calls, new, unfinished = calls + 1, [], list(unfinished)
            self._hold(finished)
            still_open = {u.problem_id for u in unfinished}
            complete = [pid for pid in self.problems if pid not in still_open]
            if complete:
                break
        self.unfinished = unfinished
        done = [self.problems.pop(pid) for pid in complete]
        groups = [self.held.pop(pid) for pid in complete]
        size = options["samples_per_problem"]
        for group in groups:
            if len(group) > size:
                raise ValueError(f"rollout returned {len(group)} trajectories for problem "
                                 f"{group[0].problem_id!r}, more than samples_per_problem={size}")
        metrics = {
            "rollout/partial_calls": float(calls),
            "rollout/partial_resumed": float(resumed),
            "rollout/partial_resumed_tokens": float(resumed_tokens),
            "rollout/partial_unfinished": float(len(unfinished)),
            "rollout/partial_open_groups": float(self.open_groups),
        }
        return done, groups, metrics

    def _hold(self, finished: Sequence[Trajectory]) -> None:
        for t in finished:
            if t.problem_id not in self.held:
                raise ValueError(f"rollout returned a trajectory for unknown problem {t.problem_id!r}")
            if t.policy_versions is None:
                raise ValueError("partial rollouts need trajectories with policy_versions (a resumed "
                                 "rollout mixes versions)")
            self.held[t.problem_id].append(t)

    @property
    def empty(self) -> bool:
        return not self.unfinished and not self.problems

    def end_stage(self) -> None:
        self.unfinished: list = []
        self.held: dict[str, list[Trajectory]] = {}
        self.problems: dict[str, Problem] = {}

    def checkpoint_meta(self) -> dict[str, Any]:
        if self.empty:
            return {PARTIAL_META_KEY: None}
        return {PARTIAL_META_KEY: {
            "format": PARTIAL_FORMAT, "unfinished": [unfinished_to_dict(u) for u in self.unfinished],
            "held": {pid: [trajectory_to_dict(t) for t in g] for pid, g in self.held.items()},
            "problems": [p.to_dict() for p in self.problems.values()]}}

    def restore(self, meta: dict[str, Any]) -> None:
        self.end_stage()
        record = meta.get(PARTIAL_META_KEY)
        if record is not None:
            if record.get("format") != PARTIAL_FORMAT:
                raise ValueError(f"partial rollouts' carry format {record.get('format')!r}; this code reads "
                                 f"format {PARTIAL_FORMAT}")
            self.unfinished = [unfinished_from_dict(u) for u in record["unfinished"]]
            self.held = {pid: [trajectory_from_dict(t) for t in g] for pid, g in record["held"].items()}
            self.problems = {p["id"]: Problem.from_dict(p) for p in record["problems"]}
        elif meta.get(CARRY_META_KEY):  # a checkpoint written before the declared form
            carried = read_legacy_carry(meta[CARRY_META_KEY])
            self.unfinished, self.held = list(carried["unfinished"]), dict(carried["held"])
            self.problems = dict(carried["problems"])
