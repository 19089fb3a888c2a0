"""One GRPO-RoC iteration: problems → 2G rollouts each → rewards → penalties → RoC to G → advantages → update.

The rollout is injected (``rollout_fn``), so the same iteration runs the real agent (engine + sandbox) or a
scripted rollout in tests. Signature expected of it::

    rollout_fn(params, problems, *, samples_per_problem, max_response_length, max_turns, seed)
        -> list[Trajectory]      # samples_per_problem per problem, rewards filled in

Policy versions: the version of parameters is the trainer step that produced them (``state.step``). A
``rollout_fn`` that takes a ``policy_version`` keyword gets it and tags the tokens it samples
(``Trajectory.policy_versions``, e.g. :class:`~rstar2jax.agent.PolicyRollout`); trajectories that come back
without tags get the version of the parameters they were rolled out with on every sampled token. The
iteration reports ``rollout/policy_lag_mean`` / ``rollout/policy_lag_max``: the version being updated minus
each trained token's version, over the batch's loss tokens (0 in synchronous on-policy runs).

Two options let rollouts cross a policy update (both off by default; then the iteration is the synchronous
on-policy one, number for number):

* one-step off-policy (``off_policy_steps=1``): the rollout of step n+1's problems is generated with step
  n's parameters before step n's update (sequentially here: the engine and the trainer share one parameter
  tree, so the update, which donates it, cannot run beside the rollout); step n then trains on the rollout
  made with step n-1's parameters (the first step of a stage trains on its own, on-policy rollout);
* partial rollouts (``token_budget``): the rollout stops once its sessions sampled that many tokens, the
  groups whose rollouts all finished are trained on, and the unfinished rollouts are resumed in the next
  step with the new parameters (their tokens keep their versions and sampler log-probs). The ``rollout_fn``
  must take ``token_budget`` and ``resume`` and then return ``(finished, unfinished)``, unfinished records
  having a ``problem_id`` and ``num_tokens`` (:class:`~rstar2jax.agent.PartialRollout`).

Either way the sampler's log-probs of the older tokens come from an older policy: the trainer's rollout
correction (``RLLossConfig`` with ``old_logprobs="recompute"`` and ``rollout_is_cap`` / ``rollout_mask``,
``algo.rollout_correction``) weighs them by pi_current / pi_behaviour. What a step hands to the next lives
in a :class:`RolloutCarry`.

Every process of a multi-host run calls the iteration; each rolls out its own slice of the problems and the
trajectories are gathered to all processes before selection, so all of them build the same global batch.

Faults: a ``rollout_fn`` with a ``last_stats`` dict of counts (:class:`~rstar2jax.agent.PolicyRollout`:
sandbox outage seconds, calls retried, restarts, trajectories dropped) has them summed over the step's calls
and logged as ``rollout/<name>``. A rollout that raises (a sandbox down past its outage budget) ends the
iteration before any update: the step is not counted. So does one that leaves no trajectory at all to train
on (:class:`~rstar2jax.train.faults.EmptyRollout`), rather than an update on an empty batch.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import functools
import inspect
import pickle
import time
import zlib
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from rstar2jax import algo
from rstar2jax.data.batch import Batch, build_batch, group_array, trajectory_sequence
from rstar2jax.data.problems import Problem
from rstar2jax.data.trajectory import NO_POLICY_VERSION, tool_error_ratios
from rstar2jax.train import colocate
from rstar2jax.train.faults import EmptyRollout
from rstar2jax.train.state import TrainState

RolloutFn = Callable[..., list["Trajectory"]]
# reward_fn(problem, trajectory) -> reward; when given it (re)scores every trajectory, timed as verification.
RewardFn = Callable[[Problem, "Trajectory"], float]

if TYPE_CHECKING:  # the agent package starts engine code on import; the trainer needs only the type
    from rstar2jax.data.trajectory import Trajectory


@dataclasses.dataclass(frozen=True)
class RLIterationConfig:
    """How one iteration turns rollouts into a batch (paper: 2G = 32 sampled, G = 16 kept).

    Attributes:
      samples_per_problem: rollouts sampled per problem (2G).
      keep: rollouts kept per problem by RoC (G).
      roc_mode / min_negatives / min_positives / reject_equal_reward / roc_eps: ``algo.roc_select`` options.
      estimator / std / advantage_eps: ``algo.group_advantages`` options.
      seq_len: batch row length in positions (a prompt + response of n tokens takes n - 1).
      pack: pack several trajectories per row (segment ids keep them apart); False = one per row.
      row_multiple: rows divide into micro-batches and data shards (num_microbatches x data x fsdp).
      format_penalty: RoC's p_format rule, "paper" (Eq. 5) or "release"
        (``algo.answer_format_penalty_release``).
      mask_truncated: truncated responses stay in their group's advantage statistics but carry no loss and
        do not count in the loss normaliser (TRL's ``mask_truncated_completions``).
      overlong_buffer / overlong_penalty_factor: DAPO's soft overlong penalty (``algo.soft_overlong_penalty``
        over the last ``overlong_buffer`` tokens of the response budget, 0 = off) added to the reward the
        advantages are computed from (RoC still splits positives and negatives by the task reward).
    """

    samples_per_problem: int = 32
    keep: int = 16
    roc_mode: str = "paper"
    min_negatives: int = 2
    min_positives: int = 2
    reject_equal_reward: bool = True
    roc_eps: float = 1e-6
    estimator: str = "grpo"
    std: str = "unbiased"
    advantage_eps: float = 1e-6
    seq_len: int = 4096
    pack: bool = True
    row_multiple: int = 1
    format_penalty: str = "paper"
    mask_truncated: bool = False
    overlong_buffer: int = 0
    overlong_penalty_factor: float = 1.0

    def __post_init__(self):
        if not 1 <= self.keep <= self.samples_per_problem:
            raise ValueError(
                f"keep={self.keep} must be in [1, samples_per_problem={self.samples_per_problem}]"
            )
        if self.format_penalty not in algo.FORMAT_PENALTIES:
            raise ValueError(
                f"format_penalty={self.format_penalty!r}; expected one of {algo.FORMAT_PENALTIES}"
            )
        if self.overlong_buffer < 0 or self.overlong_penalty_factor < 0:
            raise ValueError(
                f"overlong_buffer ({self.overlong_buffer}) and overlong_penalty_factor "
                f"({self.overlong_penalty_factor}) must be >= 0"
            )


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


def _gather_to_all_processes(items: list[Any]) -> list[Any]:
    """Concatenation, in process order, of every process's ``items`` (pickled through a uint8 all-gather)."""
    from jax.experimental import multihost_utils

    payload = np.frombuffer(pickle.dumps(items), np.uint8)
    sizes = multihost_utils.process_allgather(np.array([payload.size]))
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: payload.size] = payload
    gathered = multihost_utils.process_allgather(padded)
    return [
        item
        for row, size in zip(gathered, sizes.reshape(-1), strict=True)
        for item in pickle.loads(row[:size].tobytes())
    ]


