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


@pytest.mark.parametrize(
    "opens, closes, pairs, turns, want",
    [
        (1, 1, 1, 1, 1.0),  # one turn: the released code sees 0 turns in the response (Eq. 5 gives 0)
        (1, 1, 1, 2, 0.0),  # one answer, one turn after the first
        (2, 2, 2, 3, 0.5),
        (2, 2, 2, 5, 0.25),
        (3, 3, 3, 2, 1.0),  # capped at 1
        (0, 1, 0, 3, 1.0),  # no opening tag
        (1, 0, 0, 3, 1.0),  # no closing tag
        (2, 1, 1, 3, 1.0),  # an unclosed <answer>
        (2, 2, 1, 3, 1.0),  # tags that do not pair up (e.g. </answer><answer>)
    ],
)
def test_answer_format_penalty_release_cases(opens, closes, pairs, turns, want):
    got = algo.answer_format_penalty_release(*(np.int32(c) for c in (opens, closes, pairs, turns)))
    assert float(got) == pytest.approx(want)
    counts = (np.array([c]) for c in (opens, closes, pairs, turns))
    jitted = jax.jit(algo.answer_format_penalty_release)(*counts)
    np.testing.assert_allclose(jitted, [want])


def test_soft_overlong_penalty_matches_dapo_formula():
    max_length, cache, factor = 20, 4, 0.5
    lengths = np.arange(0, 25)

    def dapo(n):  # DAPO Eq. 13, term by term
        if n <= max_length - cache:
            return 0.0
        if n <= max_length:
            return (max_length - cache - n) / cache
        return -1.0

    want = factor * np.array([dapo(n) for n in lengths])
    got = jax.jit(lambda x: algo.soft_overlong_penalty(x, max_length=max_length, cache_length=cache,
                                                       factor=factor))(lengths)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert want[17] == -0.125 and want[20] == -0.5 and want[16] == 0.0
    with pytest.raises(ValueError, match="cache_length must be in"):
        algo.soft_overlong_penalty(lengths, max_length=4, cache_length=8)
    with pytest.raises(TypeError, match="lengths must be an integer or floating-point"):
        algo.soft_overlong_penalty(lengths > 3, max_length=20, cache_length=4)
    with pytest.raises(ValueError, match="num_answer_pairs must have the shape of num_answer_opens"):
        algo.answer_format_penalty_release(np.ones(2), np.ones(2), np.ones(3), np.ones(3))
