"""Rollouts across a policy update: version tags and policy lag, one-step off-policy, partial rollouts.
(That the default, synchronous on-policy, run keeps the numbers of the code before these options is checked
on the run ``tests/train/test_colocate.py`` makes anyway, against ``scripted.MAIN_HISTORY``.)"""


import dataclasses
import json
import shutil
import types

import numpy as np
import pytest

from rstar2jax.data.batch import build_batch, trajectory_sequence
from rstar2jax.data.problems import Problem, ProblemIterator
from rstar2jax.data.rollout_contract import unfinished_from_dict
from rstar2jax.data.trajectory import Trajectory, trajectory_from_dict
from rstar2jax.schedules import schedule as schedule_lib
from rstar2jax.schedules.schedule import CARRY_META_KEY, PARTIAL_META_KEY, OneStepOffPolicy, Partial
from rstar2jax.train import (
    RLIterationConfig,
    RLLossConfig,
    init_train_state,
    make_optimizer,
    make_rl_step,
    parse,
    rl_iteration,
    selection,
    train_rl,
)
from tests.train.conftest import FAST_COMPILE, copy_tree
from tests.train.scripted import make_partial_scripted_rollout, make_scripted_rollout, tiny_rl_config
from tests.train.test_partial_carry import pickled_carry

TIMING = ("time/", "throughput/")

def _corrected_step(model_config):
    loss = RLLossConfig(old_logprobs="recompute", rollout_is_cap=2.0)
    optimizer = make_optimizer(1e-3, warmup_steps=1)
    return optimizer, make_rl_step(model_config, optimizer, loss, compiler_options=FAST_COMPILE)


def _embed_sum(params) -> float:
    return float(np.asarray(params["embed"], np.float64).sum())


def test_one_step_off_policy_trains_on_the_previous_parameters_rollout(tiny_model):
    config, params = tiny_model
    optimizer, step = _corrected_step(config)
    iteration = RLIterationConfig(samples_per_problem=4, keep=2, seq_len=40, pack=False)
    batches = [[Problem(f"{k}-{i}", "q", "1") for i in range(2)] for k in range(3)]
    scripted = make_scripted_rollout(vocab_size=config.vocab_size)
    calls = []

    def rollout(params, problems, **kwargs):
        calls.append(([p.id for p in problems], _embed_sum(params)))
        return scripted(params, problems, **kwargs)

    state, schedule = init_train_state(copy_tree(params), optimizer, 3), OneStepOffPolicy()
    metrics, before, drawn, batch_iterator = [], [], [], iter(batches)
    for k in range(3):
        before.append(_embed_sum(state.params))
        problems = schedule.draw(batch_iterator, stage_last=k == 2)
        drawn.append([p.id for p in problems])
        state, m = rl_iteration(
            state, problems, rollout_fn=rollout, rl_step=step, config=iteration, max_response_length=24,
            max_turns=3, num_rows=4, schedule=schedule,
        )
        metrics.append(m)
    # Batch 0 drawn for step 0; later steps train on the rollout made ahead and draw nothing new.
    assert drawn == [[p.id for p in batches[0]], [], []]
    assert schedule.empty and int(state.step) == 3
    # Batch 0 on-policy at step 0; batch k+1 rolled out with step k's parameters, before step k's update.
    ids = [[p.id for p in b] for b in batches]
    assert calls == [(ids[0], before[0]), (ids[1], before[0]), (ids[2], before[1])]
    assert len(set(before)) == 3
    assert [(m["rollout/policy_lag_mean"], m["rollout/policy_lag_max"]) for m in metrics] == [
        (0.0, 0.0), (1.0, 1.0), (1.0, 1.0)]
    assert all(m["num_trajectories"] == 8 and "rollout_is_ratio" in m for m in metrics)
    assert step._cache_size() == 1  # one compiled update for every step


def test_partial_rollouts_train_finished_groups_and_resume_the_rest(tiny_model):
    config, params = tiny_model
    optimizer, step = _corrected_step(config)
    iteration = RLIterationConfig(samples_per_problem=4, keep=2, seq_len=40, pack=False)
    problems = [Problem(f"p{i}", "q", "1") for i in range(12)]
    iterator, prompts_per_step = ProblemIterator(problems, 3, seed=0), 3
    partial = make_partial_scripted_rollout(vocab_size=config.vocab_size)
    finished = []

    def recording_partial(params, problems, *, policy_version, token_budget, resume, **kwargs):
        done, unfinished = partial.partial(params, problems, policy_version=policy_version,
                                           token_budget=token_budget, resume=resume, **kwargs)
        finished.extend((policy_version, t) for t in done)
        return done, unfinished

    rollout = types.SimpleNamespace(partial=recording_partial)

    state, schedule = init_train_state(copy_tree(params), optimizer, 3), Partial(70, prompts_per_step)
    metrics, compiled = [], []
    for _ in range(5):
        open_before = schedule.open_groups
        new = schedule.draw(iterator, stage_last=False)
        assert len(new) == prompts_per_step - open_before
        state, m = rl_iteration(
            state, new, rollout_fn=rollout, rl_step=step, config=iteration, max_response_length=24,
            max_turns=3, num_rows=prompts_per_step * 2, schedule=schedule,
        )
        metrics.append(m)
        compiled.append(
            (step._cache_size(), selection._select._cache_size(), selection._penalties._cache_size())
        )
        assert schedule.open_groups <= prompts_per_step
    assert metrics[0]["rollout/policy_lag_max"] == 0.0
    assert any(m["rollout/partial_resumed_tokens"] > 0 for m in metrics)
    lags = [m["rollout/policy_lag_max"] for m in metrics]
    assert max(lags) >= 1 and all(lag <= k for k, lag in enumerate(lags))
    assert len({m["num_trajectories"] for m in metrics}) > 1  # steps completed different numbers of groups
    assert len(set(compiled)) == 1 and compiled[0][0] == 1  # ... and nothing compiled again
    mixed = 0
    for version, t in finished:
        versions, mask = np.array(t.policy_versions), np.array(t.loss_mask, bool)
        assert (versions[~mask] == -1).all() and (versions[mask] >= 0).all() and versions.max() <= version
        assert (np.diff(versions[mask]) >= 0).all()  # old tokens keep their version, new ones the new one
        mixed += len(set(versions[mask])) > 1
    assert mixed
    # Every complete group is trained once; the rest stay open in the schedule.
    trained = sum(m["num_trajectories"] for m in metrics)
    assert trained == len(finished) - sum(len(g) for g in schedule.held.values())