def accepts_keyword(fn: Callable, name: str) -> bool:
    """Whether ``fn`` names the keyword argument ``name`` in its signature (a bare ``**kwargs`` does not
    count: a wrapper that forwards them to a plain rollout function would pass on what it cannot take)."""
    try:
        parameter = inspect.signature(fn).parameters.get(name)
    except (TypeError, ValueError):  # no signature to read: assume the plain protocol
        return False
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return parameter is not None and parameter.kind in keyword


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


def run_rollouts(
    rollout_fn: RolloutFn,
    params,
    problems: Sequence[Problem],
    *,
    samples_per_problem: int,
    max_response_length: int,
    max_turns: int,
    seed: int,
    policy_version: int | None = None,
) -> list[list[Trajectory]]:
    """Rollouts grouped per problem (in ``problems`` order); with several processes each rolls out a slice.

    ``policy_version``: the version of ``params``; passed to a ``rollout_fn`` that takes it, and tags the
    trajectories that come back without versions (see :func:`tag_versions`). None: nothing is tagged."""
    mine = problems[jax.process_index() :: jax.process_count()]
    extra = {}
    if policy_version is not None and accepts_keyword(rollout_fn, "policy_version"):
        extra["policy_version"] = policy_version
    trajectories = rollout_fn(
        params,
        list(mine),
        samples_per_problem=samples_per_problem,
        max_response_length=max_response_length,
        max_turns=max_turns,
        seed=seed + jax.process_index(),
        **extra,
    )
    if policy_version is not None:
        trajectories = tag_versions(trajectories, policy_version)
    if jax.process_count() > 1:
        trajectories = _gather_to_all_processes(list(trajectories))
    return _group(problems, trajectories, samples_per_problem)


