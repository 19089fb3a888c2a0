"""``experiments.bench_async``'s cheap parts: the answer reward both sides score with, the table and its JSON
line, and bad command lines refused in one line before anything is built (the measurements themselves are
the benchmark's, not the suite's)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from experiments.bench_async import Table, answer_reward, timed_steps


def test_answer_reward_takes_the_last_integer():
    assert answer_reward("so 12 then 42", "42") == 1.0
    assert answer_reward("42 then 12", "42") == 0.0
    assert answer_reward("x = -7", "-7") == 1.0
    assert answer_reward("420", "42") == 0.0
    assert answer_reward("no number here", "42") == 0.0


def test_table_rows_and_json_keys(capsys):
    table = Table()
    table.add("a ratio", 12.34567, ">= 10", key="ratio")
    table.add("a count", 3, key="count")
    table.add("a note", "1 / 2")
    table.print()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["what", "value", "goal"]
    assert lines[2].split() == ["a", "ratio", "12.346", ">=", "10"]
    assert lines[4].split() == ["a", "note", "1", "/", "2"]
    assert table.figures == {"ratio": 12.346, "count": 3}
    assert json.loads(json.dumps(table.figures)) == table.figures


def test_timed_steps_leave_out_the_first_and_compiling_steps():
    result = {"step_s": [9.0, 1.0, 5.0, 1.1], "compile_s": [8.0, 0.0, 4.0, 0.0]}
    assert timed_steps(result, "ours") == [1, 3]
    with pytest.raises(SystemExit) as stopped:
        timed_steps({"step_s": [9.0, 5.0], "compile_s": [8.0, 4.0]}, "ours")
    assert stopped.value.code == 2


@pytest.mark.parametrize(
    "args, message",
    [
        (["--parts=nope"], "--parts: unknown"),
        (["--steps=0"], "--steps must be >= 1"),
        (["--trl_path=/nonexistent"], "holds no trl package"),
    ],
)
def test_bad_command_lines_exit_2_in_one_line(args, message):
    done = subprocess.run([sys.executable, "-m", "experiments.bench_async", *args], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [done.stderr.strip()] and message in done.stderr
    assert done.stderr.startswith("error: ")
