"""Faults injected into short real RL runs (issue 33), each run a launcher process (``tests/train/faulty.py``:
the real trainer loop, checkpoints and resume; for the sandbox faults the real agent rollout, every tool call
through a real sandbox server and every answer graded by a real verifier pool, with scripted sampling):

* the sandbox killed mid-rollout and back a moment later, the verifier pool killed while it holds
  comparisons, one sandbox worker killed under its calls: nothing dropped, the outage reported, the numbers
  those of a run without faults;
* the sandbox killed for good: exit 3 with one line, the last finished step's checkpoint kept, the
  interrupted step not counted; a rerun with a live sandbox resumes and trains the rest exactly;
* a NaN gradient: the update is skipped and logged, ``rl.max_nonfinite_steps`` in a row stop the run;
* a checkpoint write failing half-way: the run stops naming the folder; the previous checkpoint is the one a
  resume uses;
* a step whose every trajectory was lost to the sandbox: not counted.
"""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from rstar2jax.agent import SandboxResult, format_tool_result, render_prompt_ids, render_prompt_text
from rstar2jax.data.problems import Problem
from rstar2jax.data.tokenizer import train_tiny_tokenizer
from rstar2jax.train import (
    Checkpointer,
    EmptyRollout,
    RLIterationConfig,
    init_train_state,
    make_optimizer,
    rl_iteration,
)
from tests.agent.test_rollout import call_text
from tests.conftest import REPO_ROOT
from tests.train.conftest import copy_tree
from tests.train.faulty import (
    AGENT_MAX_RESPONSE,
    ANSWERS,
    CODES,
    GOLD,
    PROMPT,
    answer_text,
    problem_text,
)

NOT_COMPARED = ("time/", "throughput/", "traj_time/", "rollout/sandbox_")  # wall clock and what faults cost
FAULT_EXIT = 3


@pytest.fixture(scope="module")
def agent_args(tmp_path_factory):
    """The agent runs' command line: their tokenizer (a folder), problems file and the sizes that fit them."""
    folder = tmp_path_factory.mktemp("agent")
    bootstrap = train_tiny_tokenizer(["x"], 300, folder / "bootstrap")
    corpus = [render_prompt_text(bootstrap, problem_text(i), PROMPT) for i in range(4)]
    corpus += [call_text(code) for code in CODES] + [answer_text(a) for a in ANSWERS]
    corpus += [format_tool_result(SandboxResult("ok", "0.5\n", "", 0, None, 0.0), 2048)]
    tokenizer = train_tiny_tokenizer(corpus * 4, 400, folder / "tokenizer")
    problems = folder / "problems.jsonl"
    problems.write_text("".join(json.dumps({"id": f"p{i}", "problem": problem_text(i), "answer": GOLD}) + "\n"
                                for i in range(12)))
    prompt = max(len(render_prompt_ids(tokenizer, problem_text(i), PROMPT)) for i in range(12))
    return [
        "--rollout=agent",
        f"--config.tokenizer={folder / 'tokenizer'}",
        f"--config.data.source={problems}",
        f"--config.model.spec.vocab_size={len(tokenizer)}",
        f"--config.batch.max_prompt_length={prompt}",
        f"--max_response_length={AGENT_MAX_RESPONSE}",
    ]


def run_driver(workdir, *args, env, expect=0):
    done = subprocess.run(
        [sys.executable, "-m", "tests.train.faulty", f"--config.workdir={workdir}", *args],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == expect, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def records(workdir):
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def compared(history):
    return [{k: v for k, v in r.items() if not k.startswith(NOT_COMPARED)} for r in history]


def last_line(done):
    return done.stderr.strip().splitlines()[-1]


def restored(checkpoints, step):
    """Checkpoint ``step`` as saved (``state`` arrays and ``meta``), with no target state to restore into."""
    manager = ocp.CheckpointManager(checkpoints, item_names=("state", "meta"))
    try:
        return manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(),
                                                             meta=ocp.args.JsonRestore()))
    finally:
        manager.close()


