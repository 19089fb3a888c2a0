"""Problem sets for RL: load (problem, answer) rows from JSONL / JSON / Parquet files, ``datasets`` folders or
Hugging Face dataset names, and iterate over them in a resumable, seeded order.

Rows without usable text or answer are skipped and counted (never silently dropped, never a crash mid-run):
``load_problems(...)`` returns the problems together with a ``Counter`` of skip reasons.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import pathlib
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

# Field names tried in order when the caller does not name one; the first present non-null value wins.
PROBLEM_FIELDS = ("problem", "question", "prompt")
ANSWER_FIELDS = ("answer", "final_answer", "ground_truth", "gold")
ID_FIELDS = ("id", "unique_id", "problem_id", "uid")

_INTEGER = re.compile(r"[+-]?\d+")


@dataclasses.dataclass(frozen=True)
class Problem:
    """One RL problem: ``id`` groups its rollouts, ``answer`` is the gold answer as a string."""

    id: str
    problem: str
    answer: str
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class ProblemSet:
    """Loaded problems plus the count of skipped rows per reason (e.g. ``{"missing answer": 3}``)."""

    problems: list[Problem]
    skipped: collections.Counter

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    def __len__(self) -> int:
        return len(self.problems)


def _first_present(row: Mapping[str, Any], names: Sequence[str]) -> Any:
    for name in names:
        value = row.get(name)
        if value is not None:
            return value
    return None


def _as_text(value: Any) -> str | None:
    """A usable string from a cell: strings stripped, ints kept; bools, floats, lists... rejected."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | np.integer):
        return str(int(value))
    if isinstance(value, str) and value.strip():
        return value.strip()
    return None


def _read_rows(source: str | os.PathLike, split: str) -> Iterable[Mapping[str, Any]]:
    path = pathlib.Path(source)
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix == ".jsonl":
            with path.open(encoding="utf-8") as f:
                for line_number, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            yield json.loads(line)
                        except json.JSONDecodeError as e:
                            raise ValueError(f"{path}:{line_number}: not valid JSON ({e.msg})") from e
            return
        if suffix == ".json":
            data = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(data, list):
                raise ValueError(f"{path}: a .json problem file must hold a list of objects")
            yield from data
            return
        if suffix == ".parquet":
            import datasets

            yield from datasets.Dataset.from_parquet(str(path))
            return
        raise ValueError(f"{path}: unsupported problem file type {suffix!r} (use .jsonl, .json or .parquet)")
    if path.suffix.lower() in (".jsonl", ".json", ".parquet"):
        raise FileNotFoundError(f"problem file {path} does not exist")

    import datasets

    if path.is_dir() and (path / "dataset_info.json").exists():  # written by Dataset.save_to_disk
        yield from datasets.load_from_disk(str(path))
        return
    if path.is_dir() and (path / "dataset_dict.json").exists():
        yield from datasets.load_from_disk(str(path))[split]
        return
    # A dataset folder of data files or a Hugging Face dataset name (needs the hub or its local cache).
    yield from datasets.load_dataset(str(source), split=split)


def load_problems(
    source: str | os.PathLike | Iterable[Mapping[str, Any]],
    *,
    split: str = "train",
    problem_field: str | None = None,
    answer_field: str | None = None,
    id_field: str | None = None,
    integer_answers: bool = False,
    limit: int | None = None,
) -> ProblemSet:
    """Loads a problem set, skipping and counting rows without a usable problem or answer.

    Args:
      source: a ``.jsonl`` / ``.json`` / ``.parquet`` file, a folder written by ``datasets.save_to_disk``,
        a Hugging Face dataset name or data folder (``datasets.load_dataset``), or an iterable of dict rows.
      split: the split to read from dataset dicts and ``load_dataset``.
      problem_field / answer_field / id_field: the column names; ``None`` tries ``PROBLEM_FIELDS``,
        ``ANSWER_FIELDS`` and ``ID_FIELDS`` in order. Without an id column the row index is the id.
      integer_answers: keep only problems whose answer is an integer (the paper's RL data are integer-only);
        others are counted under ``"non-integer answer"``.
      limit: keep at most this many problems (after skipping).

    Returns:
      ``ProblemSet(problems, skipped)``; reasons are ``missing problem``, ``missing answer``,
      ``non-integer answer`` and ``duplicate id``. Extra columns go to ``Problem.metadata``.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    rows = _read_rows(source, split) if isinstance(source, str | os.PathLike) else source
    problem_names = (problem_field,) if problem_field else PROBLEM_FIELDS
    answer_names = (answer_field,) if answer_field else ANSWER_FIELDS
    id_names = (id_field,) if id_field else ID_FIELDS
    used = {*problem_names, *answer_names, *id_names}

    problems: list[Problem] = []
    seen_ids: set[str] = set()
    skipped: collections.Counter = collections.Counter()
    for index, row in enumerate(rows):
        if limit is not None and len(problems) >= limit:
            break
        if not isinstance(row, Mapping):
            raise ValueError(f"row {index} is a {type(row).__name__}, expected a mapping of fields")
        text = _as_text(_first_present(row, problem_names))
        if text is None:
            skipped["missing problem"] += 1
            continue
        answer = _as_text(_first_present(row, answer_names))
        if answer is None:
            skipped["missing answer"] += 1
            continue
        if integer_answers and not _INTEGER.fullmatch(answer.replace(",", "")):
            skipped["non-integer answer"] += 1
            continue
        row_id = _first_present(row, id_names)
        problem_id = str(row_id) if row_id is not None else str(index)
        if problem_id in seen_ids:
            skipped["duplicate id"] += 1
            continue
        seen_ids.add(problem_id)
        metadata = {k: v for k, v in row.items() if k not in used}
        problems.append(Problem(id=problem_id, problem=text, answer=answer, metadata=metadata))
    return ProblemSet(problems=problems, skipped=skipped)


@dataclasses.dataclass
class ProblemIterator:
    """Endless batches of problems in a seeded order, reshuffled every epoch, resumable from ``position``.

    The order of epoch ``e`` is ``permutation(len(problems))`` under ``numpy.random.default_rng((seed, e))``,
    so the iterator is fully described by ``(seed, position)``: checkpoint ``position`` and pass it back to
    resume at exactly the same batch. A batch may span an epoch boundary.
    """

    problems: Sequence[Problem]
    batch_size: int
    seed: int = 0
    position: int = 0  # problems consumed so far, across epochs

    def __post_init__(self):
        if not self.problems:
            raise ValueError("ProblemIterator needs at least one problem")
        if self.batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {self.batch_size}")
        if self.position < 0:
            raise ValueError(f"position must be >= 0, got {self.position}")

    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng((self.seed, epoch)).permutation(len(self.problems))

    def __iter__(self):
        return self

    def __next__(self) -> list[Problem]:
        n = len(self.problems)
        batch = []
        while len(batch) < self.batch_size:
            epoch, offset = divmod(self.position, n)
            take = min(self.batch_size - len(batch), n - offset)
            batch.extend(self.problems[i] for i in self._order(epoch)[offset : offset + take])
            self.position += take
        return batch
