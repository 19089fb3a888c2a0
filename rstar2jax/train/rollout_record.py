"""The rollouts on the record: per trained RL step, ``<workdir>/rollouts/step_XXXXXX.jsonl``, one JSON line
per recorded group (the format: ``docs/async.md``), the same rows as ``step_XXXXXX.parquet`` where pyarrow is
installed (``datasets`` brings it), and a few samples as TensorBoard text.

Which groups: ``logging.rollout_record`` (a fraction; None: ``auto_fraction``), drawn by a hash of the step
and the problem id, so a resumed run records the same ones. A resumed run rewrites from its checkpoint: the
files of steps after it (a killed attempt's) are removed, as the metrics JSONL is rewritten.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import pathlib
import zlib
from collections.abc import Callable, Sequence

from rstar2jax.data.problems import Problem
from rstar2jax.data.trajectory import Trajectory, trajectory_to_dict

#: The record's folder inside the run folder, and its format (``format`` on every line).
ROLLOUTS_DIR = "rollouts"
RECORD_FORMAT = 1
#: ``auto_fraction`` records every group while a step samples at most this many rollouts.
AUTO_ROLLOUTS = 64
#: Samples per step shown as TensorBoard text.
SHOWN_SAMPLES = 2


def step_file(folder: pathlib.Path, step: int) -> pathlib.Path:
    return folder / f"step_{step:06d}.jsonl"


def auto_fraction(groups_per_step: int, samples_per_group: int) -> float:
    """Every group of a small run's steps; about ``AUTO_ROLLOUTS`` rollouts' worth of a large one's."""
    return min(1.0, AUTO_ROLLOUTS / max(groups_per_step * samples_per_group, 1))


@dataclasses.dataclass(frozen=True)
class StepRollouts:
    """What one RL step trained: ``step`` (the update's number; it ran with policy version ``step - 1``), the
    groups' problems, the groups, each group's release version (its tokens are at least that new) and, per
    group, the indices of the trajectories RoC kept."""

    step: int
    problems: Sequence[Problem]
    groups: Sequence[Sequence[Trajectory]]
    release_versions: Sequence[int]
    kept: Sequence[set[int]]


class RolloutRecord:
    """Writes ``StepRollouts`` under ``<workdir>/rollouts``.

    Args:
      workdir: the run folder.
      fraction: of each step's groups, the share recorded (0: nothing is written).
      resumed_at: the step the run resumes from: the files of later steps are removed.
      decode: token ids -> text, for samples whose rollout kept no ``text`` (None: left None).
      show: ``(tag, text, step)`` -> a TensorBoard text entry (None: none).
      enabled: False on the processes other than 0.
      parquet: also write each step's rows as parquet (default: where pyarrow is installed).
    """

    def __init__(self, workdir: str | os.PathLike, *, fraction: float, resumed_at: int = 0,
                 decode: Callable[[list[int]], str] | None = None,
                 show: Callable[[str, str, int], None] | None = None, enabled: bool = True,
                 parquet: bool | None = None):
        if not 0.0 <= fraction <= 1.0:
            raise ValueError(f"rollout record fraction {fraction} is not in [0, 1]")
        self.folder = pathlib.Path(workdir) / ROLLOUTS_DIR
        self.fraction, self.decode, self.show = fraction, decode, show
        self.enabled = enabled and fraction > 0
        self.parquet = importlib.util.find_spec("pyarrow") is not None if parquet is None else parquet
        if self.enabled and self.folder.exists():
            for path in self.folder.glob("step_*.*"):
                if int(path.name[len("step_"):].split(".")[0]) > resumed_at:
                    path.unlink()

    def chosen(self, step: int, problem_id: str) -> bool:
        """Whether the group of ``problem_id`` at ``step`` is recorded (the same on every attempt)."""
        if self.fraction >= 1.0:
            return True
        return zlib.crc32(f"{step}:{problem_id}".encode()) / 2**32 < self.fraction

    def lines(self, rollouts: StepRollouts) -> list[dict]:
        """The record's lines of ``rollouts`` (its chosen groups)."""
        out = []
        for problem, group, release, kept in zip(rollouts.problems, rollouts.groups,
                                                 rollouts.release_versions, rollouts.kept, strict=True):
            if not self.chosen(rollouts.step, problem.id):
                continue
            samples = []
            for i, t in enumerate(group):
                sample = {**trajectory_to_dict(t), "roc_kept": i in kept}
                if sample["text"] is None and self.decode is not None:  # the rollout kept no text
                    sample["text"] = self.decode(t.response_ids)
                samples.append(sample)
            out.append({"format": RECORD_FORMAT, "step": rollouts.step, "problem_id": problem.id,
                        "release_version": release, "trained_version": rollouts.step - 1,
                        "samples": samples})
        return out

    def write(self, rollouts: StepRollouts) -> int:
        """Writes the step's file (whole, or not at all: written beside and renamed); returns its bytes."""
        if not self.enabled:
            return 0
        lines = self.lines(rollouts)
        self.folder.mkdir(parents=True, exist_ok=True)
        path = step_file(self.folder, rollouts.step)
        partial = path.with_suffix(".jsonl.tmp")
        text = "".join(json.dumps(line) + "\n" for line in lines)
        partial.write_text(text, encoding="utf-8")
        partial.replace(path)
        if self.parquet and lines:
            _write_parquet(lines, path.with_suffix(".parquet"))
        if self.show is not None:
            for line in lines[:SHOWN_SAMPLES]:
                sample = line["samples"][0] if line["samples"] else None
                if sample is not None:
                    shown = sample["text"] if sample["text"] is not None else str(sample["response_ids"])
                    self.show(f"rollouts/{line['problem_id']}", f"reward {sample['reward']}: {shown}",
                              rollouts.step)
        return len(text.encode())


def parquet_row(value):
    """``value`` as parquet holds it: an empty mapping (e.g. no ``timings``) is null (parquet has no empty
    struct)."""
    if isinstance(value, dict):
        return {k: parquet_row(v) for k, v in value.items()} if value else None
    if isinstance(value, list):
        return [parquet_row(v) for v in value]
    return value


def _write_parquet(lines: list[dict], path: pathlib.Path) -> None:
    """``lines`` as one parquet table (one row per group, samples a list of structs), written beside and
    renamed into place."""
    import pyarrow
    import pyarrow.parquet

    partial = path.with_suffix(".parquet.tmp")
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist([parquet_row(line) for line in lines]), partial)
    partial.replace(path)
