"""From sampled groups to the update's batch: scoring (rewards, paper Eq. 4-5 penalties), RoC down-selection
to G per group, group advantages, the token batch, and the metrics of what was sampled.

``RLIterationConfig`` (``rstar2jax.config.algorithm``) holds the options of this path (paper: 2G = 32
sampled, G = 16 kept).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import jax
import numpy as np

from rstar2jax import algo
from rstar2jax.config.algorithm import RLIterationConfig
from rstar2jax.data.batch import Batch, build_batch, group_array, trajectory_sequence
from rstar2jax.data.problems import Problem
from rstar2jax.data.trajectory import tool_error_ratios

if TYPE_CHECKING:
    from rstar2jax.data.trajectory import Trajectory

# reward_fn(problem, trajectory) -> reward; when given it (re)scores every trajectory, timed as verification.
RewardFn = Callable[[Problem, "Trajectory"], float]


def policy_lag_metrics(groups: Sequence[Sequence[Trajectory]], version: int) -> dict[str, float]:
    """``rollout/policy_lag_mean`` / ``_max``: ``version`` minus the policy version of each sampled response
    token (loss mask 1) of the step's rollouts (all of them, before selection); 0 / 0 without any."""
    versions = [
        np.asarray(t.policy_versions, np.int64)[np.asarray(t.loss_mask, bool)]
        for group in groups
        for t in group
        if t.policy_versions is not None
    ]
    versions = np.concatenate(versions) if versions else np.zeros((0,), np.int64)
    lag = version - versions
    if np.any(lag < 0) or np.any(versions < 0):
        raise ValueError(f"sampled tokens carry policy versions outside [0, {version}]")
    return {
        "rollout/policy_lag_mean": float(lag.mean()) if lag.size else 0.0,
        "rollout/policy_lag_max": float(lag.max()) if lag.size else 0.0,
    }


def staleness_metrics(batch: Batch, version: int) -> dict[str, float]:
    """How stale the trained tokens are: over the batch's loss tokens, ``version`` (the parameters the update
    starts from) minus the version that sampled each: ``staleness/max``, ``staleness/mean`` and
    ``staleness/tokens_behind_<k>`` (how many trained tokens were sampled k versions before), k from 0 to the
    max. Needs ``batch.policy_versions``; empty without them."""
    if batch.policy_versions is None:
        return {}
    versions = np.asarray(batch.policy_versions)[(np.asarray(batch.loss_mask) > 0)
                                                 & (np.asarray(batch.policy_versions) >= 0)]
    lag = version - versions.astype(np.int64)
    if not lag.size:
        return {}
    counts = np.bincount(lag)
    return {"staleness/max": float(lag.max()), "staleness/mean": float(lag.mean()),
            **{f"staleness/tokens_behind_{k}": float(n) for k, n in enumerate(counts)}}


def check_rewards(groups: list[list[Trajectory]]) -> None:
    """Raises ``ValueError`` naming the first trajectory whose reward is not a finite number (a NaN reward
    would otherwise zero or poison its whole group's advantages)."""
    for group in groups:
        for i, t in enumerate(group):
            if not isinstance(t.reward, (int, float, np.number)) or not np.isfinite(t.reward):
                raise ValueError(
                    f"trajectory {i} of problem {t.problem_id!r} has reward {t.reward!r}; "
                    "rewards must be finite numbers"
                )


@functools.partial(jax.jit, static_argnames="rule")
def _penalties(calls, failed, opens, closes, pairs, turns, *, rule):
    """(p_err, p_format) of ``[groups, rollouts]`` counts, Eq. 4 and the ``rule``'s format penalty (one
    compiled call per shape)."""
    if rule == "release":
        p_format = algo.answer_format_penalty_release(opens, closes, pairs, turns)
    else:
        p_format = algo.answer_format_penalty(opens, turns)
    return algo.tool_error_penalty(calls, failed), p_format


