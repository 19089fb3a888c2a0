"""Problem sets for RL: one entry point, ``load_problems``, for every accepted source and row format, and a
resumable, seeded iterator over the problems.

Sources: a local ``.jsonl`` / ``.json`` / ``.parquet`` file, a folder written by ``datasets.save_to_disk`` or
holding data files, a Hugging Face dataset name (``org/name``), a ``datasets.Dataset`` / ``DatasetDict``, or
any iterable of dict rows. A source that looks like a local path (a file suffix, ``./``, ``/``, ``~``, or a
first folder that exists here) and is missing fails at once; the hub is only asked for names that are not
local paths.

Row formats (the first present field wins; name your own with ``problem_field`` / ``answer_field`` /
``solution_field`` / ``id_field``, dotted names reach into nested fields):

- plain: ``problem`` (or ``question`` / ``prompt``) and ``answer`` (or ``final_answer`` / ``ground_truth`` /
  ``gold``);
- MATH style: ``problem`` and ``solution`` with no answer field: the answer is the solution's last
  ``\\boxed{}`` (the solution stays in ``Problem.metadata``);
- verl / DAPO style: ``prompt`` a chat list (``[{"role": "user", "content": ...}]``: the last user turn is the
  problem) and ``reward_model.ground_truth`` the answer; ``extra_info.index`` the id.

Rows without a usable problem or answer are rejected, counted by reason and the first few shown (on stderr
unless ``report=False``), never dropped silently; ``load_problems`` returns the problems with those counts.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os
import pathlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from rstar2jax.reward.extraction import as_integer, last_boxed

logger = logging.getLogger(__name__)

# Field names tried in order when the caller does not name one; the first present non-null value wins.
PROBLEM_FIELDS = ("problem", "question", "prompt")
ANSWER_FIELDS = ("answer", "final_answer", "ground_truth", "gold", "reward_model.ground_truth")
SOLUTION_FIELDS = ("solution",)
ID_FIELDS = ("id", "unique_id", "problem_id", "uid", "extra_info.index")
#: Local file types ``load_problems`` reads.
FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
#: How many rejected rows ``ProblemSet.report`` shows.
SHOWN_REJECTIONS = 3


@dataclasses.dataclass(frozen=True)
class Problem:
    """One RL problem: ``id`` groups its rollouts, ``answer`` is the gold answer as a string."""

    id: str
    problem: str
    answer: str
    metadata: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The problem as plain JSON data (``metadata`` as loaded: a dataset row's values)."""
        return {"id": self.id, "problem": self.problem, "answer": self.answer,
                "metadata": dict(self.metadata)}

    @classmethod
    def from_dict(cls, record: Mapping[str, Any]) -> Problem:
        """The problem ``to_dict`` wrote."""
        return cls(record["id"], record["problem"], record["answer"], dict(record.get("metadata") or {}))


@dataclasses.dataclass
class ProblemSet:
    """Loaded problems, the count of rejected rows per reason (e.g. ``{"missing answer": 3}``) and the first
    ``SHOWN_REJECTIONS`` rejected rows as ``(row index, reason, row excerpt)``."""

    problems: list[Problem]
    skipped: collections.Counter
    examples: list[tuple[int, str, str]] = dataclasses.field(default_factory=list)
    source: str = ""

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    def __len__(self) -> int:
        return len(self.problems)

    def report(self) -> str:
        """One line of counts plus one line per shown rejected row ('' when nothing was rejected)."""
        if not self.num_skipped:
            return ""
        reasons = ", ".join(f"{n} {reason}" for reason, n in self.skipped.most_common())
        lines = [
            f"{self.source or 'problems'}: kept {len(self.problems)} rows, rejected {self.num_skipped} "
            f"({reasons}); first rejected:"
        ]
        lines += [f"  row {index} ({reason}): {excerpt}" for index, reason, excerpt in self.examples]
        return "\n".join(lines)


def _get(row: Mapping[str, Any], name: str) -> Any:
    """``row[name]``, where a dotted name reaches into nested mappings (``reward_model.ground_truth``)."""
    if name in row:
        return row[name]
    value: Any = row
    for part in name.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return None
        value = value[part]
    return value


def _first_present(row: Mapping[str, Any], names: Sequence[str]) -> Any:
    for name in names:
        value = _get(row, name)
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


