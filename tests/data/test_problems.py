"""Problem loading (skips counted by reason) and the resumable problem iterator."""

import json

import datasets
import pytest

from rstar2jax.data.problems import Problem, ProblemIterator, load_problems
from rstar2jax.eval import EVAL_SETS_DIR

ROWS = [
    {"id": "a", "problem": "1+1?", "answer": "2", "level": 1},
    {"id": "b", "problem": "half?", "answer": "\\frac12"},
    {"id": "c", "problem": "no answer"},
    {"id": "d", "problem": "empty answer", "answer": "   "},
    {"id": "e", "answer": "5"},
    {"id": "a", "problem": "dup", "answer": "3"},
    {"id": "f", "question": "int answer?", "answer": 7},
    {"id": "g", "problem": "bool answer", "answer": True},
    {"problem": "no id", "answer": "1,000"},
]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_jsonl_skips_and_counts(tmp_path):
    loaded = load_problems(_write_jsonl(tmp_path / "p.jsonl", ROWS))
    assert [p.id for p in loaded.problems] == ["a", "b", "f", "8"]
    assert loaded.problems[0] == Problem(id="a", problem="1+1?", answer="2", metadata={"level": 1})
    assert loaded.problems[2].problem == "int answer?" and loaded.problems[2].answer == "7"
    assert dict(loaded.skipped) == {"missing answer": 3, "missing problem": 1, "duplicate id": 1}
    assert loaded.num_skipped == 5 and len(loaded) == 4


def test_integer_only_and_limit(tmp_path):
    path = _write_jsonl(tmp_path / "p.jsonl", ROWS)
    loaded = load_problems(path, integer_answers=True)
    assert [p.answer for p in loaded.problems] == ["2", "7", "1,000"]
    assert loaded.skipped["non-integer answer"] == 1
    assert [p.id for p in load_problems(path, limit=2).problems] == ["a", "b"]


def test_named_fields_json_and_datasets_folder(tmp_path):
    rows = [{"key": 1, "q": "x?", "gt": "4"}, {"key": 2, "q": "y?", "gt": None}]
    json_path = tmp_path / "p.json"
    json_path.write_text(json.dumps(rows))
    kwargs = dict(problem_field="q", answer_field="gt", id_field="key")
    from_json = load_problems(json_path, **kwargs)
    assert [(p.id, p.problem, p.answer) for p in from_json.problems] == [("1", "x?", "4")]
    assert from_json.skipped["missing answer"] == 1

    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "ds"))
    assert load_problems(tmp_path / "ds", **kwargs).problems == from_json.problems
    parquet = tmp_path / "p.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(parquet))
    assert load_problems(parquet, **kwargs).problems == from_json.problems


def test_real_bundled_sets():
    aime = load_problems(EVAL_SETS_DIR / "aime24.jsonl", integer_answers=True)
    assert len(aime) == 30 and aime.num_skipped == 0
    math500 = load_problems(EVAL_SETS_DIR / "math500.jsonl")
    assert len(math500) == 500 and math500.problems[0].metadata["level"] == 2


def test_bad_input_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "ok", "answer": "1"}\n{not json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        load_problems(bad)
    with pytest.raises(ValueError, match="unsupported problem file type"):
        load_problems(_write_jsonl(tmp_path / "p.txt", ROWS))
    with pytest.raises(ValueError, match="mapping"):
        load_problems([["not", "a", "dict"]])


def test_iterator_covers_epochs_and_resumes():
    problems = [Problem(id=str(i), problem=f"p{i}", answer=str(i)) for i in range(5)]
    it = ProblemIterator(problems, batch_size=3, seed=7)
    batches = [[p.id for p in next(it)] for _ in range(4)]  # 12 problems: 2 full epochs + 2
    first_two_epochs = sum(batches, [])[:10]
    assert sorted(first_two_epochs[:5]) == sorted(first_two_epochs[5:]) == [str(i) for i in range(5)]
    assert first_two_epochs[:5] != first_two_epochs[5:10]  # reshuffled per epoch (fixed seed)

    resumed = ProblemIterator(problems, batch_size=3, seed=7, position=6)
    assert [[p.id for p in next(resumed)] for _ in range(2)] == batches[2:]
    assert resumed.position == it.position == 12
    with pytest.raises(ValueError, match="batch_size"):
        ProblemIterator(problems, batch_size=0)
