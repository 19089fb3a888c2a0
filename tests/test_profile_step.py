"""experiments.profile_step: the batch-1 decode step's split from a real trace and XLA dump."""

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT


@pytest.mark.slow  # compiles the 152k-vocabulary comparison shape's step: a minute or two here
def test_profile_step_splits_the_decode_step(tmp_path):
    command = [sys.executable, "-m", "experiments.profile_step", "--chunks=1", f"--out={tmp_path}"]
    result = subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    parts = ("head matmul", "layers", "attention", "sampling + log-probs", "bookkeeping")
    assert all(figures[part] > 0 and 0 < figures[f"fastest_{part}"] <= figures[part] for part in parts)
    # The thunks and the rest add up to the traced step; the 155 MB head is its largest part.
    total = sum(figures[part] for part in (*parts, "host"))
    assert total == pytest.approx(figures["traced_step_ms"], abs=0.01)
    assert figures["head matmul"] == max(figures[part] for part in parts)