@pytest.mark.slow  # 50 s on 2 cores; each fault's handling alone: tests/agent/test_outage.py, the tests below
def test_sandbox_and_verifier_faults_in_a_real_run(tmp_path, agent_args, compile_cache_env):
    env = compile_cache_env
    reference_dir, faulty_dir = tmp_path / "reference", tmp_path / "faulty"
    faulty = run_driver(faulty_dir, *agent_args, f"--reference_workdir={reference_dir}",
                        "--faults=2:blink,3:worker,4:death", env=env, expect=FAULT_EXIT)
    expected = records(reference_dir)
    assert [r["step"] for r in expected] == [1, 2, 3, 4]
    assert all(r["rollout/sandbox_retried_calls"] == 0 for r in expected)
    assert any(r["selected"] for r in expected)  # something was trained on
    url = re.search(r"^sandbox: (\S+)$", faulty.stdout, re.MULTILINE).group(1)
    stop = last_line(faulty)
    pattern = (rf"error: the sandbox {re.escape(url)} did not answer for \d+ s \(outage budget 1 s\): "
               r"\d+ calls were tried \d+ more times with back-off from 0.05 to 0.5 s; "
               r"last error: Unreachable: .*")
    assert re.fullmatch(pattern, stop), stop
    assert "Traceback" not in faulty.stderr
    # Steps 1-3 finished and count; the interrupted step 4 does not; step 3's checkpoint is the last one.
    got = records(faulty_dir)
    assert [r["step"] for r in got] == [1, 2, 3]
    assert Checkpointer(faulty_dir / "checkpoints").latest_step == 3
    blinked, worker_killed = got[1], got[2]
    assert blinked["rollout/sandbox_outage_s"] > 0 and blinked["rollout/sandbox_retried_calls"] >= 1
    assert worker_killed["rollout/sandbox_worker_deaths"] >= 1
    assert all(r["rollout/trajectories_dropped_for_sandbox_failures"] == 0 for r in got)
    assert all(r["num_trajectories"] == 12 for r in got)  # 3 problems x 4 samples: nothing dropped
    assert compared(got) == compared(expected[:3])  # the faults changed no number
    step_2 = [line for line in faulty.stdout.splitlines() if line.startswith("rl step 2/4")]
    assert len(step_2) == 1 and "sandbox down " in step_2[0] and " sandbox calls retried" in step_2[0]
    assert "fault: killed the verifier workers" in faulty.stdout
    # The outage tracker's lines are warnings (agent.outage's logger): a launcher shows them on stderr.
    assert re.search(r"^sandbox \S+ is not answering .*; the calls wait for it, up to 300 s$", faulty.stderr,
                     re.MULTILINE)

    # A rerun with a live sandbox resumes at step 3 and trains step 4 as the uninterrupted run did.
    resumed = run_driver(faulty_dir, *agent_args, env=env)
    assert "resuming RL from the checkpoint at step 3 in " in resumed.stdout
    assert compared(records(faulty_dir)) == compared(expected)


@pytest.mark.slow  # two launcher runs, 14-36 s on 2 cores
def test_a_nan_gradient_skips_its_update_and_too_many_in_a_row_stop_the_run(tmp_path, compile_cache_env):
    """NaN sampler log-probs at steps 2, 4 and 5 (rl.max_nonfinite_steps=2): step 2's update is skipped
    (parameters and optimizer state as after step 1), step 3 trains, steps 4-5 stop the run."""
    done = run_driver(tmp_path, "--nan_steps=2,4,5", "--steps=6", "--config.rl.max_nonfinite_steps=2",
                      "--config.rl.prompts_per_step=6", env=compile_cache_env, expect=FAULT_EXIT)
    checkpoints = (tmp_path / "checkpoints").resolve()
    assert last_line(done) == (
        "error: 2 steps in a row (to step 5) had a non-finite loss or gradient and skipped their updates "
        f"(rl.max_nonfinite_steps=2); the checkpoint of step 5 in {checkpoints} holds the parameters of step "
        "3, the last applied update")
    got = records(tmp_path)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5]
    assert [r["update_skipped"] for r in got] == [0, 1, 0, 1, 1]
    assert all(r["selected"] > 0 for r in got)  # every step had something to train on
    assert np.isnan(got[1]["grad_norm"]) and np.isfinite(got[2]["grad_norm"])
    skipped = [line for line in done.stdout.splitlines() if "update skipped" in line]
    assert [line.split(" (")[0] for line in skipped] == ["rl step 2/6", "rl step 4/6", "rl step 5/6"]
    states = {step: restored(checkpoints, step) for step in (1, 2, 3, 5)}
    leaves = {step: jax.tree.leaves({"params": s.state["params"], "opt": s.state["opt_state"]})
              for step, s in states.items()}
    for a, b in zip(leaves[1], leaves[2], strict=True):  # step 2 changed nothing but the step counter
        np.testing.assert_array_equal(a, b)
    assert not all(np.array_equal(a, b) for a, b in zip(leaves[2], leaves[3], strict=True))  # step 3 trained
    for a, b in zip(leaves[3], leaves[5], strict=True):
        np.testing.assert_array_equal(a, b)
    assert [states[s].meta["nonfinite_in_a_row"] for s in (1, 2, 3, 5)] == [0, 1, 0, 2]


