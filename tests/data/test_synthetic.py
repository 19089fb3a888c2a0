"""The synthetic task: deterministic, disjoint splits, answers that the reference code really prints."""

import collections
import contextlib
import io

import pytest

from rstar2jax.data.problems import Problem
from rstar2jax.data.synthetic import DIFFICULTIES, FAMILIES, SyntheticTask, is_heldout, make_task


def _run(code: str) -> str:
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        exec(code, {})
    return stdout.getvalue()


def test_same_seed_same_task_other_seed_other_task():
    task = make_task(30, 10, seed=3, difficulty=(1, 2))
    assert task == make_task(30, 10, seed=3, difficulty=(1, 2))
    other = make_task(30, 10, seed=4, difficulty=(1, 2))
    assert {p.id for p in task.train} != {p.id for p in other.train}
    # Separate streams per split: the held-out split does not depend on the train size.
    assert make_task(5, 10, seed=3, difficulty=(1, 2)).eval == task.eval


def test_splits_are_disjoint_even_across_seeds():
    tasks = [make_task(200, 50, seed=seed) for seed in range(3)]
    all_train = {p.id for t in tasks for p in t.train}
    all_eval = {p.id for t in tasks for p in t.eval}
    assert not all_train & all_eval
    assert not {p.problem for t in tasks for p in t.train} & {p.problem for t in tasks for p in t.eval}
    for task in tasks:
        assert len({p.id for p in task.train}) == 200 and len({p.id for p in task.eval}) == 50
        assert not any(is_heldout(p.id) for p in task.train) and all(is_heldout(p.id) for p in task.eval)


def test_families_and_difficulties_are_balanced_and_recorded():
    task = make_task(60, 20, seed=0, difficulty=(1, 2))
    counts = collections.Counter((p.family, p.difficulty) for p in task.train)
    assert set(counts) == {(f, d) for f in FAMILIES for d in (1, 2)} and set(counts.values()) == {3}
    only = make_task(6, 0, seed=0, families=["gcd", "modpow"], difficulty=3)
    assert {p.family for p in only.train} == {"gcd", "modpow"} and {p.difficulty for p in only.train} == {3}


@pytest.mark.parametrize("difficulty", DIFFICULTIES)
def test_reference_solutions_print_the_answers(difficulty):
    # Level 3 runs brute-force loops up to 1e6: one problem per family there, more at the cheap levels.
    num = {1: 60, 2: 30, 3: 10}[difficulty]
    task = make_task(num, num // 2, seed=11, difficulty=difficulty)
    for problem in task.train + task.eval:
        assert problem.answer.lstrip("-").isdigit(), problem
        assert len(problem.problem) < 120, problem.problem  # short prompts for tiny models
        assert _run(problem.solution) == problem.answer + "\n", problem


def test_as_problem_keeps_the_metadata():
    problem = make_task(1, 0, seed=0).train[0]
    converted = problem.as_problem()
    assert isinstance(converted, Problem)
    assert (converted.id, converted.problem, converted.answer) == (
        problem.id,
        problem.problem,
        problem.answer,
    )
    assert converted.metadata == {
        "family": problem.family,
        "difficulty": problem.difficulty,
        "solution": problem.solution,
    }


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="unknown or no families"):
        make_task(1, 1, families=["modpow", "sudoku"])
    with pytest.raises(ValueError, match="difficulty must be one of"):
        make_task(1, 1, difficulty=4)
    with pytest.raises(ValueError, match=">= 0"):
        make_task(-1, 1)
    # digit_sum_power at difficulty 1 has 19 * 90 parameter pairs, a fifth of them held out.
    with pytest.raises(ValueError, match="too few distinct problems"):
        make_task(0, 400, families=["digit_sum_power"])
    assert isinstance(make_task(0, 0), SyntheticTask)