def _problem_text(value: Any) -> str | None:
    """A problem cell: text, or a chat list (verl / DAPO ``prompt``) whose last user turn is the problem."""
    if isinstance(value, list | tuple):
        users = [m.get("content") for m in value if isinstance(m, Mapping) and m.get("role") == "user"]
        return _as_text(users[-1]) if users else None
    return _as_text(value)


def _excerpt(row: Any, width: int = 160) -> str:
    try:
        text = json.dumps(row, ensure_ascii=False, default=str)
    except (TypeError, ValueError):
        text = repr(row)
    return text if len(text) <= width else text[: width - 3] + "..."


def looks_local(source: str) -> bool:
    """Whether a missing ``source`` is meant as a local path, not a hub name (``name`` / ``org/name``)."""
    path = pathlib.Path(source).expanduser()
    return (
        source.startswith((".", "/", "~", "\\"))
        or path.suffix.lower() in FILE_SUFFIXES
        or len(path.parts) > 2
        or (len(path.parts) == 2 and pathlib.Path(path.parts[0]).is_dir())
    )


def _read_file(path: pathlib.Path) -> Iterable[Mapping[str, Any]]:
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


def _split_of(dataset_dict: Mapping[str, Any], split: str, where: str) -> Any:
    if split not in dataset_dict:
        raise ValueError(f"{where}: no split {split!r} (splits: {sorted(dataset_dict)})")
    return dataset_dict[split]


def _read_rows(source: str | os.PathLike, split: str) -> Iterable[Mapping[str, Any]]:
    path = pathlib.Path(source).expanduser()
    if path.is_file():
        return _read_file(path)
    if not path.exists():
        if looks_local(str(source)):
            raise FileNotFoundError(f"problem source {str(source)!r} does not exist (no such file or folder)")
        return _read_hub(str(source), split)

    import datasets

    if (path / "dataset_info.json").exists():  # written by Dataset.save_to_disk
        return datasets.load_from_disk(str(path))
    if (path / "dataset_dict.json").exists():
        return _split_of(datasets.load_from_disk(str(path)), split, str(path))
    return datasets.load_dataset(str(path), split=split)  # a folder of data files


