"""evaluate / aggregate over scripted async rollouts, and eval-set loading."""

import asyncio
import json
import math

import numpy as np
import pytest

from rstar2jax.data.conversation import PromptConfig
from rstar2jax.data.problems import Problem
from rstar2jax.data.trajectory import Trajectory
from rstar2jax.eval import (
    EVAL_DATA_ENV,
    EVAL_SETS,
    EVAL_SETS_DIR,
    EvalProtocol,
    aggregate,
    evaluate,
    evaluate_async,
    evaluate_policy,
    load_eval_set,
    problem_seed,
)

# Per problem, its k = 4 samples: (reward, response length, tool outcomes).
SCRIPT = {
    "p1": [(1.0, 10, ["ok"]), (0.0, 20, ["error", "ok"]), (1.0, 30, ["timeout", "ok"]), (1.0, 40, [])],
    "p2": [(0.0, 5, ["error"]), (0.0, 5, ["parse_error"]), (0.0, 5, []), (0.0, 5, ["ok"])],
    "q1": [(1.0, 8, ["ok", "ok"]), (1.0, 8, ["ok"]), (1.0, 8, ["ok"]), (0.0, 8, ["error"])],
}
PROBLEMS = {"a": [Problem("p1", "x?", "1"), Problem("p2", "y?", "2")], "b": [Problem("q1", "z?", "3")]}


def _trajectory(problem_id, reward, length, outcomes):
    return Trajectory(
        problem_id=problem_id,
        prompt_ids=[1],
        response_ids=[2] * length,
        loss_mask=[1] * length,
        logprobs=[0.0] * length,
        tool_outcomes=list(outcomes),
        reward=reward,
    )


class ScriptedSampler:
    """Async sampler replaying SCRIPT; records how many problems were in flight at once."""

    def __init__(self):
        self.in_flight = self.max_in_flight = 0

    async def __call__(self, problem, k):
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        await asyncio.sleep(0.01)
        self.in_flight -= 1
        return [_trajectory(problem.id, *sample) for sample in SCRIPT[problem.id][:k]]


def test_evaluate_aggregates_per_dataset():
    sampler = ScriptedSampler()
    result = evaluate(PROBLEMS, sampler, 4, pass_ks=[2, 4], max_concurrency=2, progress=False)
    assert sampler.max_in_flight == 2
    a, b = result.datasets["a"], result.datasets["b"]
    assert a.problem_ids == ["p1", "p2"]
    np.testing.assert_array_equal(a.correct, [[1, 0, 1, 1], [0, 0, 0, 0]])
    assert a.metrics["pass@1"] == pytest.approx(3 / 8)
    assert a.metrics["pass@2"] == pytest.approx(0.5)  # p1: every pair holds a correct one; p2: none
    assert a.metrics["pass@4"] == pytest.approx(0.5)
    assert a.metrics["response_length"] == pytest.approx((100 + 20) / 8)
    assert a.metrics["tool_calls_per_traj"] == pytest.approx(8 / 8)
    assert a.metrics["tool_error_ratio"] == pytest.approx(4 / 8)  # error, timeout, error, parse_error
    assert a.metrics["tool_error_ratio_correct"] == pytest.approx(1 / 3)  # p1's correct: ok | timeout, ok
    assert a.metrics["num_problems"] == 2 and a.metrics["truncation_rate"] == 0
    assert b.metrics["pass@1"] == pytest.approx(0.75) and b.metrics["tool_error_ratio_correct"] == 0
    flat = result.metrics("eval")
    assert flat["eval/a/pass@1"] == a.metrics["pass@1"] and flat["eval/b/pass@4"] == 1.0
    assert len(flat) == len(a.metrics) + len(b.metrics)


def test_single_dataset_and_defaults():
    result = evaluate(PROBLEMS["b"], ScriptedSampler(), 2, progress=False)
    assert set(result.datasets) == {"eval"}
    assert set(result.datasets["eval"].metrics) >= {"pass@1", "pass@2", "tool_error_ratio_correct"}
    # No correct trajectory made a call: the ratio is undefined, not 0.
    only_wrong = aggregate(PROBLEMS["a"][1:], [[_trajectory("p2", 0.0, 3, ["error"])]])
    assert math.isnan(only_wrong.metrics["tool_error_ratio_correct"]) and "pass@1" in only_wrong.metrics


def test_bad_samples_are_named():
    async def too_few(problem, k):
        return [_trajectory(problem.id, 1.0, 1, [])] * (k - 1 if problem.id == "p2" else k)

    with pytest.raises(ValueError, match="'p2' has 3 samples; every problem needs k = 4"):
        evaluate(PROBLEMS["a"], too_few, 4, progress=False)

    async def wrong_problem(problem, k):
        return [_trajectory("other", 1.0, 1, [])] * k

    with pytest.raises(ValueError, match=r"include trajectories of \['other'\]"):
        evaluate(PROBLEMS["a"], wrong_problem, 2, progress=False)
    with pytest.raises(ValueError, match="k and max_concurrency"):
        evaluate(PROBLEMS["a"], wrong_problem, 0, progress=False)


def test_evaluate_inside_a_running_loop_points_to_the_async_version():
    async def main():
        with pytest.raises(RuntimeError, match="evaluate_async"):
            evaluate(PROBLEMS["a"], ScriptedSampler(), 1, progress=False)
        return await evaluate_async(PROBLEMS["a"], ScriptedSampler(), 1, progress=False)

    assert asyncio.run(main()).datasets["eval"].metrics["pass@1"] == pytest.approx(0.5)


