"""The binary reward on every benchmark answer, and the process pool's deadline and recovery."""

import asyncio
import json
import os
import re
import signal
import threading
import time
from fractions import Fraction

import pytest

from rstar2jax.eval import EVAL_SETS_DIR
from rstar2jax.reward import (
    AnswerGrade,
    AnswerVerifier,
    as_integer,
    close_default_verifier,
    default_verifier,
    grade_answer,
    score_answer,
)

PATHOLOGICAL = "9^{9^{9^{9}}}"  # sympy tries to evaluate the tower: math-verify never returns
_SIMPLE_FRACTION = re.compile(r"(-?)\\d?frac\s*(?:\{(\d+)\}|(\d))\s*(?:\{(\d+)\}|(\d))")
_DECIMAL = re.compile(r"-?\d*\.\d+")


def response(answer: str) -> str:
    return f"<reason>Some work.</reason>\n<answer>So the answer is $\\boxed{{{answer}}}$.</answer>"


def equivalent_forms_and_near_misses(gold: str) -> tuple[list[str], list[str]]:
    """Answers a grader must accept for ``gold`` and answers it must reject."""
    integer = as_integer(gold)
    if integer is not None:
        forms = [gold, str(integer), f"x = {integer}", f"{integer}.0", f"\\frac{{{2 * integer}}}{{2}}"]
        if abs(integer) >= 1000:
            forms += [f"{integer:,}", f"{integer:,}".replace(",", "{,}")]
        return forms, [str(integer + 1), str(integer - 1), str(-integer) if integer else "1", f"{integer}.5"]
    if fraction := _SIMPLE_FRACTION.fullmatch(gold):
        sign, numerator, denominator = (
            fraction[1],
            int(fraction[2] or fraction[3]),
            int(fraction[4] or fraction[5]),
        )
        value = Fraction(numerator, denominator) * (-1 if sign else 1)
        forms = [
            gold,
            f"{sign}\\frac{{{numerator}}}{{{denominator}}}",
            f"{sign}\\dfrac{{{numerator}}}{{{denominator}}}",
            f"{sign}{numerator}/{denominator}",
            f"x = {sign}\\frac{{{numerator}}}{{{denominator}}}",
        ]
        if numerator < 10 and denominator < 10:
            forms.append(f"{sign}\\frac{numerator}{denominator}")  # \frac12
        if Fraction(str(float(value))) == value:  # terminating decimal
            forms.append(str(float(value)))
        misses = [
            f"{sign}\\frac{{{numerator + 1}}}{{{denominator}}}",
            f"{sign}\\frac{{{numerator}}}{{{denominator + 1}}}",
            str(round(float(value) + 0.01, 6)),
        ]
        return forms, misses
    if _DECIMAL.fullmatch(gold):
        value = Fraction(gold)
        forms = [gold, f"\\frac{{{value.numerator}}}{{{value.denominator}}}", gold + "0", f"x = {gold}"]
        return forms, [str(float(value) + 0.01), str(float(value) * 10)]
    forms = [gold]
    if "\\dfrac" in gold:
        forms.append(gold.replace("\\dfrac", "\\frac"))
    elif "\\frac" in gold:
        forms.append(gold.replace("\\frac", "\\dfrac"))
    if "\\left" in gold:
        forms.append(gold.replace("\\left", "").replace("\\right", ""))
    # Near miss: change the first digit (the last may be a base subscript or a unit exponent, which
    # math-verify ignores), or add 1 to a digit-free answer.
    first_digit = re.search(r"\d", gold)
    if first_digit:
        changed = str((int(first_digit.group()) + 1) % 10)
        return forms, [gold[: first_digit.start()] + changed + gold[first_digit.end() :]]
    return forms, [gold + " + 1"]


@pytest.fixture(scope="module")
def gold_answers():
    answers = []
    for name in ("aime24", "aime25", "hmmt25", "math500"):
        with open(EVAL_SETS_DIR / f"{name}.jsonl", encoding="utf-8") as f:
            answers += [(name, json.loads(line)["answer"]) for line in f]
    assert len(answers) == 590
    return answers


@pytest.fixture(scope="module")
def verifier():
    # A generous deadline: these comparisons take milliseconds, but the test machine is shared.
    with AnswerVerifier(num_workers=2, timeout_s=60.0) as v:
        yield v