def _answer_count(t: Trajectory, name: str) -> int:
    value = getattr(t, name)
    if value is None:
        raise ValueError(
            f"format_penalty='release' needs {name} of every trajectory; a trajectory of problem "
            f"{t.problem_id!r} has none (set it with data.trajectory.answer_tag_counts)"
        )
    return value


@dataclasses.dataclass(frozen=True)
class ScoredGroups:
    """Each problem's rollouts as ``[groups, width]`` arrays (zero past a group's end): the rewards, which
    entries hold a rollout, and the penalties of paper Eq. 4-5, computed once per iteration
    (:func:`score_groups`) for both the metrics and RoC."""

    rewards: np.ndarray
    valid: np.ndarray
    p_err: np.ndarray
    p_format: np.ndarray

    @property
    def p_total(self) -> np.ndarray:
        """p_total = p_err + p_format, RoC's penalty of each rollout."""
        return self.p_err + self.p_format


def score_groups(groups: list[list[Trajectory]], width: int, format_penalty: str = "paper") -> ScoredGroups:
    """The :class:`ScoredGroups` of ``groups`` (each at most ``width`` rollouts); ``format_penalty`` picks
    p_format's rule ("paper": Eq. 5; "release": the released code's). A reward that is not a finite number
    is an error naming its trajectory."""
    check_rewards(groups)
    release = format_penalty == "release"
    p_err, p_format = _penalties(
        group_array(groups, width, lambda t: t.num_tool_calls),
        group_array(groups, width, lambda t: t.num_failed_calls),
        group_array(groups, width, lambda t: t.num_answer_blocks),
        group_array(groups, width, lambda t: _answer_count(t, "num_answer_closes") if release else 0),
        group_array(groups, width, lambda t: _answer_count(t, "num_answer_pairs") if release else 0),
        group_array(groups, width, lambda t: t.num_turns),
        rule=format_penalty,
    )
    return ScoredGroups(
        rewards=group_array(groups, width, lambda t: t.reward),
        valid=group_array(groups, width, lambda t: 1.0) > 0,
        p_err=np.asarray(p_err),
        p_format=np.asarray(p_format),
    )


def rescore(
    problems: Sequence[Problem], groups: list[list[Trajectory]], reward_fn: RewardFn
) -> list[list[Trajectory]]:
    """``groups`` with every trajectory's reward set by ``reward_fn(problem, trajectory)``: new trajectory
    records, the rollout's own are left as they were."""
    by_id = {p.id: p for p in problems}
    return [
        [dataclasses.replace(t, reward=float(reward_fn(by_id[t.problem_id], t))) for t in group]
        for group in groups
    ]


def rollout_metrics(
    groups: list[list[Trajectory]], scored: ScoredGroups | None = None
) -> dict[str, float]:
    """What the sampled rollouts look like (all 2G per problem, before selection).

    ``scored``: the groups' :func:`score_groups` when the caller has it (default: computed here). The
    tool-error ratios are ``data.trajectory.tool_error_ratios``'s (NaN without calls; TensorBoard skips NaN).
    ``entropy_mean``: the mean sampling entropy (nats) over the sampled response tokens of the trajectories
    that recorded it (``Trajectory.entropies``); absent when none did.
    """
    flat = [t for g in groups for t in g]
    if not flat:
        return {}
    correct = [t for t in flat if t.reward > 0]
    calls = sum(t.num_tool_calls for t in flat)
    if scored is None:
        scored = score_groups(groups, max(len(g) for g in groups))
    lengths = np.array([len(t.response_ids) for t in flat], np.float64)
    pass_rates = np.array([np.mean([t.reward > 0 for t in g]) for g in groups if g])
    metrics = {
        "reward": float(np.mean([t.reward for t in flat])),
        "accuracy": len(correct) / len(flat),
        "problems_all_correct": float(np.mean(pass_rates == 1.0)),
        "problems_none_correct": float(np.mean(pass_rates == 0.0)),
        "tool_calls_per_traj": calls / len(flat),
        **tool_error_ratios(flat),
        "p_format": float(scored.p_format[scored.valid].mean()),
        "turns": float(np.mean([t.num_turns for t in flat])),
        "response_length": float(lengths.mean()),
        "response_length_max": float(lengths.max()),
        "truncation_rate": float(np.mean([t.truncated for t in flat])),
        "num_trajectories": float(len(flat)),
    }
    sampled_entropies = [
        np.asarray(t.entropies, np.float64)[np.asarray(t.loss_mask, bool)]
        for t in flat
        if t.entropies is not None
    ]
    if sum(e.size for e in sampled_entropies):
        metrics["entropy_mean"] = float(np.concatenate(sampled_entropies).mean())
    phases = collections.defaultdict(float)
    for t in flat:
        for phase, seconds in t.timings.items():
            phases[phase] += seconds
    metrics.update({f"traj_time/{phase}": seconds / len(flat) for phase, seconds in phases.items()})
    return metrics