@dataclasses.dataclass
class RolloutCarry:
    """Rollouts one RL step hands to the next (see the module doc); empty in synchronous on-policy runs.

    Attributes:
      ready: one-step off-policy: the next step's problems and their groups, rolled out with this step's
        parameters (None: the next step rolls out its own problems).
      unfinished: partial rollouts: the records the token budget stopped, resumed by the next step.
      held: partial rollouts: per open problem id, the finished trajectories of its group so far.
      problems: partial rollouts: the open groups' problems, by id, in the order they were opened.
    """

    ready: tuple[list[Problem], list[list[Trajectory]]] | None = None
    unfinished: list = dataclasses.field(default_factory=list)
    held: dict[str, list[Trajectory]] = dataclasses.field(default_factory=dict)
    problems: dict[str, Problem] = dataclasses.field(default_factory=dict)

    @property
    def open_groups(self) -> int:
        """Problems whose partial-rollout groups are not complete yet."""
        return len(self.problems)

    @property
    def empty(self) -> bool:
        return self.ready is None and not self.unfinished and not self.problems

    def encode(self) -> str:
        """The carry as text for a checkpoint's JSON meta (zlib-compressed pickle, base64)."""
        return base64.b64encode(zlib.compress(pickle.dumps(self))).decode("ascii")

    @staticmethod
    def decode(text: str) -> RolloutCarry:
        """Inverse of :meth:`encode` (only for checkpoints this run wrote: it unpickles)."""
        return pickle.loads(zlib.decompress(base64.b64decode(text)))


def _partial_rollouts(
    rollout_fn: RolloutFn,
    params,
    problems: Sequence[Problem],
    carry: RolloutCarry,
    *,
    samples_per_problem: int,
    max_response_length: int,
    max_turns: int,
    seed: int,
    policy_version: int,
    token_budget: int,
) -> tuple[list[Problem], list[list[Trajectory]], dict[str, float]]:
    """One step of partial rollouts: resume ``carry.unfinished``, open ``problems`` (but ids still open),
    sample until the budget; repeated (each call one more budget) until at least one group is complete.
    Returns the complete groups' problems and groups (the carried ones first) and counts; ``carry`` keeps
    the rest."""
    if jax.process_count() > 1:
        raise ValueError("partial rollouts (token_budget) run in one process only")
    for name in ("token_budget", "resume", "policy_version"):
        if not accepts_keyword(rollout_fn, name):
            raise ValueError(f"partial rollouts need a rollout_fn that takes {name}= (as PolicyRollout does)")
    new = [p for p in problems if p.id not in carry.problems]
    for p in new:
        carry.problems[p.id] = p
        carry.held[p.id] = []
    resumed = len(carry.unfinished)
    resumed_tokens = sum(u.num_tokens for u in carry.unfinished)
    unfinished, calls = carry.unfinished, 0
    while True:
        finished, unfinished = rollout_fn(
            params,
            new,
            samples_per_problem=samples_per_problem,
            max_response_length=max_response_length,
            max_turns=max_turns,
            seed=seed + calls,
            policy_version=policy_version,
            token_budget=token_budget,
            resume=unfinished,
        )
        calls, new, unfinished = calls + 1, [], list(unfinished)
        for t in finished:
            if t.problem_id not in carry.held:
                raise ValueError(f"rollout returned a trajectory for unknown problem {t.problem_id!r}")
            if t.policy_versions is None:
                raise ValueError("partial rollouts need trajectories with policy_versions (a resumed "
                                 "rollout mixes versions)")
            carry.held[t.problem_id].append(t)
        still_open = {u.problem_id for u in unfinished}
        complete = [pid for pid in carry.problems if pid not in still_open]
        if complete:
            break
    carry.unfinished = unfinished
    done = [carry.problems.pop(pid) for pid in complete]
    groups = [carry.held.pop(pid) for pid in complete]
    for group in groups:
        if len(group) > samples_per_problem:
            raise ValueError(f"rollout returned {len(group)} trajectories for problem "
                             f"{group[0].problem_id!r}, more than samples_per_problem={samples_per_problem}")
    metrics = {
        "rollout/partial_calls": float(calls),
        "rollout/partial_resumed": float(resumed),
        "rollout/partial_resumed_tokens": float(resumed_tokens),
        "rollout/partial_unfinished": float(len(unfinished)),
        "rollout/partial_open_groups": float(carry.open_groups),
    }
    return done, groups, metrics


def counting_stats(rollout_fn: RolloutFn, into: collections.Counter) -> RolloutFn:
    """``rollout_fn`` that adds its ``last_stats`` (when it has them) to ``into`` after each call; its
    signature stays readable (``functools.wraps``), so keyword detection sees the wrapped function's."""

    @functools.wraps(rollout_fn)
    def call(*args, **kwargs):
        result = rollout_fn(*args, **kwargs)
        into.update(getattr(rollout_fn, "last_stats", None) or {})
        return result

    return call


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