def test_load_bundled_eval_sets_by_name(tmp_path, monkeypatch):
    sizes = {"aime24": 30, "aime25": 30, "math500": 500, "hmmt25": 30}
    assert set(sizes) == set(EVAL_SETS)
    monkeypatch.delenv(EVAL_DATA_ENV, raising=False)
    for name, size in sizes.items():
        problems = load_eval_set(name)  # the package data in rstar2jax/eval/sets
        assert len(problems) == size and all(p.problem and p.answer for p in problems)
    aime24 = load_eval_set("aime24", limit=3)
    assert [p.id for p in aime24] == ["60", "61", "62"] and aime24[0].answer == "204"
    assert load_eval_set(EVAL_SETS_DIR / "hmmt25.jsonl")[0].answer == "103"
    (tmp_path / "aime24.jsonl").write_text(json.dumps({"id": "m", "problem": "1+1?", "answer": "2"}) + "\n")
    monkeypatch.setenv(EVAL_DATA_ENV, str(tmp_path))  # another folder by environment variable
    assert [p.id for p in load_eval_set("aime24")] == ["m"]


def test_load_a_user_file_and_errors(tmp_path, monkeypatch):
    path = tmp_path / "mine.jsonl"
    path.write_text(json.dumps({"id": "x", "problem": "1+1?", "answer": "2"}) + "\n")
    assert load_eval_set(str(path)) == [Problem("x", "1+1?", "2")]
    with pytest.raises(ValueError, match="neither an existing file nor one of"):
        load_eval_set(tmp_path / "missing.jsonl")
    with pytest.raises(FileNotFoundError, match="not found at"):
        load_eval_set("aime24", data_dir=tmp_path)
    monkeypatch.setenv(EVAL_DATA_ENV, str(tmp_path))
    (tmp_path / "aime25.jsonl").write_text(path.read_text())
    assert load_eval_set("aime25")[0].id == "x"
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps({"problem": "no answer"}) + "\n")
    with pytest.raises(ValueError, match="missing answer"):
        load_eval_set(broken)


def test_the_protocol_defaults_are_the_papers_and_problem_seeds_never_change():
    """16 samples at temperature 0.6, 30 turns, 30K tokens; each problem's seed depends on (seed, dataset,
    index) only, with the values every earlier run used (a resumed run samples what it would have)."""
    protocol = EvalProtocol()
    paper = (protocol.samples, protocol.temperature, protocol.max_turns, protocol.max_tokens)
    assert paper == (16, 0.6, 30, 30_000)
    assert [problem_seed(0, "aime24", 0), problem_seed(0, "aime24", 3), problem_seed(7, "eval", 12)] == [
        2086903601, 3848982155, 1623393656,
    ]
    config = protocol.rollout_config(PromptConfig(), seed=5)
    assert (config.max_response_length, config.max_turns, config.seed) == (30_000, 30, 5)
    assert (config.sampling.temperature, config.sampling.top_p) == (0.6, 1.0)


def test_evaluate_policy_groups_a_batched_rollout_by_problem():
    """The demo's evaluation: one batched call of a trainer-style rollout function, grouped per problem."""
    problems = PROBLEMS["a"]
    calls = []

    def rollout_fn(params, batch, *, samples_per_problem, max_response_length, max_turns, seed):
        ids = [p.id for p in batch]
        calls.append((params, ids, samples_per_problem, max_response_length, max_turns, seed))
        return [_trajectory(i, *SCRIPT[i][s]) for s in range(samples_per_problem) for i in reversed(ids)]

    result = evaluate_policy("params", problems, rollout_fn, samples=4, max_response_length=64, max_turns=3,
                             seed=9)
    assert calls == [("params", ["p1", "p2"], 4, 64, 3, 9)]
    assert result.problem_ids == ["p1", "p2"]
    np.testing.assert_array_equal(result.correct, [[1, 0, 1, 1], [0, 0, 0, 0]])
    assert result.metrics["pass@1"] == pytest.approx(3 / 8)


def test_evaluate_to_files_hands_its_tools_to_every_rollout(tmp_path, monkeypatch):
    import types

    from rstar2jax import engine
    from rstar2jax.agent import multi_turn
    from rstar2jax.data.tokenizer import train_tiny_tokenizer
    from rstar2jax.eval.evaluate import evaluate_to_files
    from tests.agent import plugins

    handed = []

    async def rollout(problems, k, *, tools, **options):
        handed.append(tools)
        return [_trajectory(problems[0].id, *sample) for sample in SCRIPT[problems[0].id][:k]]

    class Idle:  # the engine the rollouts would sample with: nothing to sample here
        def __init__(self, *args, **kwargs):
            pass

        async def __aenter__(self):
            return self

        async def __aexit__(self, *exc_info):
            return None

    monkeypatch.setattr(multi_turn, "rollout_async", rollout)
    monkeypatch.setattr(engine, "Engine", Idle)
    tokenizer = train_tiny_tokenizer(["x?", "y?"], 300, tmp_path / "tokenizer")
    policy = types.SimpleNamespace(params=None, model_config=None, tokenizer=tokenizer, eos_token_ids=(0,),
                                   path="tiny", prompt=None)
    tools = [plugins.add]
    summary = asyncio.run(evaluate_to_files(policy, {"a": PROBLEMS["a"]}, tmp_path / "eval", sandbox=None,
                                            verifier=None, protocol=EvalProtocol(samples=2), progress=False,
                                            tools=tools))
    assert handed == [tools, tools] and summary["a"]["num_problems"] == 2