@functools.partial(jax.jit, static_argnames=("keep", "mode", "estimator", "std"))
def _select(
    key,
    rewards,
    shaping,
    valid,
    p_total,
    min_negatives,
    min_positives,
    reject_equal,
    roc_eps,
    advantage_eps,
    *,
    keep,
    mode,
    estimator,
    std,
):
    """RoC selection (on the task rewards) and the advantages of the kept rollouts (on rewards + shaping), in
    one compiled call."""
    selection = algo.roc_select(
        key,
        rewards,
        p_total,
        valid,
        keep=keep,
        mode=mode,
        min_negatives=min_negatives,
        min_positives=min_positives,
        reject_equal_reward=reject_equal,
        eps=roc_eps,
    )
    advantages = algo.group_advantages(
        selection.gather(rewards + shaping), selection.mask, estimator=estimator, std=std, eps=advantage_eps
    )
    return selection, advantages, selection.gather(p_total)


def _overlong_shaping(groups: list[list[Trajectory]], config: RLIterationConfig,
                      max_response_length: int | None) -> np.ndarray:
    """DAPO's soft overlong penalty of every rollout (``[groups, samples_per_problem]``), added to the rewards
    the advantages are computed from."""
    if max_response_length is None:
        raise ValueError("overlong_buffer > 0 needs max_response_length (the response token budget)")
    lengths = group_array(groups, config.samples_per_problem, lambda t: len(t.response_ids))
    return np.asarray(
        algo.soft_overlong_penalty(
            lengths,
            max_length=max_response_length,
            cache_length=config.overlong_buffer,
            factor=config.overlong_penalty_factor,
        )
    )


def _sequences(kept: list[tuple[Trajectory, float]], mask_truncated: bool) -> list:
    """The token sequences of the kept (trajectory, advantage) pairs; ``mask_truncated``: a truncated one
    carries no loss."""
    sequences = [trajectory_sequence(t, a) for t, a in kept]
    if mask_truncated:
        sequences = [
            dataclasses.replace(s, loss_mask=[0] * len(s.loss_mask)) if t.truncated else s
            for s, (t, _) in zip(sequences, kept, strict=True)
        ]
    return sequences


@dataclasses.dataclass(frozen=True)
class RocChoice:
    """What RoC kept of a step's groups: ``kept`` (trajectory, advantage) pairs in group order; ``mask`` /
    ``indices`` (groups x keep): which selected slots hold a kept trajectory and its index in its group;
    ``advantages``, ``selected_p_total``, ``rejected`` (per group) as ``_select`` gave them."""

    kept: list
    mask: np.ndarray
    indices: np.ndarray
    advantages: np.ndarray
    selected_p_total: np.ndarray
    rejected: np.ndarray

    def kept_in_group(self, group: int) -> set[int]:
        """The indices (in its group) of group ``group``'s kept trajectories."""
        return {int(self.indices[group, j]) for j in np.nonzero(self.mask[group])[0]}


