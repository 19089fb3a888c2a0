"""The asynchronous schedule resumes from any stop with every released group trained once or counted dropped:
a run stopped by ``max_steps`` (eta 0 and 1, where the restored release count once restarted at 0), and a
checkpoint written by the code before the schedule state was a declared value (a committed fixture)."""

import json
import shutil
import subprocess
import sys

import pytest

from rstar2jax.data.problems import Problem
from rstar2jax.schedules.schedule_state import STATE_META_KEY, AsyncState, ScheduleInvariantError
from rstar2jax.train import parse, train_rl
from tests.conftest import REPO_ROOT
from tests.train.scripted import make_async_scripted_rollout, set_fields, tiny_rl_config

FIXTURE = REPO_ROOT / "tests/train/fixtures/async_eta1_stopped_at_1"


def _options(workdir, eta: int, placement: str = "colocated"):
    fields = {"rl.schedule": "async", "rl.max_staleness": eta, "checkpoint.keep": 2,
              "logging.tensorboard": False, "rl.placement": placement}
    if eta == 0:
        fields["rl.off_policy_correction"] = "none"
    return parse(set_fields(tiny_rl_config(str(workdir)), fields))


def _accounted(history, steps: int) -> dict:
    """The last record's group counts, checked: every released group trained once or dropped."""
    last = history[-1]
    assert [r["step"] for r in history] == list(range(1, steps + 1))
    released, trained = last["async/groups_released_total"], last["async/groups_trained_total"]
    assert released == trained + last["async/groups_dropped_total"]
    return {"released": released, "trained": trained,
            "stage_end": last['async/groups_dropped_total{reason="stage_end"}']}


@pytest.mark.parametrize("eta, placement", [(0, "colocated"), (1, "split")])
def test_a_run_stopped_by_max_steps_resumes_to_the_stage_end(tmp_path, eta, placement):
    """Stopped after step 1 with nothing waiting (colocated at eta 0, split at eta 1), rerun to the stage's
    end: no group released twice (the eta 0 run used to stop with "N groups are due at version 1, more than
    a batch", the eta 1 one at step 3) and none left over at the stage end. Then killed before step 3's
    checkpoint landed and rerun: the rollout record lists every trained group once, with its step."""
    options = _options(tmp_path, eta, placement)
    first = train_rl(options, rollout_fn=make_async_scripted_rollout(), max_steps=1)
    assert _accounted(first, 1) == {"released": 3, "trained": 3, "stage_end": 0}  # no more than it trains
    history = train_rl(options, rollout_fn=make_async_scripted_rollout(), max_steps=3)
    assert _accounted(history, 3) == {"released": 9, "trained": 9, "stage_end": 0}
    assert all(r["staleness/max"] <= eta for r in history if "staleness/max" in r)
    shutil.rmtree(tmp_path / "checkpoints" / "3")  # killed before step 3's checkpoint was written
    (tmp_path / "rollouts" / "step_000004.jsonl").write_text("{}\n")  # and after a step 4 it recorded
    history = train_rl(options, rollout_fn=make_async_scripted_rollout(), max_steps=3)
    assert _accounted(history, 3) == {"released": 9, "trained": 9, "stage_end": 0}
    lines = [json.loads(line) for step in (1, 2, 3)
             for line in (tmp_path / "rollouts" / f"step_{step:06d}.jsonl").read_text().splitlines()]
    assert [sum(r["step"] == s for r in lines) for s in (1, 2, 3)] == [3, 3, 3]
    assert len({(r["step"], r["problem_id"]) for r in lines}) == 9
    assert not (tmp_path / "rollouts" / "step_000004.jsonl").exists()
    for r in lines:
        assert r["trained_version"] - eta <= r["release_version"] <= r["trained_version"] == r["step"] - 1
        assert len(r["samples"]) == 4 and sum(s["roc_kept"] for s in r["samples"]) in (0, 2)
        for sample in r["samples"]:
            assert len(sample["policy_versions"]) == len(sample["response_ids"]) == len(sample["logprobs"])


def test_a_checkpoint_written_before_the_state_value_resumes(tmp_path):
    """The fixture (``tests/train/fixtures/README.md``) stopped after step 1 with batch 1's groups finished
    and waiting in its pickled carry: the resumed run trains them (no group issued again) and ends the stage
    with every group trained once."""
    workdir = tmp_path / "run"
    shutil.copytree(FIXTURE, workdir)
    rollout = make_async_scripted_rollout()
    history = train_rl(_options(workdir, 1), rollout_fn=rollout, max_steps=3)
    assert history[0] == json.loads((FIXTURE / "metrics.jsonl").read_text().splitlines()[0])
    assert _accounted(history, 3) == {"released": 9, "trained": 9, "stage_end": 0}
    assert not any(key[0] < 2 for stream in rollout.streams for key in stream.submitted)


def test_a_broken_schedule_invariant_stops_in_one_line_naming_the_checkpoint(tmp_path):
    """A checkpoint whose schedule state does not belong to its step: the run stops before any work with
    one line naming the invariant and the checkpoint; a launcher says it as one line and exits 1."""
    workdir = tmp_path / "run"
    shutil.copytree(FIXTURE, workdir)
    record = workdir / "checkpoints" / "1" / "meta" / "metadata"
    meta = json.loads(record.read_text())
    state, _ = AsyncState().release([Problem("p", "q", "1")], seed=0, version=0, processes=1)
    meta["schedule"] = {STATE_META_KEY: state.to_dict()}  # a batch waits, none consumed: not step 1's
    record.write_text(json.dumps(meta))
    with pytest.raises(ScheduleInvariantError) as raised:
        train_rl(_options(workdir, 1), rollout_fn=make_async_scripted_rollout())
    message = str(raised.value)
    assert "\n" not in message and "belongs to its checkpoint's step" in message
    assert f"resume from the checkpoint of step 1 in {workdir / 'checkpoints'}" in message

    launcher = ("from experiments import _launch\n"
                "from rstar2jax.train import ScheduleInvariantError\n"
                "def main(argv):\n"
                f"    raise ScheduleInvariantError({raised.value.invariant!r}, {raised.value.detail!r})\n"
                "_launch.run(main)\n")
    done = subprocess.run([sys.executable, "-c", launcher], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1 and done.stderr.strip() == f"error: {message}", done.stderr[-2000:]
