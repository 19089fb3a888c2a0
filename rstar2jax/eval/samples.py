"""Per-sample evaluation records (``samples.jsonl``), their per-dataset summary (avg@k, pass@k, maj@k,
response length, tool use) and resuming a run that was stopped.

One record per sample: ``dataset``, ``problem_index``, ``problem_id``, ``sample_index``, ``problem``,
``gold``, ``response`` (the text after the prompt, tool outputs included), ``answer`` (extracted),
``correct``, ``tool_calls``, ``failed_tool_calls``, ``tool_outcomes``, ``turns``, ``response_tokens`` and
``finish_reason`` (``"stop"``: the model answered; ``"length"``: the token budget ran out; ``"max_turns"``:
the turn limit did).

:class:`SampleLog` appends a problem's k records in one write and, on opening, reads back what a previous
run wrote (dropping a torn last line), so a re-run skips finished problems and never duplicates a line.
"""

from __future__ import annotations

import collections
import json
import math
import os
import pathlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import numpy as np

from rstar2jax.data.problems import Problem
from rstar2jax.data.trajectory import Trajectory, tool_error_ratios
from rstar2jax.eval.pass_at_k import pass_at_1, pass_at_k

#: The keys every sample record has.
SAMPLE_KEYS = (
    "dataset", "problem_index", "problem_id", "sample_index", "problem", "gold", "response", "answer",
    "correct", "tool_calls", "failed_tool_calls", "tool_outcomes", "turns", "response_tokens",
    "finish_reason",
)  # fmt: skip


def finish_reason(trajectory: Trajectory, max_turns: int) -> str:
    """``"stop"`` (answered), ``"max_turns"`` (cut by the turn limit) or ``"length"`` (token budget)."""
    if not trajectory.truncated:
        return "stop"
    return "max_turns" if trajectory.num_turns >= max_turns else "length"


def sample_record(
    dataset: str,
    problem_index: int,
    sample_index: int,
    problem: Problem,
    trajectory: Trajectory,
    response: str,
    *,
    max_turns: int,
) -> dict[str, Any]:
    """The ``samples.jsonl`` record of one scored trajectory (``response``: its decoded response)."""
    return {
        "dataset": dataset,
        "problem_index": problem_index,
        "problem_id": problem.id,
        "sample_index": sample_index,
        "problem": problem.problem,
        "gold": problem.answer,
        "response": response,
        "answer": trajectory.answer,
        "correct": bool(trajectory.reward > 0),
        "tool_calls": trajectory.num_tool_calls,
        "failed_tool_calls": trajectory.num_failed_calls,
        "tool_outcomes": list(trajectory.tool_outcomes),
        "turns": trajectory.num_turns,
        "response_tokens": len(trajectory.response_ids),
        "finish_reason": finish_reason(trajectory, max_turns),
    }


def majority_correct(answers: Sequence[str | None], correct: Sequence[bool]) -> bool:
    """maj@k of one problem: the most frequent extracted answer (None never votes; a tie goes to the
    answer seen first) is correct. Samples with the same answer string share one verdict, so the verdict
    is that of the first sample that gave it. No answer at all counts as wrong."""
    votes = collections.Counter(a.strip() for a in answers if a is not None and a.strip())
    if not votes:
        return False
    best = max(votes.values())
    first = {}
    for index, answer in enumerate(answers):
        if answer is not None and answer.strip():
            first.setdefault(answer.strip(), index)
    winner = min((a for a, v in votes.items() if v == best), key=first.__getitem__)
    return bool(correct[first[winner]])


class _Counts(NamedTuple):
    """What :func:`~rstar2jax.eval.tool_error_ratios` reads of a trajectory, from a record."""

    num_tool_calls: int
    num_failed_calls: int
    reward: float


