"""Token batches for the SFT and RL steps: sequences packed (or padded) into fixed ``[rows, seq_len]`` arrays,
and per-trajectory values as ``[groups, 2G]`` arrays (:func:`group_array`) for ``algo``.

Every array is *target-aligned*: position ``t`` holds the input token ``tokens[t]``, the token it must predict
``targets[t]`` and that target's loss mask, sampler log-prob and advantage. A sequence of ``n`` tokens uses
``n - 1`` positions (inputs ``s[:-1]``, targets ``s[1:]``), so a packed row never asks a segment's last token
to predict the next segment's first one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import flax.struct
import jax
import numpy as np

from rstar2jax.data import packing

if TYPE_CHECKING:
    from rstar2jax.data.trajectory import Trajectory


@flax.struct.dataclass
class Batch:
    """A ``[rows, seq_len]`` token batch; ``advantages`` and ``sampler_logp`` are ``None`` for SFT.

    Attributes:
      tokens: int32 input tokens.
      targets: int32 next tokens (the prediction targets at each position).
      positions: int32 position of each token inside its own sequence.
      segment_ids: int32 sequence id inside the row (1, 2, ...); 0 marks padding.
      loss_mask: float32, 1 where ``targets`` is trained on (sampled response / assistant tokens).
      advantages: float32 per-token advantage (the sequence's scalar advantage broadcast to its tokens).
      sampler_logp: float32 log-prob of ``targets`` the sampler recorded as it drew them (the behaviour
        policy's, in the rollout's precision); the loss's pi_old is this or a recomputed one
        (``RLLossConfig.old_logprobs``). ``old_logp``: its old name, still readable.
      policy_versions: int32 policy version (trainer step) that sampled ``targets``, -1 where no policy
        did (prompt, tool output, padding); only with ``build_batch(with_policy_versions=True)``: host-side
        bookkeeping (the trainer reports the policy lag from it), not an input of the train steps.
    """

    tokens: jax.Array
    targets: jax.Array
    positions: jax.Array
    segment_ids: jax.Array
    loss_mask: jax.Array
    advantages: jax.Array | None = None
    sampler_logp: jax.Array | None = None
    policy_versions: jax.Array | None = None

    @property
    def old_logp(self) -> jax.Array | None:
        """The old name of :attr:`sampler_logp`: the sampler's log-probs (maybe not the loss's pi_old)."""
        return self.sampler_logp

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tokens.shape)


@dataclasses.dataclass(frozen=True)
class TokenSequence:
    """One training sequence: ``tokens`` with a per-token ``loss_mask`` (1 = train on predicting this token).

    ``logprobs`` (per token, sampler log-prob of the token, ignored where the mask is 0) and ``advantage`` are
    set for RL sequences; ``policy_versions`` (per token, the policy version that sampled it, -1 where none
    did) when the rollout recorded them.
    """

    tokens: Sequence[int]
    loss_mask: Sequence[float]
    logprobs: Sequence[float] | None = None
    advantage: float = 0.0
    policy_versions: Sequence[int] | None = None

    def __post_init__(self):
        n = len(self.tokens)
        if n < 2:
            raise ValueError(f"a training sequence needs at least 2 tokens, got {n}")
        if len(self.loss_mask) != n or (self.logprobs is not None and len(self.logprobs) != n):
            raise ValueError(
                f"tokens ({n}), loss_mask ({len(self.loss_mask)}) and logprobs "
                f"({None if self.logprobs is None else len(self.logprobs)}) must have the same length"
            )
        if self.policy_versions is not None and len(self.policy_versions) != n:
            raise ValueError(f"tokens ({n}) and policy_versions ({len(self.policy_versions)}) must have the "
                             "same length")
        if self.loss_mask[0]:
            raise ValueError("the first token of a sequence has no context and cannot carry loss")


def trajectory_sequence(trajectory: Trajectory, advantage: float) -> TokenSequence:
    """Prompt + response as one sequence; loss on the sampled response tokens, sampler log-probs and policy
    versions kept (prompt tokens: version -1)."""
    if not trajectory.prompt_ids:
        raise ValueError(f"trajectory of problem {trajectory.problem_id!r} has an empty prompt")
    prompt = len(trajectory.prompt_ids)
    versions = getattr(trajectory, "policy_versions", None)
    return TokenSequence(
        tokens=[*trajectory.prompt_ids, *trajectory.response_ids],
        loss_mask=[0] * prompt + list(trajectory.loss_mask),
        logprobs=[0.0] * prompt + list(trajectory.logprobs),
        advantage=float(advantage),
        policy_versions=None if versions is None else [-1] * prompt + list(versions),
    )


def group_array(
    groups: Sequence[Sequence[Trajectory]], width: int, value: Callable[[Trajectory], float]
) -> np.ndarray:
    """``value`` of each trajectory as a float32 ``[groups, width]`` array (GRPO's ``[groups, 2G]`` layout for
    ``algo``): row g holds group g's trajectories in order, zero-padded past its length."""
    out = np.zeros((len(groups), width), np.float32)
    for g, group in enumerate(groups):
        if len(group) > width:
            raise ValueError(f"group {g} has {len(group)} trajectories, more than width={width}")
        out[g, : len(group)] = [value(t) for t in group]
    return out