@pytest.fixture(scope="module")
def short_deadline_verifier():
    with AnswerVerifier(num_workers=2, timeout_s=1.0) as v:
        yield v


def test_every_benchmark_answer_in_equivalent_forms_and_near_misses(verifier, gold_answers):
    cases = []
    for source, gold in gold_answers:
        forms, misses = equivalent_forms_and_near_misses(gold)
        cases += [(source, gold, form, True) for form in forms] + [
            (source, gold, miss, False) for miss in misses
        ]

    async def grade_all():
        return await asyncio.gather(*(verifier.grade(response(answer), gold) for _, gold, answer, _ in cases))

    grades = asyncio.run(grade_all())
    wrong = [(case, grade) for case, grade in zip(cases, grades, strict=True) if grade.is_correct != case[3]]
    assert not wrong, f"{len(wrong)} of {len(cases)} graded wrongly, e.g. {wrong[:10]}"
    assert all(grade.extracted_answer == case[2] for case, grade in zip(cases, grades, strict=True))
    # Both paths were exercised: AIME/HMMT integers on the fast path, LaTeX answers through math-verify.
    reasons = {grade.reason for grade in grades}
    assert {"integer match", "math-verify: equivalent", "math-verify: not equivalent"} <= reasons
    assert len(cases) > 5 * len(gold_answers)


@pytest.mark.parametrize(
    "gold, answer, expected",
    [
        ("\\frac12", "0.5", True),
        ("\\frac12", "\\dfrac{1}{2}", True),
        ("0.5", "\\frac{1}{2}", True),
        ("1000", "1,000", True),
        ("58,500", "58500", True),
        ("3", "x = 3", True),
        ("x=5", "5", True),
        ("(a+5)(b+2)", "(b+2)(a+5)", True),
        ("\\frac12", "0.51", False),
        ("3", "x = 4", False),
        ("1000", "1,001", False),
        ("p - q", "q - p", False),
    ],
)
def test_spot_checks(verifier, gold, answer, expected):
    assert verifier.grade_blocking(response(answer), gold).is_correct is expected


def test_pathological_answer_times_out_without_blocking_the_loop(short_deadline_verifier):
    v = short_deadline_verifier
    normal = [
        (response("\\frac{2}{4}"), "\\frac12"),
        (response("0.25"), "\\frac14"),
        (response("2\\pi"), "2\\pi"),
    ]

    async def scenario():
        await asyncio.gather(*(v.grade(text, gold) for text, gold in normal[:2]))  # both workers started
        ticks, finished = 0, []

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        async def graded(name, text, gold):
            grade = await v.grade(text, gold)
            finished.append((name, ticks))
            return grade

        ticking = asyncio.create_task(ticker())
        results = await asyncio.gather(
            graded("hang", response(PATHOLOGICAL), "5"),
            *(graded(f"normal{i}", text, gold) for i, (text, gold) in enumerate(normal)),
        )
        ticking.cancel()
        return results, finished

    pids_before = v.worker_pids
    results, finished = asyncio.run(asyncio.wait_for(scenario(), timeout=120))
    assert results[0] == AnswerGrade(False, PATHOLOGICAL, "math-verify timed out after 1.0 s")
    assert all(grade.is_correct for grade in results[1:])
    # The other worker kept serving while one hung, and the loop kept ticking until the deadline fired.
    assert [name for name, _ in finished][-1] == "hang"
    assert dict(finished)["hang"] >= 2
    # The stuck worker was killed and replaced; the pool still works.
    pids_after = v.worker_pids
    assert len(pids_after) == 2 and len(set(pids_before) - set(pids_after)) == 1
    assert v.grade_blocking(response("\\dfrac{1}{2}"), "0.5").is_correct


def test_a_worker_that_died_idle_is_replaced_without_costing_a_score(short_deadline_verifier):
    v = short_deadline_verifier
    for pid in v.worker_pids:
        os.kill(pid, signal.SIGKILL)
        os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # dead, left for the verifier to reap
    grades = [v.grade_blocking(response("\\frac{3}{6}"), "0.5") for _ in range(3)]
    assert all(grade == AnswerGrade(True, "\\frac{3}{6}", "math-verify: equivalent") for grade in grades)
    assert len(v.worker_pids) == 2


