"""The RL iteration: rollout metrics, RoC selection into a batch, the hard-problem filter, one iteration."""

import math

import jax
import numpy as np
import pytest

from rstar2jax.data.problems import Problem
from rstar2jax.data.trajectory import Trajectory, answer_tag_counts
from rstar2jax.train import (
    RLIterationConfig,
    RLLossConfig,
    filter_hard_problems,
    init_train_state,
    make_optimizer,
    make_rl_step,
    rl_iteration,
    rollout_metrics,
    select_and_build_batch,
    selection,
)
from tests.train.conftest import FAST_COMPILE, copy_tree
from tests.train.scripted import make_scripted_rollout


def _traj(pid, reward, outcomes=(), answers=1, turns=1, length=3, truncated=False, prompt=(1, 2)):
    return Trajectory(
        problem_id=pid,
        prompt_ids=list(prompt),
        response_ids=list(range(3, 3 + length)),
        loss_mask=[1] * length,
        logprobs=[-1.0] * length,
        tool_outcomes=list(outcomes),
        num_turns=turns,
        num_answer_blocks=answers,
        truncated=truncated,
        reward=reward,
        timings={"generate": 1.0},
    )


def test_rollout_metrics_values():
    groups = [
        [
            _traj("a", 1.0, ["ok", "error"], turns=2),
            _traj("a", 0.0, ["timeout", "timeout"], answers=0, turns=3),
        ],
        [_traj("b", 1.0, ["ok"], answers=2, turns=2, length=5), _traj("b", 1.0, truncated=True, length=7)],
    ]
    m = rollout_metrics(groups)
    assert m["reward"] == m["accuracy"] == 0.75
    assert m["problems_all_correct"] == 0.5 and m["problems_none_correct"] == 0.0
    assert m["tool_calls_per_traj"] == 5 / 4
    assert m["tool_error_ratio"] == 3 / 5  # error, timeout, timeout of 5 calls
    assert m["tool_error_ratio_correct"] == 1 / 3  # inside correct trajectories: error of ok, error, ok
    # p_format: one answer in 2 turns 0; no answer 1; two answers in 2 turns 0.5; one answer in one turn 0
    assert m["p_format"] == pytest.approx(1.5 / 4)
    assert m["response_length"] == (3 + 3 + 5 + 7) / 4 and m["response_length_max"] == 7
    assert m["truncation_rate"] == 0.25 and m["turns"] == 2.0
    assert m["traj_time/generate"] == 1.0


def test_rollout_metrics_tool_ratios_are_nan_without_calls():
    no_calls = rollout_metrics([[_traj("a", 1.0), _traj("a", 0.0, ["error"])]])
    assert no_calls["tool_error_ratio"] == 1.0 and math.isnan(no_calls["tool_error_ratio_correct"])
    assert math.isnan(rollout_metrics([[_traj("a", 1.0), _traj("a", 0.0)]])["tool_error_ratio"])


def test_release_mode_selection_and_advantages():
    # Group a: 2 positives (penalties 0.5 / 0) and 2 negatives -> release keeps 1 of each class, the positive
    # with the lower p_total and the first negative. Group b: all correct -> rejected as all-equal.
    a = [
        _traj("a", 1.0, ["error"], length=4),
        _traj("a", 0.0, length=5),
        _traj("a", 1.0, ["ok"], length=6),
        _traj("a", 0.0, length=2),
    ]
    b = [_traj("b", 1.0) for _ in range(4)]
    config = RLIterationConfig(
        samples_per_problem=4,
        keep=2,
        roc_mode="release",
        min_negatives=1,
        min_positives=1,
        seq_len=16,
        pack=False,
        row_multiple=1,
        std="population",
    )
    batch, metrics = select_and_build_batch(jax.random.PRNGKey(0), [a, b], config, num_rows=4)
    assert metrics["groups_rejected"] == 1 and metrics["selected"] == 2
    # Kept: a[1] (negative, rollout order first) and a[2] (positive, p_total 0): population std 0.5 -> ±1.
    lengths = (batch.segment_ids > 0).sum(axis=1)
    np.testing.assert_array_equal(lengths, [2 + 5 - 1, 2 + 6 - 1, 0, 0])
    np.testing.assert_allclose(batch.advantages[0, 1], -1.0, rtol=1e-5)
    np.testing.assert_allclose(batch.advantages[1, 1], 1.0, rtol=1e-5)
    assert metrics["selected_reward"] == 0.5 and metrics["selected_p_total"] == 0.25  # (0.5 no-tool + 0) / 2
    assert batch.loss_mask[2:].sum() == 0

    with pytest.raises(ValueError, match="more than samples_per_problem"):
        from rstar2jax.schedules.schedule import _group

        _group([Problem("a", "q", "1")], a + a, 4)