def _assign_rows(
    lengths: Sequence[int], seq_len: int, *, pack: bool
) -> tuple[list[int], list[tuple[int, int]]]:
    """Rows by first-fit decreasing (``pack``) or one per sequence: per-row fill and, per sequence, (row,
    start column)."""
    widths = [n - 1 for n in lengths]
    for i, width in enumerate(widths):
        if width > seq_len:
            raise ValueError(
                f"sequence {i} has {lengths[i]} tokens; it needs {width} positions but seq_len is {seq_len}"
            )
    rows = packing.first_fit_decreasing(widths, seq_len) if pack else [[i] for i in range(len(widths))]
    fill = [0] * len(rows)
    placement = [(0, 0)] * len(widths)
    for r, row in enumerate(rows):
        for i in row:
            placement[i] = (r, fill[r])
            fill[r] += widths[i]
    return fill, placement


def build_batch(
    sequences: Sequence[TokenSequence],
    *,
    seq_len: int,
    num_rows: int | None = None,
    row_multiple: int = 1,
    pack: bool = True,
    with_rl_fields: bool = False,
    with_policy_versions: bool = False,
) -> Batch:
    """Packs sequences into a NumPy ``Batch`` of ``[num_rows, seq_len]``.

    Args:
      sequences: the sequences, packed first-fit decreasing (``data.packing``; ``pack=False``: one per
        row, padded).
      seq_len: row length in positions (a sequence of n tokens takes n - 1).
      num_rows: fixed row count (padding rows have segment id 0 and no loss); ``None`` rounds the rows needed
        up to ``row_multiple`` times a power of two, so a run compiles for a handful of shapes at most.
      row_multiple: rows must divide evenly into micro-batches and data shards.
      with_rl_fields: fill ``advantages`` and ``sampler_logp`` (sequences without log-probs get 0).
      with_policy_versions: fill ``policy_versions`` (-1 where a sequence has none).
    """
    if seq_len <= 0 or row_multiple <= 0:
        raise ValueError(f"seq_len ({seq_len}) and row_multiple ({row_multiple}) must be positive")
    fill, placement = _assign_rows([len(s.tokens) for s in sequences], seq_len, pack=pack)
    if num_rows is None:
        units = -(-max(len(fill), 1) // row_multiple)
        num_rows = row_multiple * (1 << (units - 1).bit_length())
    elif len(fill) > num_rows:
        raise ValueError(
            f"{len(sequences)} sequences need {len(fill)} rows of {seq_len}, but num_rows={num_rows}"
        )
    if num_rows % row_multiple:
        raise ValueError(f"num_rows={num_rows} must be a multiple of row_multiple={row_multiple}")

    shape = (num_rows, seq_len)
    tokens, targets, positions, segment_ids = (np.zeros(shape, np.int32) for _ in range(4))
    loss_mask, advantages, sampler_logp = (np.zeros(shape, np.float32) for _ in range(3))
    versions = np.full(shape, -1, np.int32)
    segments_in_row = np.zeros(num_rows, np.int32)
    for seq, (row, start) in zip(sequences, placement, strict=True):
        stop = start + len(seq.tokens) - 1
        span = np.s_[row, start:stop]
        segments_in_row[row] += 1
        tokens[span] = seq.tokens[:-1]
        targets[span] = seq.tokens[1:]
        positions[span] = np.arange(stop - start)
        segment_ids[span] = segments_in_row[row]
        loss_mask[span] = seq.loss_mask[1:]
        advantages[span] = seq.advantage
        if seq.logprobs is not None:
            sampler_logp[span] = seq.logprobs[1:]
        if seq.policy_versions is not None:
            versions[span] = seq.policy_versions[1:]
    rl = dict(advantages=advantages, sampler_logp=sampler_logp) if with_rl_fields else {}
    if with_policy_versions:
        rl["policy_versions"] = versions
    return Batch(
        tokens=tokens,
        targets=targets,
        positions=positions,
        segment_ids=segment_ids,
        loss_mask=loss_mask,
        **rl,
    )
