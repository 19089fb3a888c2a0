"""Checkpoints: exact round trip, keep-last-K, and a run killed with SIGKILL that resumes to exactly the
metrics of an uninterrupted run."""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from rstar2jax import models
from rstar2jax.train import Checkpointer, CheckpointError, init_train_state, make_optimizer, state_shardings
from rstar2jax.train.checkpoint import abstract_like
from tests.conftest import REPO_ROOT
from tests.train.conftest import copy_tree

TIMING = ("time/", "throughput/")


@pytest.mark.needs_devices(8)
def test_round_trip_keeps_last_k(tmp_path, tiny_model):
    config, params = tiny_model
    optimizer = make_optimizer()
    mesh = models.make_mesh(data=2, fsdp=2, tensor=2)
    shardings = state_shardings(config, optimizer, mesh)
    state = jax.device_put(init_train_state(copy_tree(params), optimizer, 11), shardings)
    checkpointer = Checkpointer(tmp_path, save_every=2, keep=2)
    assert checkpointer.restore(abstract_like(state)) is None
    for step in range(1, 8):
        checkpointer.save(step, state, {"step": step, "history": [{"step": step}]})
    assert checkpointer.save(7, state, {"step": 7}, force=True)  # not due, forced (e.g. at exit)
    assert not checkpointer.save(7, state, {"step": 7}, force=True)  # already saved
    checkpointer.wait()
    assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [6, 7]
    restored, meta = checkpointer.restore(abstract_like(state))
    checkpointer.close()
    assert meta == {"step": 7}
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        assert a.sharding == b.sharding and a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _driver(workdir, *extra):
    return [sys.executable, "-m", "tests.train.scripted", f"--config.workdir={workdir}", *extra]


def _run_driver(workdir, env):
    done = subprocess.run(
        _driver(workdir), env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _metrics(workdir):
    lines = (workdir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(TIMING)} for line in lines]


@pytest.mark.slow  # 40 s on 2 cores; SIGKILL and resume by default: tests/train/test_async.py
def test_sigkill_and_resume_reproduces_uninterrupted_run(tmp_path, compile_cache_env):
    env = compile_cache_env
    reference, interrupted = tmp_path / "reference", tmp_path / "interrupted"
    _run_driver(reference, env)
    expected = _metrics(reference)
    assert [m["step"] for m in expected] == [1, 2, 3, 4, 5, 6]
    assert [m["stage"] for m in expected] == [0, 0, 0, 1, 1, 1]
    # warm-up of 2 steps, restarted by the stage-2 optimizer reset
    lr = [m["learning_rate"] for m in expected]
    assert lr[0] == lr[3] == lr[1] / 2 and lr[1] == lr[2] == lr[4] == lr[5]

    process = subprocess.Popen(
        _driver(interrupted, "--delay=0.3"),
        env=env,
        cwd=REPO_ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    metrics_file = interrupted / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and process.poll() is None:
        if metrics_file.exists() and len(metrics_file.read_text().splitlines()) >= 4:
            break
        time.sleep(0.05)
    assert process.poll() is None, "the run finished before it could be killed"
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    saved = Checkpointer(interrupted / "checkpoints").latest_step
    assert saved is not None and 2 <= saved < 6, saved  # resumes from a checkpoint, not from scratch

    resumed = _run_driver(interrupted, env)
    assert _metrics(interrupted) == expected
    where = (
        f"stage 1/2 'stage1', step {saved} of 3"
        if saved < 3
        else f"stage 2/2 'stage2', step {saved - 3} of 3"
    )
    assert f"resuming RL from the checkpoint at step {saved} in " in resumed.stdout, resumed.stdout
    assert f"checkpoints: {where}\n" in resumed.stdout, resumed.stdout


def _truncate_largest_array_file(step_dir):
    largest = max((p for p in (step_dir / "state").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    largest.write_bytes(largest.read_bytes()[:100])


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax reader futures
def test_unreadable_latest_checkpoints_fall_back_to_the_newest_readable(tmp_path, tiny_model, caplog):
    config, params = tiny_model
    state = init_train_state(copy_tree(params), make_optimizer(), 11)
    checkpointer = Checkpointer(tmp_path, save_every=1, keep=5, async_save=False)
    for step in (1, 2, 3):
        checkpointer.save(step, state, {"step": step})
    checkpointer.close()
    _truncate_largest_array_file(tmp_path / "3")  # damaged array data
    (tmp_path / "2" / "meta" / "metadata").write_text("{not json")  # a broken record

    checkpointer = Checkpointer(tmp_path, save_every=1, keep=5, async_save=False)
    restored, meta = checkpointer.restore(abstract_like(state))
    assert meta == {"step": 1}
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    report = [r.getMessage() for r in caplog.records if r.name == "rstar2jax.train.checkpoint"]
    assert len(report) == 2, report  # one warning line per unreadable checkpoint
    assert all("\n" not in line for line in report)
    assert {r.levelname for r in caplog.records if r.name == "rstar2jax.train.checkpoint"} == {"WARNING"}
    for line, step in zip(report, (3, 2), strict=True):
        assert line.startswith(f"checkpoint {tmp_path / str(step)} is unreadable (") and "older one" in line
    assert "JSONDecodeError" in report[1]
    names = sorted(p.name for p in tmp_path.iterdir() if p.name[0].isdigit())
    assert names == ["1", "2.unreadable", "3.unreadable"]
    # The run goes on from step 1: later saves are not blocked by the damaged folders.
    assert checkpointer.latest_step == 1
    assert checkpointer.save(2, state, {"step": 2})
    assert checkpointer.restore(abstract_like(state))[1] == {"step": 2}
    checkpointer.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # orbax reader futures
def test_no_readable_checkpoint_and_an_unreadable_requested_step_are_one_line_errors(tmp_path, tiny_model):
    config, params = tiny_model
    state = init_train_state(copy_tree(params), make_optimizer(), 11)
    checkpointer = Checkpointer(tmp_path, save_every=1, keep=5, async_save=False)
    checkpointer.save(1, state, {"step": 1})
    checkpointer.save(2, state, {"step": 2})
    _truncate_largest_array_file(tmp_path / "2")
    with pytest.raises(CheckpointError) as error:
        checkpointer.restore(abstract_like(state), step=2)
    assert str(error.value).startswith(f"checkpoint {tmp_path / '2'} is unreadable: ")
    assert "\n" not in str(error.value) and (tmp_path / "2").is_dir()  # a requested step is not moved
    _truncate_largest_array_file(tmp_path / "1")
    with pytest.raises(CheckpointError, match=r"no readable checkpoint in .*: steps \[2, 1\]") as error:
        checkpointer.restore(abstract_like(state))
    assert "\n" not in str(error.value)
    checkpointer.close()
