"""pass@1 and unbiased pass@k against a brute force over every k-subset of the samples."""

import itertools

import jax
import numpy as np
import pytest

from rstar2jax.eval import pass_at_1, pass_at_k


def brute_force_pass_at_k(correct: np.ndarray, k: int) -> float:
    """Mean over problems of the share of k-subsets of the samples holding at least one correct one."""
    per_problem = []
    for row in correct:
        subsets = list(itertools.combinations(range(len(row)), k))
        per_problem.append(np.mean([any(row[i] for i in subset) for subset in subsets]))
    return float(np.mean(per_problem))


@pytest.mark.parametrize("n", [1, 4, 7, 10])
def test_pass_at_k_matches_brute_force(n):
    rng = np.random.default_rng(n)
    correct = rng.random((12, n)) < rng.random((12, 1))  # per-problem success rates, incl. all / none
    correct[0], correct[1] = True, False
    for k in range(1, n + 1):
        np.testing.assert_allclose(float(pass_at_k(correct, k)), brute_force_pass_at_k(correct, k), rtol=1e-5)
    np.testing.assert_allclose(float(pass_at_1(correct)), brute_force_pass_at_k(correct, 1), rtol=1e-6)


def test_values_types_and_jit():
    correct = np.array([[1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 1]])
    assert float(pass_at_1(correct)) == pytest.approx(0.5)
    # Row 0: 1 - C(2,2)/C(4,2) = 5/6; row 1: 0; row 2: 1.
    assert float(pass_at_k(correct, 2)) == pytest.approx((5 / 6 + 0 + 1) / 3, rel=1e-6)
    assert float(pass_at_k(correct.astype(bool), 2)) == float(pass_at_k(correct.astype(np.float32), 2))
    jitted = jax.jit(pass_at_k, static_argnums=1)
    assert float(jitted(correct, 3)) == pytest.approx(float(pass_at_k(correct, 3)))
    assert float(jax.jit(pass_at_1)(correct)) == pytest.approx(0.5)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="num_problems, num_samples"):
        pass_at_1(np.ones(4))
    with pytest.raises(ValueError, match="num_problems, num_samples"):
        pass_at_k(np.ones((0, 4)), 1)
    with pytest.raises(ValueError, match=r"k must be an int in \[1, num_samples=4\]"):
        pass_at_k(np.ones((2, 4)), 5)
    with pytest.raises(ValueError, match="k must be an int"):
        pass_at_k(np.ones((2, 4)), 0)
    with pytest.raises(TypeError, match="bool or numeric"):
        pass_at_1(np.array([["a", "b"]]))
