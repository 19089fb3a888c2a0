"""The asynchronous schedule (``rl.schedule="async"``): eta=0 is the synchronous run, the staleness bound
holds whatever the rollouts' timing, nothing drawn is lost or trained twice, split placement's engines get the
trainer's weights, and the release throttle's arithmetic. (Tokens' versions and log-probs across an update in
flight on the real engine: ``tests/agent/test_rollout_e2e.py``.)"""

import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from rstar2jax.config.loss_config import RLLossConfig
from rstar2jax.config.options import ConfigError
from rstar2jax.data.problems import Problem, ProblemIterator
from rstar2jax.schedules.async_schedule import AsyncSchedule
from rstar2jax.schedules.placement import rollout_devices, train_devices
from rstar2jax.schedules.schedule_state import AsyncState, ScheduleInvariantError, Ticket
from rstar2jax.train import (
    RLIterationConfig,
    init_train_state,
    make_optimizer,
    make_rl_step,
    parse,
    rl_iteration,
    train_rl,
)
from rstar2jax.train.checkpoint import Checkpointer
from tests.conftest import REPO_ROOT, cpu_xla_flags
from tests.train.conftest import FAST_COMPILE, copy_tree
from tests.train.scripted import (
    make_async_scripted_rollout,
    make_scripted_rollout,
    set_fields,
    tiny_rl_config,
)

NOT_COMPARED = ("time/", "throughput/", "async/")  # wall clock, and what only the producer reports


def _config(workdir, **fields):
    return set_fields(tiny_rl_config(str(workdir)), fields)


def _same(a, b) -> bool:
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def _compared(history):
    return [{k: v for k, v in record.items() if not k.startswith(NOT_COMPARED)} for record in history]


def _saved_params(checkpoints, step):
    manager = ocp.CheckpointManager(checkpoints, item_names=("state",))
    try:
        restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
        return restored.state["params"]
    finally:
        manager.close()


def test_the_throttle_takes_due_groups_first_and_fills_with_the_oldest():
    problem = Problem("p", "q", "1")
    tickets = tuple(Ticket(b, i, problem, 0, i, 0, version) for b, i, version in
                    [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0), (2, 0, 1), (2, 1, 1)])
    state = AsyncState(released=3, consumed=0, batch_sizes=(2, 2, 2), tickets=tickets)
    keys = {t.key for t in tickets}
    # At version 1 with eta 1 the groups released at version 0 are due: all four cannot fit a batch of 2.
    with pytest.raises(ScheduleInvariantError, match="release throttle"):
        state.choose(keys, 1, 1)
    state = AsyncState(released=3, consumed=1, batch_sizes=(2, 2, 2), tickets=tickets[2:])
    due = {(1, 0), (1, 1)}
    assert state.choose({(2, 0), (2, 1), (1, 0)}, 1, 1) is None  # a due group still runs
    assert state.choose(due | {(2, 0)}, 1, 1) == sorted(due)
    # At version 0 nothing is due: the oldest complete groups, once there are enough.
    assert state.choose({(2, 1)}, 0, 1) is None
    assert state.choose({(2, 1), (1, 1), (2, 0)}, 0, 1) == [(1, 1), (2, 0)]


