"""Sample records, their summary (avg@k, pass@k, maj@k, tool use) and the resumable samples.jsonl."""

import json
import math

import pytest

from rstar2jax.data.problems import Problem
from rstar2jax.data.trajectory import Trajectory
from rstar2jax.eval.samples import SampleLog, finish_reason, majority_correct, sample_record, summarize


def record(dataset, problem, sample, correct, answer, calls=0, failed=0, reason="stop", tokens=10):
    return {
        "dataset": dataset,
        "problem_index": problem,
        "problem_id": str(problem),
        "sample_index": sample,
        "problem": "p",
        "gold": "g",
        "response": "r",
        "answer": answer,
        "correct": correct,
        "tool_calls": calls,
        "failed_tool_calls": failed,
        "tool_outcomes": [],
        "turns": 1,
        "response_tokens": tokens,
        "finish_reason": reason,
    }


@pytest.mark.parametrize(
    "answers, correct, expected",
    [
        (["1", "2", "2"], [True, False, False], False),  # the majority is wrong
        (["2", "1", "1"], [False, True, True], True),
        (["1", "2"], [True, False], True),  # a tie goes to the answer seen first
        (["2", "1"], [False, True], False),
        ([None, None, "3"], [False, False, True], True),  # no answer never votes
        ([None, None], [False, False], False),
        ([" 5 ", "5", "6"], [True, True, False], True),  # surrounding spaces do not split a vote
    ],
)
def test_majority_vote(answers, correct, expected):
    assert majority_correct(answers, correct) is expected


def test_summary_metrics():
    records = [
        # problem 0: 1 of 2 correct; answers 7 (right) and 8 (wrong): a tie, 7 first -> maj correct
        record("a", 0, 0, True, "7", calls=2, failed=1),
        record("a", 0, 1, False, "8", reason="length"),
        # problem 1: none correct
        record("a", 1, 0, False, "1", calls=1),
        record("a", 1, 1, False, "1", tokens=30),
        # problem 2 has one sample only: unfinished, left out
        record("a", 2, 0, True, "3"),
        record("b", 0, 1, True, "5"),
        record("b", 0, 0, True, "5"),
    ]
    summary = summarize(records, k=2)
    a = summary["a"]
    assert a["avg@2"] == pytest.approx(0.25) and a["pass@2"] == pytest.approx(0.5) and a["maj@2"] == 0.5
    assert a["num_problems"] == 2 and a["k"] == 2
    assert a["response_tokens"] == pytest.approx(15.0) and a["tool_calls_per_sample"] == pytest.approx(0.75)
    assert a["tool_error_ratio"] == pytest.approx(1 / 3) and a["tool_error_ratio_correct"] == pytest.approx(
        0.5
    )
    assert a["truncation_rate"] == pytest.approx(0.25)
    assert summary["b"]["avg@2"] == 1.0 and math.isnan(summary["b"]["tool_error_ratio"])


def test_sample_record_from_a_trajectory():
    t = Trajectory(
        "q",
        [1],
        [5, 6, 7],
        [1, 0, 1],
        [-0.1, 0.0, -0.2],
        tool_outcomes=["ok", "error"],
        num_turns=3,
        truncated=True,
        answer="9",
        reward=0.0,
    )
    r = sample_record("ds", 4, 2, Problem("q", "What?", "9"), t, "text", max_turns=3)
    assert r["finish_reason"] == "max_turns" and r["correct"] is False
    assert (r["tool_calls"], r["failed_tool_calls"], r["response_tokens"], r["turns"]) == (2, 1, 3, 3)
    assert finish_reason(t, max_turns=10) == "length"
    assert finish_reason(Trajectory("q", [1], [2], [1], [0.0]), max_turns=10) == "stop"


def test_sample_log_resumes_without_duplicates(tmp_path):
    path = tmp_path / "samples.jsonl"
    log = SampleLog(path)
    log.append([record("a", 0, 0, True, "1"), record("a", 0, 1, True, "1")])
    with pytest.raises(ValueError, match="already"):
        log.append([record("a", 0, 1, True, "1")])
    with path.open("a") as f:  # a run killed in the middle of a write
        f.write(json.dumps(record("a", 1, 0, True, "1"))[:20])
    again = SampleLog(path)
    assert len(again.records) == 2 and again.done("a", 0, 2) and not again.done("a", 1, 2)
    assert again.missing("a", 1, 2) == [0, 1] and again.missing("a", 0, 3) == [2]
    again.append([record("a", 1, 0, False, "2"), record("a", 1, 1, False, "2")])
    lines = path.read_text().splitlines()
    assert len(lines) == 4 and all(json.loads(line) for line in lines)


def test_sample_log_rejects_a_foreign_file(tmp_path):
    path = tmp_path / "samples.jsonl"
    path.write_text('{"x": 1}\n')
    with pytest.raises(ValueError, match="not a sample record"):
        SampleLog(path)