def select_and_build_batch(
    key: jax.Array,
    groups: list[list[Trajectory]],
    config: RLIterationConfig,
    num_rows: int | None = None,
    scored: ScoredGroups | None = None,
    *,
    max_response_length: int | None = None,
    padding_groups: int = 0,
) -> tuple[Batch, dict[str, float]]:
    """RoC down-selection to G per group, GRPO advantages over the kept ones, then the token batch.

    ``scored``: the groups' :func:`score_groups` at width ``samples_per_problem`` (default: computed here).
    ``max_response_length`` (the response budget) is needed with ``config.overlong_buffer`` > 0.
    ``padding_groups``: the last this many groups are empty padding (a fixed group count keeps the scoring
    programs' shapes): left out of the rejected-group counts.
    """
    width = config.samples_per_problem
    if scored is None:
        scored = score_groups(groups, width, config.format_penalty)
    if scored.rewards.shape != (len(groups), width):
        raise ValueError(f"scored arrays are {scored.rewards.shape}, expected {(len(groups), width)}")
    rewards, valid, p_total = scored.rewards, scored.valid, scored.p_total
    shaping = np.zeros_like(rewards)
    if config.overlong_buffer:
        if max_response_length is None:
            raise ValueError("overlong_buffer > 0 needs max_response_length (the response token budget)")
        lengths = group_array(groups, width, lambda t: len(t.response_ids))
        shaping = np.asarray(
            algo.soft_overlong_penalty(
                lengths,
                max_length=max_response_length,
                cache_length=config.overlong_buffer,
                factor=config.overlong_penalty_factor,
            )
        )
    selection, advantages, selected_p_total = jax.device_get(
        _select(
            key,
            rewards,
            shaping,
            valid,
            p_total,
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
    sequences = [trajectory_sequence(t, a) for t, a in kept]
    if config.mask_truncated:
        sequences = [
            dataclasses.replace(s, loss_mask=[0] * len(s.loss_mask)) if t.truncated else s
            for s, (t, _) in zip(sequences, kept, strict=True)
        ]
    batch = build_batch(
        sequences,
        seq_len=config.seq_len,
        num_rows=num_rows,
        row_multiple=config.row_multiple,
        pack=config.pack,
        with_rl_fields=True,
        with_policy_versions=True,
    )
    rejected = selection.rejected[: len(groups) - padding_groups]
    metrics = {
        "groups_rejected": float(rejected.sum()),
        "groups_rejected_frac": float(rejected.mean()) if len(rejected) else 0.0,
        "selected": float(len(kept)),
        "selected_reward": float(np.mean([t.reward for t, _ in kept])) if kept else 0.0,
        "selected_p_total": float(selected_p_total[mask].mean()) if kept else 0.0,
        "p_total": float(p_total[valid].mean()) if valid.any() else 0.0,
        "advantage_abs": float(np.abs(advantages[mask]).mean()) if kept else 0.0,
        "selected_truncated": float(sum(t.truncated for t, _ in kept)),
        "batch_rows": float(batch.tokens.shape[0]),
        "batch_fill": float((batch.segment_ids > 0).mean()),
    }
    return batch, metrics


def put_batch(batch: Batch, sharding: jax.sharding.Sharding | None) -> Batch:
    """The host batch as global device arrays; every process holds the whole batch and places its shards."""
    if sharding is None:
        return jax.device_put(batch)
    return jax.tree.map(
        lambda x: jax.make_array_from_callback(x.shape, sharding, lambda index: x[index]), batch
    )


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
    off_policy_steps: int = 0,
    next_problems: Sequence[Problem] | None = None,
    token_budget: int | None = None,
    carry: RolloutCarry | None = None,
    num_groups: int | None = None,
) -> tuple[TrainState, dict[str, float]]:
    """Runs one GRPO-RoC iteration and returns the new state and its metrics (plain floats).

    ``state.rng`` is split into the next state key, the RoC key and the rollout seed, so the iteration is a
    deterministic function of (state, problems) for a deterministic rollout. Repeated problems in
    ``problems`` (a batch across an epoch boundary) are rolled out once.

    Rollouts across an update (see the module doc), both with a ``carry`` that the call updates in place:
    ``off_policy_steps=1`` trains on ``carry.ready`` when it holds a rollout (``problems`` is then ignored;
    otherwise ``problems`` are rolled out now) and, before the update, rolls out ``next_problems`` (None: the
    last step of a stage, nothing) with this step's parameters into ``carry.ready``; ``token_budget`` runs
    partial rollouts: ``problems`` are the new problems of the step, and the complete groups (a number that
    varies) are padded with empty ones to ``num_groups`` (the most a step can complete, e.g.
    ``prompts_per_step``) so that nothing recompiles.
    """
    if off_policy_steps not in (0, 1):
        raise ValueError(f"off_policy_steps={off_policy_steps!r}; expected 0 or 1")
    if token_budget is not None and off_policy_steps:
        raise ValueError("partial rollouts (token_budget) and off_policy_steps=1 do not combine")
    if (off_policy_steps or token_budget is not None) and carry is None:
        raise ValueError("off_policy_steps=1 and token_budget need a RolloutCarry (carry=)")
    start = time.perf_counter()
    unique = list({p.id: p for p in problems}.values())
    rng, roc_key, rollout_key = jax.random.split(state.rng, 3)
    seed = int(jax.random.randint(rollout_key, (), 0, np.iinfo(np.int32).max))
    version = int(jax.device_get(state.step.addressable_data(0)))
    rollout_options = dict(
        samples_per_problem=config.samples_per_problem,
        max_response_length=max_response_length,
        max_turns=max_turns,
    )
    carry_metrics = {}
    rollout_stats = collections.Counter()
    rollout_fn = counting_stats(rollout_fn, rollout_stats)
    if token_budget is not None:
        unique, groups, carry_metrics = _partial_rollouts(
            rollout_fn, state.params, unique, carry, **rollout_options, seed=seed, policy_version=version,
            token_budget=token_budget,
        )
    elif off_policy_steps and carry.ready is not None:
        (unique, groups), carry.ready = carry.ready, None
    else:
        groups = run_rollouts(
            rollout_fn, state.params, unique, **rollout_options, seed=seed, policy_version=version
        )
    if off_policy_steps and next_problems is not None:
        # The next step's rollout, made with this step's parameters before this step's update.
        ahead = list({p.id: p for p in next_problems}.values())
        next_seed = int(jax.random.randint(jax.random.fold_in(rollout_key, 1), (), 0, np.iinfo(np.int32).max))
        carry.ready = (
            ahead,
            run_rollouts(rollout_fn, state.params, ahead, **rollout_options, seed=next_seed,
                         policy_version=version),
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

    padding = 0
    if num_groups is not None:
        if len(groups) > num_groups:
            raise ValueError(f"{len(groups)} complete groups, more than num_groups={num_groups}")
        padding = num_groups - len(groups)
        groups = groups + [[] for _ in range(padding)]
    scored = score_groups(groups, config.samples_per_problem, config.format_penalty)  # rewards, penalties
    metrics = rollout_metrics(groups, scored)
    batch, select_metrics = select_and_build_batch(
        roc_key, groups, config, num_rows, scored, max_response_length=max_response_length,
        padding_groups=padding,
    )
    metrics.update(select_metrics)
    metrics.update(carry_metrics)
    metrics.update({f"rollout/{name}": float(value) for name, value in rollout_stats.items()})
    metrics.update(policy_lag_metrics(groups, version))
    batch = batch.replace(policy_versions=None)  # bookkeeping only: the step's inputs are as they were
    update_start = time.perf_counter()
    # Optimizer state a colocated run parked in host memory during rollout comes back for the update.
    state = colocate.to_device(state.replace(rng=rng))
    state, step_metrics = rl_step(state, put_batch(batch, batch_sharding))
    step_metrics = jax.device_get(step_metrics)
    end = time.perf_counter()

    batch_tokens = float((batch.segment_ids > 0).sum())
    response_tokens = sum(len(t.response_ids) for g in groups for t in g)
    metrics.update({k: float(v) for k, v in step_metrics.items()})
    metrics.update(
        {
            "time/rollout": rollout_done - start,
            "time/verify": verify_done - rollout_done,
            "time/update": end - update_start,
            "time/step": end - start,
            "throughput/update_tokens_per_s": batch_tokens / max(end - update_start, 1e-9),
            "throughput/rollout_tokens_per_s": response_tokens / max(rollout_done - start, 1e-9),
        }
    )
    return state, metrics


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
    progress: Callable[[int], None] | None = None,
) -> tuple[list[Problem], dict[str, float]]:
    """The paper's stage-3 filter: ``num_rollouts`` rollouts per problem, drop problems solved every time.

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
