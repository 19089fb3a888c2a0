"""One GRPO-RoC iteration: problems → 2G rollouts each → rewards → penalties → RoC to G → advantages → update.

The rollouts come from a schedule (``rstar2jax.schedules.schedule``: synchronous by default, one-step
off-policy, partial), which owns what one step hands to the next; scoring, selection and the batch are
``rstar2jax.train.selection``'s; every process of a multi-host run calls the iteration
(``rstar2jax.schedules.multihost``).

The iteration reports ``rollout/policy_lag_mean`` / ``rollout/policy_lag_max``: the version being updated
minus each sampled token's version, over the step's rollouts (0 in synchronous on-policy runs), and
``staleness/max`` / ``staleness/mean`` / ``staleness/tokens_behind_<k>`` over the trained tokens. With
rollouts across an update the sampler's log-probs of the older tokens come from an older policy: the
trainer's rollout correction (``RLLossConfig`` with ``old_logprobs="recompute"`` and ``rollout_is_cap`` /
``rollout_mask``, ``algo.rollout_correction``) weighs them by pi_current / pi_behaviour, or the decoupled
objective (``off_policy_correction="decoupled"``) clips against the update's starting policy and weighs
them by pi_proximal / pi_behaviour. After the update the schedule gets the new parameters (``updated``: the
asynchronous schedule sends them to its engines, in flight).

Faults: a ``rollout_fn`` with a ``last_stats`` dict of counts (:class:`~rstar2jax.agent.PolicyRollout`:
sandbox outage seconds, calls retried, restarts, trajectories dropped) has them summed over the step's calls
and logged as ``rollout/<name>``. A rollout that raises (a sandbox down past its outage budget) ends the
iteration before any update: the step is not counted. So does one that leaves no trajectory at all to train
on (:class:`~rstar2jax.train.faults.EmptyRollout`), rather than an update on an empty batch.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable, Sequence

import jax
import numpy as np

from rstar2jax.config.algorithm import RLIterationConfig
from rstar2jax.data.batch import Batch
from rstar2jax.data.problems import Problem
from rstar2jax.schedules import colocate
from rstar2jax.schedules.multihost import put_batch
from rstar2jax.schedules.schedule import (
    RolloutFn,
    RolloutSchedule,
    Synchronous,
    run_rollouts,
    unique_problems,
)
from rstar2jax.train.faults import EmptyRollout
from rstar2jax.train.rollout_record import StepRollouts
from rstar2jax.train.selection import (
    RewardFn,
    RocChoice,
    policy_lag_metrics,
    rescore,
    roc_choose,
    rollout_metrics,
    score_groups,
    select_and_build_batch,
    staleness_metrics,
)
from rstar2jax.train.state import TrainState

__all__ = ["filter_hard_problems", "rl_iteration"]


@dataclasses.dataclass
class _Sampled:
    """A step's groups (padded to the schedule's ``num_groups`` with ``padding`` empty ones) with what their
    sampling reported: the schedule's metrics, the rollout function's counts and the phase times."""

    problems: list[Problem]
    groups: list[list]
    padding: int
    schedule_metrics: dict[str, float]
    rollout_stats: collections.Counter
    rollout_seconds: float
    verify_seconds: float


def _sample(params, problems, *, rollout_fn, schedule, samples_per_problem, max_response_length, max_turns,
            reward_fn, rollout_key, version) -> _Sampled:
    """The step's groups from ``schedule`` (rescored by ``reward_fn`` when given); raises ``EmptyRollout``
    when they hold no trajectory at all."""
    start = time.perf_counter()
    rollout_stats = collections.Counter()
    unique, groups, schedule_metrics = schedule.rollouts(
        rollout_fn,
        params,
        unique_problems(problems),
        options=dict(
            samples_per_problem=samples_per_problem,
            max_response_length=max_response_length,
            max_turns=max_turns,
        ),
        rollout_key=rollout_key,
        version=version,
        stats=rollout_stats,
    )
    rollout_done = time.perf_counter()
    if not any(groups):
        raise EmptyRollout(
            f"the rollout of step {version + 1} left no trajectory to train on for its {len(unique)} "
            f"problems ({dict(rollout_stats) or 'no rollout counts'}); the step is not counted"
        )
    if reward_fn is not None:
        groups = rescore(unique, groups, reward_fn)
    verify_done = time.perf_counter()
    padding, num_groups = 0, schedule.num_groups
    if num_groups is not None:
        if len(groups) > num_groups:
            raise ValueError(f"{len(groups)} complete groups, more than num_groups={num_groups}")
        padding = num_groups - len(groups)
        groups = groups + [[] for _ in range(padding)]
    return _Sampled(unique, groups, padding, schedule_metrics, rollout_stats, rollout_done - start,
                    verify_done - rollout_done)


def _step_rollouts(sampled: _Sampled, choice: RocChoice, schedule: RolloutSchedule,
                   version: int) -> StepRollouts:
    """What the step at ``version`` trained (padding groups left out), for the rollout record."""
    groups = sampled.groups[: len(sampled.problems)]
    return StepRollouts(version + 1, sampled.problems, groups, schedule.release_versions(groups, version),
                        [choice.kept_in_group(g) for g in range(len(groups))])


def rl_iteration(
    state: TrainState,
    problems: Sequence[Problem],
    *,
    rollout_fn: RolloutFn,
    rl_step: Callable[[TrainState, Batch], tuple[TrainState, dict]],
    config: RLIterationConfig,
    max_response_length: int,
    max_turns: int,
    reward_fn: RewardFn | None = None,
    num_rows: int | None = None,
    batch_sharding: jax.sharding.Sharding | None = None,
    schedule: RolloutSchedule | None = None,
    record: Callable[[StepRollouts], None] | None = None,
) -> tuple[TrainState, dict[str, float]]:
    """Runs one GRPO-RoC iteration and returns the new state and its metrics (plain floats).

    ``state.rng`` is split into the next state key, the RoC key and the rollout seed, so the iteration is a
    deterministic function of (state, problems) for a deterministic rollout. Repeated problems in
    ``problems`` (a batch across an epoch boundary) are rolled out once.

    ``schedule`` (default: synchronous) produces the groups from ``problems`` (what its ``draw`` gave for
    this step) and keeps what crosses to the next step; a schedule with ``num_groups`` has the complete
    groups padded with empty ones to that many, so that nothing recompiles. ``record``: gets the step's
    groups with their release versions and what RoC kept (``rollout_record.RolloutRecord.write``).
    """
    start = time.perf_counter()
    rng, roc_key, rollout_key = jax.random.split(state.rng, 3)
    version = int(jax.device_get(state.step.addressable_data(0)))
    schedule = Synchronous() if schedule is None else schedule
    sampled = _sample(
        state.params,
        problems,
        rollout_fn=rollout_fn,
        schedule=schedule,
        samples_per_problem=config.samples_per_problem, max_response_length=max_response_length,
        max_turns=max_turns, reward_fn=reward_fn, rollout_key=rollout_key, version=version,
    )
    groups = sampled.groups
    scored = score_groups(groups, config.samples_per_problem, config.format_penalty)  # rewards, penalties
    metrics = rollout_metrics(groups, scored)
    choice = roc_choose(roc_key, groups, config, scored, max_response_length=max_response_length)
    batch, select_metrics = select_and_build_batch(
        roc_key, groups, config, num_rows, scored, max_response_length=max_response_length,
        padding_groups=sampled.padding, choice=choice,
    )
    metrics.update(select_metrics)
    metrics.update(sampled.schedule_metrics)
    metrics.update({f"rollout/{name}": float(value) for name, value in sampled.rollout_stats.items()})
    metrics.update(policy_lag_metrics(groups, version))
    metrics.update(staleness_metrics(batch, version))
    batch = batch.replace(policy_versions=None)  # bookkeeping only: the step's inputs are as they were
    update_start = time.perf_counter()
    # Optimizer state a colocated run parked in host memory during rollout comes back for the update.
    state = colocate.to_device(state.replace(rng=rng))
    state, step_metrics = rl_step(state, put_batch(batch, batch_sharding))
    step_metrics = jax.device_get(step_metrics)
    update_seconds = time.perf_counter() - update_start
    # The asynchronous producer's engines take the new weights now, while they decode.
    metrics.update(schedule.updated(state.params, version + 1, update_seconds=update_seconds,
                                    trained_tokens=float(step_metrics["tokens"])))
    end = time.perf_counter()
    if record is not None:
        record(_step_rollouts(sampled, choice, schedule, version))
    metrics.update({k: float(v) for k, v in step_metrics.items()})
    metrics.update(_timing_metrics(sampled, batch, update_seconds=update_seconds, step_seconds=end - start))
    return state, metrics


def _timing_metrics(sampled, batch: Batch, *, update_seconds: float, step_seconds: float) -> dict[str, float]:
    """The step's phases in seconds and its tokens per second (rollout: response tokens; update: batch
    tokens)."""
    batch_tokens = float((batch.segment_ids > 0).sum())
    response_tokens = sum(len(t.response_ids) for g in sampled.groups for t in g)
    return {
        "time/rollout": sampled.rollout_seconds,
        "time/verify": sampled.verify_seconds,
        "time/update": update_seconds,
        "time/step": step_seconds,
        "throughput/update_tokens_per_s": batch_tokens / max(update_seconds, 1e-9),
        "throughput/rollout_tokens_per_s": response_tokens / max(sampled.rollout_seconds, 1e-9),
    }


def filter_hard_problems(
    params,
    problems: Sequence[Problem],
    *,
    rollout_fn: RolloutFn,
    num_rollouts: int,
    batch_size: int,
    max_response_length: int,
    max_turns: int,
    seed: int,
    policy_version: int = 0,
    progress: Callable[[int], None] | None = None,
) -> tuple[list[Problem], dict[str, float]]:
    """The paper's stage-3 filter: ``num_rollouts`` rollouts per problem, drop problems solved every time
    (``policy_version``: the version of ``params``).

    Returns the kept problems (input order) and counts (``filter_kept``, ``filter_dropped``,
    ``filter_pass_rate``: mean pass rate over all problems).
    """
    if num_rollouts <= 0 or batch_size <= 0:
        raise ValueError(f"num_rollouts ({num_rollouts}) and batch_size ({batch_size}) must be positive")
    kept, pass_rates = [], []
    for start in range(0, len(problems), batch_size):
        chunk = list(problems[start : start + batch_size])
        groups = run_rollouts(
            rollout_fn,
            params,
            chunk,
            samples_per_problem=num_rollouts,
            max_response_length=max_response_length,
            max_turns=max_turns,
            seed=seed + start,
            policy_version=policy_version,
        )
        for problem, group in zip(chunk, groups, strict=True):
            solved = sum(t.reward > 0 for t in group)
            pass_rates.append(solved / max(len(group), 1))
            if solved < num_rollouts:
                kept.append(problem)
        if progress is not None:
            progress(len(chunk))
    stats = {
        "filter_kept": float(len(kept)),
        "filter_dropped": float(len(problems) - len(kept)),
        "filter_pass_rate": float(np.mean(pass_rates)) if pass_rates else 0.0,
    }
    return kept, stats