def summarize(records: Iterable[Mapping[str, Any]], k: int) -> dict[str, dict[str, float]]:
    """Per dataset, over its problems with all ``k`` samples: ``avg@k`` (mean pass@1), ``pass@k``
    (unbiased), ``maj@k``, ``response_tokens`` (mean), ``tool_calls_per_sample``, ``tool_error_ratio``,
    ``tool_error_ratio_correct`` (NaN without calls), ``truncation_rate``, ``num_problems``, ``k``."""
    groups: dict[str, dict[int, dict[int, Mapping]]] = collections.defaultdict(
        lambda: collections.defaultdict(dict)
    )
    for record in records:
        groups[record["dataset"]][record["problem_index"]][record["sample_index"]] = record
    summary = {}
    for dataset, problems in groups.items():
        complete = [
            [problems[p][s] for s in range(k)]
            for p in sorted(problems)
            if all(s in problems[p] for s in range(k))
        ]
        if not complete:
            continue
        flat = [r for group in complete for r in group]
        correct = np.array([[r["correct"] for r in group] for group in complete], dtype=bool)
        counts = [_Counts(r["tool_calls"], r["failed_tool_calls"], float(r["correct"])) for r in flat]
        summary[dataset] = {
            f"avg@{k}": float(pass_at_1(correct)),
            f"pass@{k}": float(pass_at_k(correct, k)),
            f"maj@{k}": float(
                np.mean(
                    [majority_correct([r["answer"] for r in g], [r["correct"] for r in g]) for g in complete]
                )
            ),
            "response_tokens": float(np.mean([r["response_tokens"] for r in flat])),
            "tool_calls_per_sample": float(np.mean([r["tool_calls"] for r in flat])),
            **tool_error_ratios(counts),
            "truncation_rate": float(np.mean([r["finish_reason"] != "stop" for r in flat])),
            "num_problems": len(complete),
            "k": k,
        }
    return summary


def format_summary(summary: Mapping[str, Mapping[str, float]]) -> str:
    """The summary as a markdown table (one row per dataset)."""
    if not summary:
        return "(no dataset has a finished problem)"
    k = next(iter(summary.values()))["k"]
    columns = [
        f"avg@{k}",
        f"pass@{k}",
        f"maj@{k}",
        "response_tokens",
        "tool_calls_per_sample",
        "tool_error_ratio",
        "truncation_rate",
    ]
    lines = ["| dataset | problems | " + " | ".join(columns) + " |", "|---" * (len(columns) + 2) + "|"]
    for dataset, metrics in summary.items():
        cells = ["–" if math.isnan(metrics[c]) else f"{metrics[c]:.3f}" for c in columns]
        lines.append(f"| {dataset} | {metrics['num_problems']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


class SampleLog:
    """``samples.jsonl`` of an evaluation run, appended one problem (k records) at a time.

    Opening an existing file reads its records (a torn last line, from a run killed mid-write, is cut off),
    so :meth:`done` tells which problems a re-run can skip.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = pathlib.Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.records: list[dict[str, Any]] = []
        if self.path.exists():
            data = self.path.read_bytes()
            whole = data[: data.rfind(b"\n") + 1]
            if len(whole) != len(data):
                with self.path.open("r+b") as f:
                    f.truncate(len(whole))
            for number, line in enumerate(whole.decode("utf-8").splitlines(), 1):
                record = json.loads(line)
                missing = [key for key in SAMPLE_KEYS if key not in record]
                if missing:
                    raise ValueError(f"{self.path}:{number}: not a sample record (missing {missing})")
                self.records.append(record)
        self._samples = {(r["dataset"], r["problem_index"], r["sample_index"]) for r in self.records}

    def done(self, dataset: str, problem_index: int, k: int) -> bool:
        """True when the problem has all ``k`` samples."""
        return all((dataset, problem_index, s) in self._samples for s in range(k))

    def missing(self, dataset: str, problem_index: int, k: int) -> list[int]:
        """The sample indices of the problem not written yet."""
        return [s for s in range(k) if (dataset, problem_index, s) not in self._samples]

    def append(self, records: Sequence[Mapping[str, Any]]) -> None:
        """Writes records (one problem's) in one write, flushed to disk; a sample already written is an
        error (never a duplicate line)."""
        keys = [(r["dataset"], r["problem_index"], r["sample_index"]) for r in records]
        again = [key for key in keys if key in self._samples]
        if again or len(set(keys)) != len(keys):
            raise ValueError(f"samples {again or keys} are already in {self.path}")
        with self.path.open("a", encoding="utf-8") as f:
            f.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
            f.flush()
            os.fsync(f.fileno())
        self.records += [dict(r) for r in records]
        self._samples.update(keys)