def test_the_whole_pool_killed_mid_comparison_is_replaced_and_verifies_again(caplog):
    """Issue 33: every worker dies while it holds a comparison (stopped first, so the comparisons are
    certainly in flight when the kill comes); the answers are verified again on new workers, not scored 0."""
    with AnswerVerifier(num_workers=2, timeout_s=60.0) as v:
        assert all(v.grade_blocking(response("\\frac{2}{4}"), "0.5") for _ in range(2))  # started
        pids = v.worker_pids
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        grades = {}

        def grade(name, answer, gold):
            grades[name] = v.grade_blocking(response(answer), gold)

        threads = [threading.Thread(target=grade, args=args) for args in
                   [("half", "\\dfrac{3}{6}", "\\frac12"), ("third", "\\frac{1}{3}", "0.25")]]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(t.is_alive() for t in threads):
            time.sleep(0.01)
        time.sleep(0.3)  # both comparisons sent to the stopped workers
        with caplog.at_level("WARNING", logger="rstar2jax.reward.verifier"):
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            for thread in threads:
                thread.join(timeout=120)
        assert grades == {
            "half": AnswerGrade(True, "\\dfrac{3}{6}", "math-verify: equivalent"),
            "third": AnswerGrade(False, "\\frac{1}{3}", "math-verify: not equivalent"),
        }
        died = [r for r in caplog.records if "died during a comparison" in r.getMessage()]
        assert len(died) == 2 and not set(v.worker_pids) & set(pids) and len(v.worker_pids) == 2


def test_sync_api_works_off_the_main_thread():
    """math-verify's own signal timeouts fail outside the main thread; ours must not."""
    results = {}

    def work():
        results["score"] = score_answer(response("\\dfrac{14}{3}"), "\\frac{14}{3}")
        results["grade"] = grade_answer(response("2,025"), 2025)
        results["wrong"] = grade_answer("<answer>\\boxed{\\sqrt{2}}</answer>", "\\sqrt{3}")

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(timeout=120)
    assert results == {
        "score": True,
        "grade": AnswerGrade(True, "2,025", "integer match"),
        "wrong": AnswerGrade(False, "\\sqrt{2}", "math-verify: not equivalent"),
    }


def test_the_default_verifier_once_closed_is_started_afresh_on_next_use():
    """A second run in the same process: closing the process-wide verifier does not break the next user."""
    fraction = response("\\dfrac{14}{3}")  # not an integer: math-verify runs in a worker
    first = default_verifier()
    assert first is default_verifier() and score_answer(fraction, "\\frac{14}{3}")
    close_default_verifier()
    assert first.closed
    second = default_verifier()
    assert second is not first and not second.closed and score_answer(fraction, "\\frac{14}{3}")
    second.close()  # closed by its owner's own close(): the next use starts a fresh one too
    assert score_answer(fraction, "\\frac{14}{3}") and default_verifier() is not second
    close_default_verifier()
    close_default_verifier()  # idempotent, and nothing to close
    with pytest.raises(RuntimeError, match="closed"):
        first.grade_blocking(fraction, "\\frac{14}{3}")


def test_answers_without_a_final_boxed_answer_score_zero(verifier):
    assert verifier.grade_blocking("\\boxed{5}", "5") == AnswerGrade(
        False, None, "no complete <answer>...</answer> block"
    )
    assert verifier.grade_blocking("<answer>5</answer>", "5") == AnswerGrade(
        False, None, "no \\boxed{} in the final <answer> block"
    )
    assert verifier.grade_blocking(response("7"), "8") == AnswerGrade(False, "7", "integer mismatch (7 != 8)")


def test_bad_arguments_and_closed_verifier():
    with pytest.raises(ValueError, match="num_workers must be >= 1"):
        AnswerVerifier(num_workers=0)
    with pytest.raises(ValueError, match="timeouts must be positive"):
        AnswerVerifier(num_workers=1, timeout_s=0)
    v = AnswerVerifier(num_workers=1)
    with pytest.raises(ValueError, match="gold answer is empty"):
        v.grade_blocking(response("1"), " ")
    with pytest.raises(TypeError, match="gold must be a str or int"):
        v.grade_blocking(response("1"), 1.5)
    v.close()
    with pytest.raises(RuntimeError, match="closed"):
        v.grade_blocking(response("\\frac12"), "0.5")