@pytest.mark.parametrize("mode", ["off_policy", "partial"])
def test_a_resumed_run_carries_its_rollouts_exactly(tmp_path, mode):
    """Resumed from the checkpoint after step 1, step 2 has the numbers of the run that went on (the carried
    rollouts live in the checkpoint meta)."""

    def config(name):
        c = tiny_rl_config(str(tmp_path / name))
        c.loss.old_logprobs, c.loss.rollout_is_cap = "recompute", 2.0
        c.checkpoint.save_every = 1
        if mode == "off_policy":
            c.rl.off_policy_steps = 1
        else:
            c.rollout.partial_token_budget = 60
        return c

    def rollout_fn():
        return make_scripted_rollout() if mode == "off_policy" else make_partial_scripted_rollout()

    def numbers(history):
        return [{k: v for k, v in m.items() if not k.startswith(TIMING)} for m in history]

    straight = numbers(train_rl(parse(config("straight")), rollout_fn=rollout_fn(), max_steps=2))
    shutil.copytree(tmp_path / "straight" / "checkpoints" / "1", tmp_path / "resumed" / "checkpoints" / "1")
    resumed = numbers(train_rl(parse(config("resumed")), rollout_fn=rollout_fn(), max_steps=2))
    assert len(straight) == 2 and resumed == straight
    assert straight[1]["rollout/policy_lag_max"] == 1.0
    if mode == "partial":  # the carry is declared JSON; the pickle the code before it wrote resumes the same
        meta = json.loads((tmp_path / "resumed" / "checkpoints" / "1" / "meta" / "metadata").read_text())
        carry = meta["schedule"].pop(PARTIAL_META_KEY)
        assert carry["format"] == 1 and carry["unfinished"] and CARRY_META_KEY not in meta["schedule"]
        meta["schedule"][CARRY_META_KEY] = pickled_carry({
            "unfinished": [unfinished_from_dict(u) for u in carry["unfinished"]],
            "held": {pid: [trajectory_from_dict(t) for t in g] for pid, g in carry["held"].items()},
            "problems": {p["id"]: Problem.from_dict(p) for p in carry["problems"]}})
        legacy = tmp_path / "legacy" / "checkpoints" / "1"
        shutil.copytree(tmp_path / "straight" / "checkpoints" / "1", legacy)
        (legacy / "meta" / "metadata").write_text(json.dumps(meta))
        assert numbers(train_rl(parse(config("legacy")), rollout_fn=rollout_fn(), max_steps=2)) == straight


def test_versions_are_carried_into_batches_target_aligned():
    t = Trajectory("p", [5, 6, 7], [8, 9, 10, 11], [1, 0, 1, 1], [-0.5, 0.0, -0.25, -0.125],
                   policy_versions=[3, -1, 4, 4])
    sequence = trajectory_sequence(t, 1.0)
    assert list(sequence.policy_versions) == [-1, -1, -1, 3, -1, 4, 4]
    batch = build_batch([sequence], seq_len=8, num_rows=2, with_rl_fields=True, with_policy_versions=True)
    # Position i predicts token i + 1: its version is that token's; padding and prompt targets get -1.
    np.testing.assert_array_equal(batch.policy_versions[0], [-1, -1, 3, -1, 4, 4, -1, -1])
    assert (batch.policy_versions[1] == -1).all()
    assert build_batch([sequence], seq_len=8, with_rl_fields=True).policy_versions is None
    lag = selection.policy_lag_metrics([[t]], 5)
    assert lag == {"rollout/policy_lag_mean": pytest.approx(4 / 3), "rollout/policy_lag_max": 2.0}
    with pytest.raises(ValueError, match="outside"):
        selection.policy_lag_metrics([[t]], 3)
    with pytest.raises(ValueError, match="policy_versions"):
        Trajectory("p", [1], [2, 3], [1, 1], [0.0, 0.0], policy_versions=[0])
    # Untagged trajectories get the version they were rolled out with on their sampled tokens.
    (tagged,) = schedule_lib.tag_versions([dataclasses.replace(t, policy_versions=None)], 7)
    assert tagged.policy_versions == [7, -1, 7, 7]
