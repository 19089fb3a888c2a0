"""The rollout record: one JSON line per recorded group with its samples' declared records, the same groups
on every attempt at a fraction, a resumed run's later steps removed, a few samples as TensorBoard text."""

import json

import pytest

from rstar2jax.data.problems import Problem
from rstar2jax.data.trajectory import Trajectory
from rstar2jax.train.rollout_record import RolloutRecord, StepRollouts, auto_fraction, parquet_row, step_file

PROBLEMS = [Problem(f"p{i}", "q", "1") for i in range(40)]


def _step(step: int, problems=PROBLEMS[:2]) -> StepRollouts:
    groups = [[Trajectory(p.id, [3], [4, 5, 6], [1, 0, 1], [-0.5, 0.0, -2.0], ["error"], 2, reward=float(i),
                          policy_versions=[step - 2, -1, step - 1]) for i in range(2)] for p in problems]
    return StepRollouts(step, problems, groups, [step - 2] * len(problems), [{1}] * len(problems))


def test_each_group_is_one_line_with_its_samples_and_what_roc_kept(tmp_path):
    shown = []
    record = RolloutRecord(tmp_path, fraction=1.0, decode=lambda ids: " ".join(map(str, ids)),
                           show=lambda *entry: shown.append(entry))
    size = record.write(_step(3))
    path = step_file(tmp_path / "rollouts", 3)
    assert size == path.stat().st_size > 0
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["problem_id"], r["step"], r["release_version"], r["trained_version"]) for r in lines] == [
        ("p0", 3, 1, 2), ("p1", 3, 1, 2)]
    sample = lines[0]["samples"][1]
    assert sample["roc_kept"] and not lines[0]["samples"][0]["roc_kept"]
    assert sample["text"] == "4 5 6" and sample["policy_versions"] == [1, -1, 2]
    assert sample["logprobs"] == [-0.5, 0.0, -2.0] and sample["tool_outcomes"] == ["error"]
    assert shown == [("rollouts/p0", "reward 0.0: 4 5 6", 3), ("rollouts/p1", "reward 0.0: 4 5 6", 3)]


def test_a_fraction_records_the_same_groups_on_every_attempt_and_a_resume_drops_later_steps(tmp_path):
    first = RolloutRecord(tmp_path, fraction=0.25, parquet=False)
    for step in (1, 2, 3):
        first.write(_step(step, PROBLEMS))
    lines = step_file(tmp_path / "rollouts", 2).read_text().splitlines()
    ids = [json.loads(line)["problem_id"] for line in lines]
    assert 0 < len(ids) < len(PROBLEMS)
    again = RolloutRecord(tmp_path, fraction=0.25, resumed_at=2)
    kept = sorted(p.name for p in (tmp_path / "rollouts").iterdir())
    assert kept == ["step_000001.jsonl", "step_000002.jsonl"]
    assert [p.id for p in PROBLEMS if again.chosen(2, p.id)] == ids
    assert RolloutRecord(tmp_path / "off", fraction=0.0).write(_step(1)) == 0
    assert not (tmp_path / "off").exists()
    with pytest.raises(ValueError, match="not in"):
        RolloutRecord(tmp_path, fraction=2.0)


def test_auto_records_every_group_of_a_small_run_and_about_64_rollouts_of_a_large_one():
    assert auto_fraction(3, 4) == 1.0 and auto_fraction(64, 16) == 64 / 1024


def test_parquet_holds_the_same_rows_as_the_jsonl(tmp_path):
    pyarrow_parquet = pytest.importorskip("pyarrow.parquet")
    record = RolloutRecord(tmp_path, fraction=1.0, parquet=True)
    record.write(_step(2))
    path = step_file(tmp_path / "rollouts", 2)
    rows = pyarrow_parquet.read_table(path.with_suffix(".parquet")).to_pylist()
    assert rows == [parquet_row(json.loads(line)) for line in path.read_text().splitlines()]
    assert rows[0]["samples"][1]["logprobs"] == [-0.5, 0.0, -2.0] and rows[0]["samples"][0]["timings"] is None
    RolloutRecord(tmp_path, fraction=1.0, resumed_at=1)
    assert not any((tmp_path / "rollouts").iterdir())