def test_filter_hard_problems_drops_always_solved():
    problems = [Problem(id=f"p{i}", problem="q", answer="1") for i in range(12)]
    rollout = make_scripted_rollout()
    kept, stats = filter_hard_problems(
        None,
        problems,
        rollout_fn=rollout,
        num_rollouts=3,
        batch_size=5,
        max_response_length=8,
        max_turns=2,
        seed=0,
    )
    groups = [
        rollout(None, [p], samples_per_problem=3, max_response_length=8, max_turns=2, seed=5 * (i // 5))
        for i, p in enumerate(problems)
    ]
    solved_all = {p.id for p, g in zip(problems, groups, strict=True) if all(t.reward > 0 for t in g)}
    assert solved_all and {p.id for p in kept} == {p.id for p in problems} - solved_all
    assert stats["filter_kept"] + stats["filter_dropped"] == 12 and stats["filter_dropped"] == len(solved_all)


def test_rl_iteration_is_deterministic_and_updates(tiny_model, monkeypatch):
    config, params = tiny_model
    optimizer = make_optimizer(1e-3, warmup_steps=1)
    step = make_rl_step(config, optimizer, RLLossConfig(), num_microbatches=2, compiler_options=FAST_COMPILE)
    iteration = RLIterationConfig(samples_per_problem=4, keep=2, seq_len=40, pack=False, row_multiple=2)
    problems = [Problem(id=str(i), problem="q", answer="1") for i in range(4)] + [Problem("0", "q", "1")]
    rollout = make_scripted_rollout(vocab_size=config.vocab_size)

    def iterate(rollout_fn=rollout, **kwargs):
        state = init_train_state(copy_tree(params), optimizer, 3)
        return rl_iteration(
            state,
            problems,
            rollout_fn=rollout_fn,
            rl_step=step,
            config=iteration,
            max_response_length=24,
            max_turns=3,
            num_rows=8,
            **kwargs,
        )

    outputs = [iterate(), iterate()]
    (s1, m1), (s2, m2) = outputs
    timing = ("time/", "throughput/")
    assert {k: v for k, v in m1.items() if not k.startswith(timing)} == {
        k: v for k, v in m2.items() if not k.startswith(timing)
    }
    assert m1["num_trajectories"] == 16  # the repeated problem "0" is rolled out once
    assert m1["batch_rows"] == 8 and m1["tokens"] > 0 and np.isfinite(m1["loss"])
    assert int(s1.step) == 1 and not np.array_equal(s1.rng, jax.random.PRNGKey(3))
    assert not np.allclose(s1.params["embed"], params["embed"])
    for key in (
        "reward",
        "accuracy",
        "tool_error_ratio_correct",
        "p_format",
        "truncation_rate",
        "groups_rejected",
        "clip_frac",
        "approx_kl",
        "entropy",
        "grad_norm",
        "time/rollout",
        "time/verify",
        "time/update",
        "throughput/update_tokens_per_s",
    ):
        assert key in m1, key

    returned = []

    def recording_rollout(*args, **kwargs):
        trajectories = rollout(*args, **kwargs)
        returned.extend((t, t.reward) for t in trajectories)
        return trajectories

    penalty_calls = []
    real_penalties = selection._penalties
    monkeypatch.setattr(
        selection, "_penalties", lambda *a, **k: penalty_calls.append(1) or real_penalties(*a, **k)
    )
    rescored = iterate(rollout_fn=recording_rollout, reward_fn=lambda problem, t: 0.0)[1]
    assert rescored["reward"] == 0.0 and rescored["groups_rejected"] == 4
    assert len(penalty_calls) == 1  # penalties computed once, for the metrics and RoC alike
    # The rescoring made new records: the rollout's trajectories keep the rewards it gave them.
    assert any(reward > 0 for _, reward in returned)
    assert all(t.reward == reward for t, reward in returned)


def _three_rollouts(**overrides):
    config = dict(samples_per_problem=3, keep=3, roc_mode="release", min_negatives=1, min_positives=1,
                  seq_len=16, pack=False, std="population")
    return RLIterationConfig(**{**config, **overrides})


def test_nan_reward_is_an_error_naming_the_trajectory():
    group = [_traj("a", 1.0), _traj("a", float("nan")), _traj("a", 0.0)]
    with pytest.raises(ValueError, match=r"trajectory 1 of problem 'a' has reward nan"):
        select_and_build_batch(jax.random.PRNGKey(0), [group], _three_rollouts(), num_rows=4)
    group[1].reward = float("inf")
    with pytest.raises(ValueError, match=r"trajectory 1 of problem 'a' has reward inf"):
        select_and_build_batch(jax.random.PRNGKey(0), [group], _three_rollouts(), num_rows=4)


def test_truncated_responses_masked_and_soft_overlong_penalty():
    # Rewards [1, 1, 0]; lengths 6, 3, 2 with a budget of 8 and a 4-token buffer: DAPO shaping -0.5, 0, 0.
    group = [_traj("a", 1.0, length=6, truncated=True), _traj("a", 1.0, length=3), _traj("a", 0.0, length=2)]
    plain, _ = select_and_build_batch(jax.random.PRNGKey(0), [group], _three_rollouts(), num_rows=4)
    masked, metrics = select_and_build_batch(
        jax.random.PRNGKey(0), [group], _three_rollouts(mask_truncated=True), num_rows=4
    )
    assert metrics["selected_truncated"] == 1.0
    # Row of each trajectory by its length (prompt 2 + response n - 1 positions).
    rows = {int(n) - 1: r for r, n in enumerate((plain.segment_ids > 0).sum(axis=1)) if n > 0}
    truncated_row = rows[6]
    assert plain.loss_mask[truncated_row].sum() == 6 and masked.loss_mask[truncated_row].sum() == 0
    np.testing.assert_array_equal(np.delete(masked.loss_mask, truncated_row, 0),
                                  np.delete(plain.loss_mask, truncated_row, 0))
    # Its group statistics are unchanged: the advantages are those of rewards [1, 1, 0].
    np.testing.assert_allclose(masked.advantages, plain.advantages)
    np.testing.assert_allclose(plain.advantages[truncated_row, 0], (1 - 2 / 3) / np.sqrt(2 / 9), rtol=1e-5)

    shaped, _ = select_and_build_batch(
        jax.random.PRNGKey(0), [group], _three_rollouts(overlong_buffer=4), num_rows=4, max_response_length=8
    )
    rewards = np.array([0.5, 1.0, 0.0])  # 1 - 0.5, 1, 0
    want = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
    np.testing.assert_allclose([shaped.advantages[rows[n], 0] for n in (6, 3, 2)], want, rtol=1e-5)
    with pytest.raises(ValueError, match="overlong_buffer > 0 needs max_response_length"):
        select_and_build_batch(jax.random.PRNGKey(0), [group], _three_rollouts(overlong_buffer=4), num_rows=4)
    with pytest.raises(ValueError, match="format_penalty='strict'"):
        _three_rollouts(format_penalty="strict")


def test_answer_tag_counts():
    assert answer_tag_counts("<reason>r</reason><answer>\\boxed{1}</answer>") == (1, 1, 1)
    assert answer_tag_counts("<answer>a</answer> x <answer>b</answer>") == (2, 2, 2)
    assert answer_tag_counts("<answer>a <answer>b</answer>") == (2, 1, 1)  # an unclosed block
    assert answer_tag_counts("</answer><answer>") == (1, 1, 0)
    assert answer_tag_counts("no tags") == (0, 0, 0)


@pytest.mark.parametrize("rule, kept_length", [("paper", 4), ("release", 6)])
def test_format_penalty_rule_changes_release_selection(rule, kept_length):
    def positive(length, answers, turns):
        t = _traj("a", 1.0, ["ok"], answers=answers, turns=turns, length=length)
        t.num_answer_closes = t.num_answer_pairs = answers
        return t

    # Positive A (length 4): one answer in one turn, paper p_format 0, released rule 1 (no turn in the
    # response). Positive B (length 6): two answers in three turns, paper 1/3, released rule 1/2.
    group = [positive(4, 1, 1), _traj("a", 0.0, length=2), positive(6, 2, 3), _traj("a", 0.0, length=3)]
    for t in group[1::2]:
        t.num_answer_closes = t.num_answer_pairs = 1
    config = RLIterationConfig(samples_per_problem=4, keep=2, roc_mode="release", min_negatives=1,
                               min_positives=1, seq_len=16, pack=False, format_penalty=rule)
    batch, metrics = select_and_build_batch(jax.random.PRNGKey(0), [group], config, num_rows=2)
    lengths = set((batch.segment_ids > 0).sum(axis=1) - 1)
    assert lengths == {2, kept_length}  # the first negative and the positive with the lower p_total
    group[1].num_answer_pairs = None
    if rule == "release":
        with pytest.raises(ValueError, match="format_penalty='release' needs num_answer_pairs"):
            select_and_build_batch(jax.random.PRNGKey(0), [group], config, num_rows=2)


def test_rollout_metrics_report_the_mean_entropy_of_sampled_tokens():
    def traj(entropies, mask):
        n = len(mask)
        return Trajectory("p", [1], list(range(n)), mask, [0.0] * n, entropies=entropies)

    groups = [[traj([1.0, 0.0, 3.0], [1, 0, 1]), traj(None, [1, 1])], [traj([2.0, 5.0], [1, 1])]]
    assert rollout_metrics(groups)["entropy_mean"] == pytest.approx((1 + 3 + 2 + 5) / 4)
    assert "entropy_mean" not in rollout_metrics([[traj(None, [1])]])
    with pytest.raises(ValueError, match="entropies"):
        traj([1.0], [1, 1])
