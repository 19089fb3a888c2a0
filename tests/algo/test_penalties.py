import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rstar2jax import algo


@pytest.mark.parametrize(
    "calls, failed, want",
    [
        (0, 0, 0.5),  # no calls: the fixed nudge towards using the tool
        (3, 3, 1.0),  # all failed
        (4, 0, 0.0),  # all clean
        (4, 1, 0.25),
        (1, 1, 1.0),
    ],
)
def test_tool_error_penalty_cases(calls, failed, want):
    assert float(algo.tool_error_penalty(np.int32(calls), np.int32(failed))) == pytest.approx(want)


@pytest.mark.parametrize(
    "answers, turns, want",
    [
        (1, 1, 0.0),  # one answer in one turn
        (2, 2, 0.5),  # two answers in two turns
        (0, 3, 1.0),  # no answer
        (0, 1, 1.0),
        (3, 1, 1.0),  # capped at 1
        (2, 5, 0.2),
    ],
)
def test_answer_format_penalty_cases(answers, turns, want):
    assert float(algo.answer_format_penalty(np.int32(answers), np.int32(turns))) == pytest.approx(want)


def test_elementwise_over_arrays_under_jit_and_vmap():
    calls = np.array([[0, 3, 4], [2, 1, 0]])
    failed = np.array([[0, 3, 1], [1, 0, 0]])
    want = np.array([[0.5, 1.0, 0.25], [0.5, 0.0, 0.5]], np.float32)
    out = jax.jit(algo.tool_error_penalty)(calls, failed)
    assert out.dtype == jnp.float32 and out.shape == (2, 3)
    np.testing.assert_allclose(out, want)
    np.testing.assert_allclose(jax.vmap(algo.tool_error_penalty)(calls, failed), want)
    fmt = jax.vmap(algo.answer_format_penalty)(np.array([[1, 2], [0, 4]]), np.array([[1, 2], [2, 2]]))
    np.testing.assert_allclose(fmt, [[0.0, 0.5], [1.0, 1.0]])
    # float counts (e.g. averaged statistics) are accepted too
    np.testing.assert_allclose(algo.answer_format_penalty(np.float32(2), jnp.bfloat16(4)), 0.25)


def test_bad_inputs_raise_clear_errors():
    with pytest.raises(ValueError, match="num_failed_calls must have the shape of num_tool_calls"):
        algo.tool_error_penalty(np.zeros(3, int), np.zeros(2, int))
    with pytest.raises(TypeError, match="num_turns must be an integer or floating-point"):
        algo.answer_format_penalty(np.ones(2, int), np.ones(2, bool))