def roc_choose(key: jax.Array, groups: list[list[Trajectory]], config: RLIterationConfig,
               scored: ScoredGroups, *, max_response_length: int | None = None) -> RocChoice:
    """RoC down-selection to G per group and the kept ones' GRPO advantages (``select_and_build_batch``'s
    first half: what a rollout record needs to say which trajectories trained)."""
    shaping = np.zeros_like(scored.rewards)
    if config.overlong_buffer:
        shaping = _overlong_shaping(groups, config, max_response_length)
    selection, advantages, selected_p_total = jax.device_get(
        _select(
            key,
            scored.rewards,
            shaping,
            scored.valid,
            scored.p_total,
            config.min_negatives,
            config.min_positives,
            config.reject_equal_reward,
            config.roc_eps,
            config.advantage_eps,
            keep=config.keep,
            mode=config.roc_mode,
            estimator=config.estimator,
            std=config.std,
        )
    )
    mask = selection.mask
    kept = [
        (groups[g][selection.indices[g, j]], float(advantages[g, j]))
        for g, j in zip(*np.nonzero(mask), strict=True)
    ]
    return RocChoice(kept, mask, selection.indices, advantages, selected_p_total, selection.rejected)


def select_and_build_batch(
    key: jax.Array,
    groups: list[list[Trajectory]],
    config: RLIterationConfig,
    num_rows: int | None = None,
    scored: ScoredGroups | None = None,
    *,
    max_response_length: int | None = None,
    padding_groups: int = 0,
    choice: RocChoice | None = None,
) -> tuple[Batch, dict[str, float]]:
    """RoC down-selection to G per group, GRPO advantages over the kept ones, then the token batch.

    ``scored``: the groups' :func:`score_groups` at width ``samples_per_problem`` (default: computed here).
    ``max_response_length`` (the response budget) is needed with ``config.overlong_buffer`` > 0.
    ``padding_groups``: the last this many groups are empty padding (a fixed group count keeps the scoring
    programs' shapes): left out of the rejected-group counts. ``choice``: :func:`roc_choose`'s, made already
    with the same arguments (default: made here).
    """
    width = config.samples_per_problem
    if scored is None:
        scored = score_groups(groups, width, config.format_penalty)
    if scored.rewards.shape != (len(groups), width):
        raise ValueError(f"scored arrays are {scored.rewards.shape}, expected {(len(groups), width)}")
    if choice is None:
        choice = roc_choose(key, groups, config, scored, max_response_length=max_response_length)
    p_total, valid, kept, mask = scored.p_total, scored.valid, choice.kept, choice.mask
    batch = build_batch(
        _sequences(kept, config.mask_truncated),
        seq_len=config.seq_len,
        num_rows=num_rows,
        row_multiple=config.row_multiple,
        pack=config.pack,
        with_rl_fields=True,
        with_policy_versions=True,
    )
    rejected = choice.rejected[: len(groups) - padding_groups]
    metrics = {
        "groups_rejected": float(rejected.sum()),
        "groups_rejected_frac": float(rejected.mean()) if len(rejected) else 0.0,
        "selected": float(len(kept)),
        "selected_reward": float(np.mean([t.reward for t, _ in kept])) if kept else 0.0,
        "selected_p_total": float(choice.selected_p_total[mask].mean()) if kept else 0.0,
        "p_total": float(p_total[valid].mean()) if valid.any() else 0.0,
        "advantage_abs": float(np.abs(choice.advantages[mask]).mean()) if kept else 0.0,
        "selected_truncated": float(sum(t.truncated for t, _ in kept)),
        "batch_rows": float(batch.tokens.shape[0]),
        "batch_fill": float((batch.segment_ids > 0).mean()),
    }
    return batch, metrics
