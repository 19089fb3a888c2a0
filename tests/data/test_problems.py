"""Problem loading (every source and row format; rejections counted by reason and shown) and the resumable
problem iterator."""

import json
import logging

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
    loaded = load_problems(path, integer_only=True)
    assert [p.answer for p in loaded.problems] == ["2", "7", "1,000"]
    assert loaded.skipped["non-integer answer"] == 1
    assert "p.jsonl: kept 3 rows, rejected 6 (3 missing answer, " in loaded.report()
    assert "1 non-integer answer" in loaded.report()
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
    aime = load_problems(EVAL_SETS_DIR / "aime24.jsonl", integer_only=True)
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


def test_math_style_answer_from_last_boxed_solution(tmp_path, caplog):
    rows = [
        {
            "problem": "p1",
            "solution": "So $x=\\boxed{3}$, not \\boxed{4}? No: \\boxed{\\frac{1}{2}}.",
            "level": 5,
        },
        {"problem": "p2", "solution": "no box here"},
        {"problem": "p3", "solution": "\\boxed{7}", "answer": "8"},  # an answer field wins over the solution
    ]
    loaded = load_problems(_write_jsonl(tmp_path / "math.jsonl", rows))
    assert [(p.problem, p.answer) for p in loaded.problems] == [("p1", "\\frac{1}{2}"), ("p3", "8")]
    assert loaded.problems[0].metadata == {"solution": rows[0]["solution"], "level": 5}
    assert dict(loaded.skipped) == {"no \\boxed{} in solution": 1}
    assert loaded.examples == [(1, "no \\boxed{} in solution", json.dumps(rows[1]))]
    (record,) = [r for r in caplog.records if r.name == "rstar2jax.data.problems"]
    assert record.levelno == logging.WARNING
    assert "math.jsonl: kept 2 rows, rejected 1 (1 no \\boxed{} in solution)" in record.getMessage()
    assert 'row 1 (no \\boxed{} in solution): {"problem": "p2"' in record.getMessage()
    caplog.clear()
    named = load_problems(
        [{"q": "x", "worked": "\\boxed{9}"}], problem_field="q", solution_field="worked", report=False
    )
    assert named.problems[0].answer == "9"
    assert caplog.records == []  # report=False: nothing logged


def test_verl_dapo_rows_and_datasets_objects(caplog):
    rows = [
        {
            "data_source": "math_dapo",
            "prompt": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": "What is 6*7?"},
            ],
            "reward_model": {"ground_truth": "42", "style": "rule"},
            "extra_info": {"index": "dapo-0"},
        },
        {
            "data_source": "math_dapo",
            "prompt": [{"role": "system", "content": "no user turn"}],
            "reward_model": {"ground_truth": "1", "style": "rule"},
            "extra_info": {"index": "dapo-1"},
        },
    ]
    expected = [
        Problem(id="dapo-0", problem="What is 6*7?", answer="42", metadata={"data_source": "math_dapo"})
    ]
    loaded = load_problems(rows, report=False)
    assert loaded.problems == expected and dict(loaded.skipped) == {"missing problem": 1}
    assert caplog.records == []  # rows were rejected, but report=False
    dataset = datasets.Dataset.from_list(rows)
    assert load_problems(dataset, report=False).problems == expected
    splits = datasets.DatasetDict(train=dataset, test=dataset.select([0]))
    assert load_problems(splits, split="test").problems == expected
    with pytest.raises(ValueError, match=r"no split 'validation' \(splits: \['test', 'train'\]\)"):
        load_problems(splits, split="validation")
    renamed = load_problems(
        [{"body": "b", "meta": {"gold": 5}}], problem_field="body", answer_field="meta.gold"
    )
    assert [(p.id, p.problem, p.answer) for p in renamed.problems] == [("0", "b", "5")]


def test_missing_local_path_fails_without_the_hub(tmp_path, monkeypatch):
    def no_hub(*args, **kwargs):
        raise AssertionError(f"the hub was asked for {args}")

    monkeypatch.setattr(datasets, "load_dataset", no_hub)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    for missing in (
        "nope.jsonl",
        "data/rl.parquet",
        "data/rl_set",
        "./rl_set",
        str(tmp_path / "x" / "y"),
        "a/b/c",
    ):
        with pytest.raises(FileNotFoundError, match="does not exist"):
            load_problems(missing)


def test_hub_names_go_to_the_hub(monkeypatch):
    calls = []

    def fake_hub(name, split):
        calls.append((name, split))
        if name == "org/broken":
            raise ConnectionError("offline\nmore detail")
        return [{"problem": "hub?", "answer": "1"}]

    monkeypatch.setattr(datasets, "load_dataset", fake_hub)
    assert load_problems("org/math_set", split="test").problems[0].problem == "hub?"
    assert calls == [("org/math_set", "test")]
    with pytest.raises(
        FileNotFoundError, match=r"'org/broken' is not a local file or folder.*ConnectionError: offline\)$"
    ):
        load_problems("org/broken")


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
