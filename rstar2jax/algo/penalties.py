"""RoC trajectory penalties (rStar2-Agent Eq. 4-5) from structured counts.

The counts come from the agent loop's structured record (``Trajectory.num_failed_calls`` counts malformed
calls, exceptions, timeouts and resource-limit kills), never from substring matching on tool output as the
released code does. p_total = p_err + p_format in [0, 2] feeds ``roc_select``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from rstar2jax.algo import _checks


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