def _read_hub(name: str, split: str) -> Iterable[Mapping[str, Any]]:
    import datasets

    try:
        return datasets.load_dataset(name, split=split)
    except Exception as e:  # noqa: BLE001 - any hub failure gets the same one-line explanation
        raise FileNotFoundError(
            f"problem source {name!r} is not a local file or folder, and the Hugging Face hub could not "
            f"load it as a dataset name ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from e


def _rows_of(source: Any, split: str) -> tuple[Iterable[Any], str]:
    if isinstance(source, str | os.PathLike):
        return _read_rows(source, split), str(source)
    if isinstance(source, Mapping):  # a datasets.DatasetDict or a dict of splits
        return _split_of(source, split, "the given dataset dict"), f"split {split!r}"
    if isinstance(source, Iterable):  # a datasets.Dataset or any iterable of rows
        return source, type(source).__name__
    raise TypeError(
        f"load_problems: source is a {type(source).__name__}; expected a path, a dataset name, a "
        "datasets.Dataset or an iterable of dict rows"
    )


@dataclasses.dataclass(frozen=True)
class _Fields:
    """The column names tried, in order, for each part of a problem row (dotted names reach into nested
    fields)."""

    problem: tuple[str, ...]
    answer: tuple[str, ...]
    solution: tuple[str, ...]
    id: tuple[str, ...]

    @classmethod
    def chosen(cls, problem_field, answer_field, solution_field, id_field) -> _Fields:
        """The given names, else the defaults (``PROBLEM_FIELDS``, ...)."""
        return cls(
            (problem_field,) if problem_field else PROBLEM_FIELDS,
            (answer_field,) if answer_field else ANSWER_FIELDS,
            (solution_field,) if solution_field else SOLUTION_FIELDS,
            (id_field,) if id_field else ID_FIELDS,
        )

    @property
    def used(self) -> set[str]:
        """The top-level fields a problem is read from (the others go to ``Problem.metadata``)."""
        return {n.split(".")[0] for n in (*self.problem, *self.answer, *self.id)}


def _problem_of(row: Mapping[str, Any], index: int, fields: _Fields, *, integer_only: bool) -> Problem | str:
    """Row ``index`` as a problem (its id: the id field, else the index), or the reason it is rejected."""
    text = _problem_text(_first_present(row, fields.problem))
    if text is None:
        return "missing problem"
    answer = _as_text(_first_present(row, fields.answer))
    if answer is None:
        solution = _as_text(_first_present(row, fields.solution))
        if solution is None:
            return "missing answer"
        answer = last_boxed(solution)
        if not answer:
            return "no \\boxed{} in solution"
    if integer_only and as_integer(answer) is None:
        return "non-integer answer"
    row_id = _first_present(row, fields.id)
    problem_id = str(row_id) if row_id is not None else str(index)
    metadata = {k: v for k, v in row.items() if k not in fields.used}
    return Problem(id=problem_id, problem=text, answer=answer, metadata=metadata)


def load_problems(
    source: str | os.PathLike | Iterable[Mapping[str, Any]],
    *,
    split: str = "train",
    problem_field: str | None = None,
    answer_field: str | None = None,
    solution_field: str | None = None,
    id_field: str | None = None,
    integer_only: bool = False,
    limit: int | None = None,
    report: bool = True,
) -> ProblemSet:
    """Loads a problem set; rows without a usable problem or answer are rejected and counted.

    Args:
      source: a ``.jsonl`` / ``.json`` / ``.parquet`` file, a ``datasets.save_to_disk`` folder or a folder of
        data files, a Hugging Face dataset name, a ``datasets.Dataset`` / ``DatasetDict``, or an iterable of
        dict rows. A missing local path raises ``FileNotFoundError`` at once (the hub is not asked).
      split: the split to read from dataset dicts and hub datasets.
      problem_field / answer_field / solution_field / id_field: the column names (dotted names reach into
        nested fields); ``None`` tries ``PROBLEM_FIELDS``, ``ANSWER_FIELDS``, ``SOLUTION_FIELDS`` and
        ``ID_FIELDS`` in order. A chat-list problem is its last user turn. Without an answer the answer is
        the solution's last ``\\boxed{}``. Without an id the row index is the id.
      integer_only: keep only problems whose answer is an integer (the paper's RL data are integer-only);
        others are counted under ``"non-integer answer"``.
      limit: keep at most this many problems (after rejections).
      report: log ``ProblemSet.report()`` (counts and the first rejected rows) as a warning when rows were
        rejected.

    Returns:
      ``ProblemSet(problems, skipped, examples, source)``; reasons are ``missing problem``,
      ``missing answer``, ``no \\boxed{} in solution``, ``non-integer answer`` and ``duplicate id``.
      Fields not used go to ``Problem.metadata``.
    """
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    rows, name = _rows_of(source, split)
    fields = _Fields.chosen(problem_field, answer_field, solution_field, id_field)
    loaded = ProblemSet(problems=[], skipped=collections.Counter(), source=name)
    seen_ids: set[str] = set()
    for index, row in enumerate(rows):
        if limit is not None and len(loaded.problems) >= limit:
            break
        if not isinstance(row, Mapping):
            raise ValueError(f"{name}: row {index} is a {type(row).__name__}, expected a mapping of fields")
        problem = _problem_of(row, index, fields, integer_only=integer_only)
        if isinstance(problem, Problem) and problem.id in seen_ids:
            problem = "duplicate id"
        if isinstance(problem, str):
            loaded.skipped[problem] += 1
            if len(loaded.examples) < SHOWN_REJECTIONS:
                loaded.examples.append((index, problem, _excerpt(row)))
            continue
        seen_ids.add(problem.id)
        loaded.problems.append(problem)
    if report and loaded.num_skipped:
        logger.warning("%s", loaded.report())
    return loaded


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
        return self.take(self.batch_size)

    def take(self, count: int) -> list[Problem]:
        """The next ``count`` problems (``next(iterator)`` takes ``batch_size``); 0 takes none."""
        if not isinstance(count, int) or count < 0:
            raise ValueError(f"count must be an int >= 0, got {count!r}")
        n = len(self.problems)
        batch = []
        while len(batch) < count:
            epoch, offset = divmod(self.position, n)
            take = min(count - len(batch), n - offset)
            batch.extend(self.problems[i] for i in self._order(epoch)[offset : offset + take])
            self.position += take
        return batch
