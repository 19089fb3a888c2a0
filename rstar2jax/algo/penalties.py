"""RoC trajectory penalties (rStar2-Agent Eq. 4-5) from structured counts.

The counts come from the agent loop's structured record (``Trajectory.num_failed_calls`` counts malformed
calls, exceptions, timeouts and resource-limit kills), never from substring matching on tool output as the
released code does. p_total = p_err + p_format in [0, 2] feeds ``roc_select``. Also DAPO's soft overlong
penalty, a reward-shaping term for responses near the length budget.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rstar2jax.algo import _checks

#: Which answer-format rule: "paper" (Eq. 5, ``answer_format_penalty``) or "release" (the released code's,
#: ``answer_format_penalty_release``).
FORMAT_PENALTIES = ("paper", "release")


def _count_pair(name_a: str, a, name_b: str, b) -> tuple[jax.Array, jax.Array]:
    a = _checks.as_array(name_a, a)
    b = _checks.as_array(name_b, b)
    _checks.check_real(name_a, a)
    _checks.check_real(name_b, b)
    _checks.check_shape(name_b, b, a.shape, name_a)
    return a.astype(jnp.float32), b.astype(jnp.float32)


def tool_error_penalty(num_tool_calls: jax.Array, num_failed_calls: jax.Array) -> jax.Array:
    """Tool-error penalty (Eq. 4), elementwise over arrays of counts of the same shape.

      p_err = 0.5                                  if num_tool_calls == 0 (nudges towards using the tool)
            = num_failed_calls / num_tool_calls     otherwise

    Counts must satisfy 0 <= num_failed_calls <= num_tool_calls (not checked: they may be traced).

    Returns:
      float32 array of the counts' shape, values in [0, 1].
    """
    calls, failed = _count_pair("num_tool_calls", num_tool_calls, "num_failed_calls", num_failed_calls)
    return jnp.where(calls > 0, failed / jnp.maximum(calls, 1.0), 0.5)


def answer_format_penalty(num_answer_blocks: jax.Array, num_turns: jax.Array) -> jax.Array:
    """Answer-format penalty (Eq. 5), elementwise over arrays of counts of the same shape.

      p_format = 1                                          if num_answer_blocks == 0
               = min(1, (num_answer_blocks - 1) / num_turns)  otherwise

    ``num_turns`` counts every assistant turn, the first included (so one answer in one turn gives 0, two
    answers in two turns 0.5). A rollout with an answer has at least one turn; a zero is read as one.

    Returns:
      float32 array of the counts' shape, values in [0, 1].
    """
    answers, turns = _count_pair("num_answer_blocks", num_answer_blocks, "num_turns", num_turns)
    extra_per_turn = (answers - 1.0) / jnp.maximum(turns, 1.0)
    return jnp.where(answers > 0, jnp.minimum(1.0, extra_per_turn), 1.0)


def answer_format_penalty_release(
    num_answer_opens: jax.Array,
    num_answer_closes: jax.Array,
    num_answer_pairs: jax.Array,
    num_turns: jax.Array,
) -> jax.Array:
    """The released rStar2-Agent code's answer-format penalty (``format_penalty="release"``), elementwise.

      p_format = 1                              if opens == 0, closes == 0, opens != pairs or closes != pairs
               = 1                              if turns_r == 0
               = min(1, (pairs - 1) / turns_r)  otherwise,    turns_r = num_turns - 1

    opens / closes count ``<answer>`` / ``</answer>`` tags and pairs the closed ``<answer>...</answer>``
    blocks in the model's text. The released code counts turns as ``<|im_start|>assistant ... <|im_end|>``
    spans of the decoded response, whose first assistant header is part of the prompt, so it sees one turn
    fewer than ``num_turns`` (every assistant turn, the first included): a one-turn rollout has turns_r = 0
    and gets 1 (paper Eq. 5, ``answer_format_penalty``, gives it 0). Counts are not checked for consistency
    (they may be traced).

    Returns:
      float32 array of the counts' shape, values in [0, 1].
    """
    opens, closes = _count_pair("num_answer_opens", num_answer_opens, "num_answer_closes", num_answer_closes)
    pairs, turns = _count_pair("num_answer_pairs", num_answer_pairs, "num_turns", num_turns)
    _checks.check_shape("num_answer_pairs", pairs, opens.shape, "num_answer_opens")
    well_formed = (opens > 0) & (closes > 0) & (opens == pairs) & (closes == pairs)
    response_turns = turns - 1.0
    extra_per_turn = (pairs - 1.0) / jnp.maximum(response_turns, 1.0)
    return jnp.where(well_formed & (response_turns > 0), jnp.minimum(1.0, extra_per_turn), 1.0)


def soft_overlong_penalty(
    lengths: jax.Array, *, max_length: int, cache_length: int, factor: float | jax.Array = 1.0
) -> jax.Array:
    """DAPO's soft overlong punishment (Yu et al. 2025, Eq. 13), elementwise over response lengths |y|:

      R_length = 0                                  if |y| <= L_max - L_cache
               = factor * ((L_max - L_cache) - |y|) / L_cache   if L_max - L_cache < |y| <= L_max
               = -factor                            if |y| > L_max

    with L_max = ``max_length`` and L_cache = ``cache_length`` (DAPO: 20480 and 4096; verl's
    ``overlong_buffer.len`` and ``penalty_factor``). It is added to the task reward.

    Returns:
      float32 array of ``lengths``' shape, values in [-factor, 0].
    """
    lengths = _checks.as_array("lengths", lengths)
    _checks.check_real("lengths", lengths)
    if not 0 < cache_length <= max_length:
        raise ValueError(f"cache_length must be in (0, max_length={max_length}], got {cache_length}")
    expected = float(max_length - cache_length)
    ramp = (expected - lengths.astype(jnp.float32)) / float(cache_length)
    return factor * jnp.clip(ramp, -1.0, 0.0)