@pytest.mark.slow  # two full runs, 16-22 s on 2 cores; the bound at eta 1 and 2 by default: below
def test_max_staleness_0_gives_the_synchronous_batches_and_losses(tmp_path):
    """Two stages, the stage-2 hard filter and optimizer reset: every step's numbers and the final parameters
    of the asynchronous run at eta=0 are the synchronous run's."""
    sync = train_rl(parse(_config(tmp_path / "sync")), rollout_fn=make_scripted_rollout())
    config = _config(tmp_path / "async", **{"rl.schedule": "async", "rl.max_staleness": 0,
                                            "rl.off_policy_correction": "none"})
    rollout = make_async_scripted_rollout(max_delay=0.02)
    asynchronous = train_rl(parse(config), rollout_fn=rollout)
    assert len(sync) == len(asynchronous) == 6 and len(rollout.streams) == 2  # one producer per stage
    for a, b in zip(_compared(sync), _compared(asynchronous), strict=True):
        assert a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a), (a, b)
    assert all(r["staleness/max"] == 0 for r in asynchronous if "staleness/max" in r)
    states = [_saved_params(tmp_path / name / "checkpoints", 6) for name in ("sync", "async")]
    for a, b in zip(jax.tree.leaves(states[0]), jax.tree.leaves(states[1]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("eta", [1, 2])
def test_the_staleness_bound_holds_whatever_the_rollouts_timing(tmp_path, eta):
    """Groups finish after random delays (up to 0.4 s, several updates): no trained token lags its update's
    parameters by more than eta versions, some do lag, and every released group is trained once or counted
    dropped."""
    config = _config(tmp_path, **{"rl.schedule": "async", "rl.max_staleness": eta})
    rollout = make_async_scripted_rollout(max_delay=0.4, delay_seed=eta)
    history = train_rl(parse(config), rollout_fn=rollout)
    assert len(history) == 6
    lags = [r["staleness/max"] for r in history if "staleness/max" in r]
    assert max(lags) <= eta and max(lags) >= 1, lags
    assert all(r["rollout/policy_lag_max"] <= eta for r in history)
    assert all("async/rollout_busy" in r and "async/weight_update_s" in r for r in history)
    last = history[-1]
    drawn = 6 * 3  # steps x prompts_per_step
    assert last["async/groups_released_total"] == drawn
    assert last["async/groups_trained_total"] + last["async/groups_dropped_total"] == drawn
    for stream in rollout.streams:  # each group submitted once and handed back once
        assert not stream.jobs and stream.done.empty()
    assert sum(r["num_trajectories"] for r in history) == 4 * last["async/groups_trained_total"]


def test_split_placement_copies_the_trainers_weights_to_the_rollout_device(tiny_model):
    """Each update's weights reach the engine's device as a copy (fresh buffers) equal to the trainer's."""
    config, params = tiny_model
    optimizer = make_optimizer(1e-3, warmup_steps=1)
    step = make_rl_step(config, optimizer, RLLossConfig(off_policy_correction="decoupled"),
                        compiler_options=FAST_COMPILE)
    iteration = RLIterationConfig(samples_per_problem=4, keep=2, seq_len=40, pack=False)
    device = jax.devices()[-1]
    schedule = AsyncSchedule(1, devices=[device], dtype=config.compute_dtype)
    schedule.begin_stage(3, 0)
    iterator = ProblemIterator([Problem(f"p{i}", "q", "1") for i in range(12)], 2, seed=0)
    rollout = make_async_scripted_rollout(max_delay=0.05, vocab_size=config.vocab_size)
    state = init_train_state(copy_tree(params), optimizer, 3)
    try:
        for _ in range(3):
            problems = schedule.draw(iterator, stage_last=False)
            state, metrics = rl_iteration(state, problems, rollout_fn=rollout, rl_step=step, config=iteration,
                                          max_response_length=24, max_turns=3, num_rows=4, schedule=schedule)
            version, copy = rollout.streams[0].received[-1]
            assert version == int(state.step) and metrics["async/weight_update_s"] >= 0
            for ours, trainers in zip(jax.tree.leaves(copy), jax.tree.leaves(state.params), strict=True):
                assert ours.devices() == {device} and trainers.devices() == {jax.devices()[0]}
                np.testing.assert_array_equal(np.asarray(ours), np.asarray(trainers))
    finally:
        schedule.close()
    assert len(rollout.streams[0].received) == 4  # the opening weights and three updates


def test_split_placement_sets_the_last_devices_of_each_process_apart():
    options = parse(_config("unused", **{"rl.schedule": "async", "rl.placement": "split",
                                         "rl.rollout_devices": 2}))
    devices = jax.devices()
    assert rollout_devices(options) == devices[-2:]
    assert train_devices(options) == devices[:-2]
    colocated = parse(_config("unused", **{"rl.schedule": "async"}))
    assert rollout_devices(colocated) == devices[:1] and train_devices(colocated) == devices


@pytest.mark.slow  # 30-36 s on 2 cores: a launcher started, killed and resumed
def test_sigkill_and_resume_trains_every_drawn_problem_once(tmp_path, compile_cache_env):
    """Killed with SIGKILL mid-run (groups in flight, finished groups waiting), the resumed run issues the
    in-flight groups again and ends with every drawn problem trained once or counted dropped, the bound
    held."""
    workdir = tmp_path / "run"
    command = [sys.executable, "-m", "tests.train.scripted", f"--config.workdir={workdir}", "--delay=0.3",
               "--config.rl.schedule=async", "--config.rl.max_staleness=1"]
    process = subprocess.Popen(command, env=compile_cache_env, cwd=REPO_ROOT, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    metrics_file = workdir / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and process.poll() is None:
        if metrics_file.exists() and len(metrics_file.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    assert process.poll() is None, "the run finished before it could be killed"
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    saved = Checkpointer(workdir / "checkpoints").latest_step
    assert saved is not None and 1 <= saved < 6, saved  # resumes from a checkpoint, not from scratch
    resumed = subprocess.run(command, env=compile_cache_env, cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resuming RL from the checkpoint at step {saved} in " in resumed.stdout, resumed.stdout
    history = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    assert [r["step"] for r in history] == [1, 2, 3, 4, 5, 6]
    assert all(r["staleness/max"] <= 1 for r in history if "staleness/max" in r)
    last = history[-1]
    assert last["async/groups_released_total"] == 6 * 3
    assert last["async/groups_trained_total"] + last["async/groups_dropped_total"] == 6 * 3


@pytest.mark.slow  # a minute on 2 cores; two processes by jax.distributed: tests/train/test_distributed.py
def test_two_processes_run_the_asynchronous_schedule(tmp_path, compile_cache_env):
    """Two processes joined by jax.distributed (CPU, one device each, colocated): each runs its engine on its
    own device and owns half of each batch's groups; the trainer's mesh spans both. The run ends with every
    drawn problem trained once (or counted dropped) and the bound held, the same figures in both."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**compile_cache_env, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": cpu_xla_flags(1)}
    command = [sys.executable, "-m", "tests.train.scripted", f"--config.workdir={tmp_path / 'run'}",
               "--delay=0.1", "--config.rl.schedule=async", "--config.rl.prompts_per_step=4",
               "--config.mesh.data=2", "--config.mesh.fsdp=1", "--config.mesh.tensor=1",
               f"--config.distributed.coordinator_address=127.0.0.1:{port}",
               "--config.distributed.num_processes=2"]
    processes = [subprocess.Popen([*command, f"--config.distributed.process_id={i}"], env=env,
                                  cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for i in range(2)]
    for process in processes:
        _, err = process.communicate(timeout=900)
        assert process.returncode == 0, err[-3000:]
    history = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in history] == [1, 2, 3, 4, 5, 6]
    assert all(r["staleness/max"] <= 1 for r in history if "staleness/max" in r)
    last = history[-1]
    assert last["async/groups_released_total"] == 6 * 4
    assert last["async/groups_trained_total"] + last["async/groups_dropped_total"] == 6 * 4


@pytest.mark.parametrize("fields, message", [
    ({"rl.schedule": "later"}, "rl.schedule"),
    ({"rl.schedule": "async", "rl.max_staleness": -1}, "rl.max_staleness"),
    ({"rl.placement": "split"}, "needs rl.schedule='async'"),
    ({"rl.schedule": "async", "rl.off_policy_steps": 1}, "do not combine"),
    ({"rl.schedule": "async", "rl.off_policy_correction": "none"}, "need a correction"),
    ({"rl.schedule": "async", "colocate.optimizer_memory": "host"}, "optimizer_memory='host'"),
    ({"rl.schedule": "async", "loss.rollout_is_cap": 2.0}, "decoupled_is_cap"),
    ({"rl.schedule": "async", "rl.placement": "split", "rl.rollout_devices": 0}, "rl.rollout_devices"),
    ({"rl.schedule": "async", "rollout.on_update": "drop"}, "rollout.on_update"),
])
def test_bad_asynchronous_settings_are_refused_with_their_name(fields, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse(_config("unused", **fields))


def test_the_asynchronous_defaults_pick_the_decoupled_loss_and_sync_keeps_none():
    assert parse(_config("unused", **{"rl.schedule": "async"})).rl.loss.off_policy_correction == "decoupled"
    eta0 = parse(_config("unused", **{"rl.schedule": "async", "rl.max_staleness": 0}))
    assert eta0.rl.loss.off_policy_correction == "none"
    assert parse(_config("unused")).rl.loss.off_policy_correction == "none"
