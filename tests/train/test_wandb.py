"""Weights & Biases as an optional logger (``config.logging.wandb``, issue 54): offline
(``WANDB_MODE=offline``: local run files only, no network) a run logs its config, every metrics record the
JSONL gets and each step's rollout samples as a table; a resumed run continues the same W&B run; only
process 0 logs; a missing ``wandb`` package is one line before any work."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from rstar2jax.config.options import ConfigError
from rstar2jax.train import parse, train_rl
from rstar2jax.train.metrics import METRICS_FILE, MetricsLogger, sample_rows
from rstar2jax.train.wandb_run import RUN_ID_FILE, WandbRun
from tests.conftest import REPO_ROOT
from tests.train.scripted import make_scripted_rollout, tiny_rl_config

pytest.importorskip("wandb")  # the `test` extra installs it; the library runs without it


def _config(workdir: pathlib.Path):
    config = tiny_rl_config(str(workdir))
    config.logging.wandb.project = "rstar2jax-tests"
    config.logging.wandb.tags = ("ci", "tiny")
    config.logging.tensorboard = False
    return config


def test_offline_run_logs_config_metrics_and_samples_and_a_resume_continues_it(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    workdir = tmp_path / "run"
    options = parse(_config(workdir))
    [record] = train_rl(options, rollout_fn=make_scripted_rollout(), max_steps=1)
    run_id = (workdir / RUN_ID_FILE).read_text().strip()
    WandbRun(options, workdir).close()  # what a resumed run opens: the same W&B run
    attempts = sorted((workdir / "wandb").glob(f"offline-run-*-{run_id}"))
    assert len(attempts) == 2, list((workdir / "wandb").iterdir())
    assert [json.loads(line) for line in (workdir / METRICS_FILE).read_text().splitlines()] == [record]
    # The run file holds the run's records: every metric name the JSONL has, the config's fields, the tags.
    logged = (attempts[0] / f"run-{run_id}.wandb").read_bytes()
    assert not [key for key in record if key.encode() not in logged]
    assert b"samples_per_problem" in logged and b"rstar2jax-tests" in logged and b"tiny" in logged
    # The step's rollout samples: a row per trajectory of its 3 problems x 4 samples.
    [table] = (attempts[0] / "files" / "media" / "table" / "rollout").glob("samples_*.table.json")
    samples = json.loads(table.read_text())
    assert samples["columns"][:3] == ["problem_id", "sample", "reward"] and len(samples["data"]) == 12
    assert sorted({row[1] for row in samples["data"]}) == [0, 1, 2, 3]
    assert sum(row[2] for row in samples["data"]) / 12 == pytest.approx(record["reward"])


class _Recorder:
    def __init__(self):
        self.calls = []

    def log(self, record):
        self.calls.append(("log", record["step"]))

    def log_samples(self, step, rows):
        self.calls.append(("samples", step, len(rows)))

    def close(self):
        self.calls.append(("close",))


def test_only_process_0_logs(tmp_path):
    rollout = make_scripted_rollout()
    groups = [rollout(None, [problem], samples_per_problem=2, max_response_length=8, max_turns=2, seed=0)
              for problem in _problems()]
    for enabled in (True, False):
        sink = _Recorder()
        logger = MetricsLogger(tmp_path / str(enabled), tensorboard=False, enabled=enabled, wandb=sink)
        logger.log(1, {"loss": 0.5})
        logger.log_samples(1, groups)
        logger.close()
        assert sink.calls == ([("log", 1), ("samples", 1, 4), ("close",)] if enabled else [])
    assert sample_rows(groups)[1]["sample"] == 1 and len(sample_rows(groups)) == 4


def _problems():
    from rstar2jax.data.problems import Problem

    return [Problem(id="p1", problem="1 + 1?", answer="2"), Problem(id="p2", problem="2 + 2?", answer="4")]


def test_a_missing_wandb_package_is_one_line_and_exit_2_before_any_work(tmp_path):
    """The package hidden (a ``wandb`` module that fails to import, first on the path): the launcher stops
    at its config check, before the processes join or anything is written."""
    hidden = tmp_path / "hidden"
    hidden.mkdir()
    (hidden / "wandb.py").write_text("raise ImportError('No module named wandb')\n")
    workdir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "experiments.train_rl", "--config=experiments/configs/tiny_cpu.py",
         f"--config.workdir={workdir}", "--config.logging.wandb.project=lab", "--compilation_cache_dir="],
        env={**_environment(), "PYTHONPATH": f"{hidden}:{REPO_ROOT}"}, cwd=REPO_ROOT, capture_output=True,
        text=True, timeout=120,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.strip() == (
        "error: config.logging.wandb.project='lab': the wandb package is not installed (pip install -e "
        "'.[wandb]', or set logging.wandb.project='')"
    )
    assert not workdir.exists()


def test_the_library_refuses_a_missing_wandb_before_any_work(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb: ImportError
    options = parse(_config(tmp_path / "run"))
    with pytest.raises(ConfigError, match=r"^config.logging.wandb.project='rstar2jax-tests': the wandb"):
        train_rl(options, rollout_fn=make_scripted_rollout())
    assert not (tmp_path / "run").exists()


def _environment() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