@pytest.mark.slow  # a launcher run, 14-25 s on 2 cores
def test_a_checkpoint_write_failing_half_way_keeps_the_previous_one(tmp_path, compile_cache_env):
    """Step 3's checkpoint runs out of disk while writing its JSON record (after its arrays): the run stops
    with one line naming the folder, and the newest checkpoint, the one a resume uses, is step 2's."""
    done = run_driver(tmp_path, "--disk_full_at_step=3", "--config.rl.prompts_per_step=6",  # the NaN run's
                      env=compile_cache_env, expect=FAULT_EXIT)  # shapes: its compiled step is cached
    checkpoints = (tmp_path / "checkpoints").resolve()
    assert last_line(done) == (
        f"error: writing checkpoint {checkpoints / '3'} failed (OSError: [Errno 28] No space left on device: "
        f"'{checkpoints / '3.orbax-checkpoint-tmp' / 'meta.orbax-checkpoint-tmp' / 'metadata'}'); checkpoint "
        f"{checkpoints / '2'} is the one a resume uses")
    assert (checkpoints / "3.orbax-checkpoint-tmp").is_dir()  # the half-written folder, ignored
    assert Checkpointer(checkpoints).latest_step == 2
    assert len(restored(checkpoints, 2).meta["history"]) == 2


def test_the_launcher_restarts_the_sandbox_it_started_and_not_one_it_was_given(monkeypatch):
    """``experiments.train_rl`` with no sandbox_url starts a sandbox and hands its restart to the rollout's
    outage policy (tests/agent/test_outage.py restarts one), with the configured outage budget."""
    import sandbox_server
    from experiments.configs import tiny_cpu
    from experiments.train_rl import agent_rollout_fn
    from rstar2jax.train import parse

    started = []

    @contextlib.contextmanager
    def start_local(**options):
        started.append(sandbox_server.LocalServer("http://127.0.0.1:1", None, ""))
        yield started[-1]

    monkeypatch.setattr(sandbox_server, "start_local", start_local)
    config = tiny_cpu.get_config()
    config.rollout.sandbox_outage_s = 42.0
    with contextlib.ExitStack() as stack:
        owned = agent_rollout_fn(parse(config), stack)
        config.rollout.sandbox_url = "http://127.0.0.1:2"
        given = agent_rollout_fn(parse(config), stack)
    assert owned.outage.budget_s == given.outage.budget_s == 42.0 and len(started) == 1
    assert owned.outage.restart == started[0].restart_if_dead and owned.sandbox.urls == ["http://127.0.0.1:1"]
    assert given.outage.restart is None and given.sandbox.urls == ["http://127.0.0.1:2"]


def test_a_step_left_with_no_trajectory_is_not_counted(tiny_model):
    """Every trajectory of a step failed for the sandbox's reasons (a rollout that dropped them all): the
    iteration stops before any update, rather than training on an empty batch and counting the step."""
    config, params = tiny_model
    state = init_train_state(copy_tree(params), make_optimizer(), 0)
    problems = [Problem("a", "1 + 1?", "2"), Problem("b", "2 + 2?", "4")]

    def all_dropped(params, problems, **options):
        all_dropped.last_stats = {"trajectories_dropped_for_sandbox_failures": 8}
        return []

    def no_update(state, batch):
        raise AssertionError("no update may run")

    lost = r"^the rollout of step 1 left no trajectory to train on for its 2 problems \(\{'trajectories_drop"
    with pytest.raises(EmptyRollout, match=lost):
        rl_iteration(state, problems, rollout_fn=all_dropped, rl_step=no_update,
                     config=RLIterationConfig(samples_per_problem=4, keep=2, seq_len=32),
                     max_response_length=16, max_turns=2)
    assert int(state.step) == 0
