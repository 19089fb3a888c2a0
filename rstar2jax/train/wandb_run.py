"""Weights & Biases as an optional logger of a run (``config.logging.wandb``; ``pip install -e '.[wandb]'``).

Process 0 opens one W&B run in the work folder (its local files under ``<workdir>/wandb/``) with the run
config, then gets every metrics record the JSONL gets (its ``step`` the x-axis) and each RL step's rollout
samples as a table. The run's id is kept in ``<workdir>/wandb_run_id``, so a resumed run continues the same
W&B run. ``WANDB_MODE=offline`` writes the local files only (``wandb sync`` uploads them later).

A resumed run's records from its checkpoint on come again: W&B keeps the steps the stopped attempt logged
past its last checkpoint, so such a step shows two points at the same ``step`` (the JSONL keeps only the
resumed run's).
"""

from __future__ import annotations

import json
import pathlib
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from rstar2jax.config.options import ConfigError, RunOptions

#: The W&B run id of the run in a work folder (what a resumed run continues).
RUN_ID_FILE = "wandb_run_id"
#: The W&B key of each RL step's rollout samples table.
SAMPLES_KEY = "rollout/samples"


def check_wandb(options: RunOptions) -> None:
    """Before any work: a ``ConfigError`` when ``logging.wandb`` names a project but the ``wandb`` package
    is not installed."""
    project = options.logging.wandb.project
    if not project:
        return
    try:
        import wandb  # noqa: F401, PLC0415
    except ImportError:
        raise ConfigError(f"config.logging.wandb.project={project!r}: the wandb package is not installed "
                          "(pip install -e '.[wandb]', or set logging.wandb.project='')") from None


def run_id(workdir: pathlib.Path) -> str:
    """The W&B run id of ``workdir``'s run: the one it recorded, else a new one, recorded now."""
    path = workdir / RUN_ID_FILE
    if path.exists():
        return path.read_text(encoding="utf-8").strip()
    workdir.mkdir(parents=True, exist_ok=True)
    new = secrets.token_hex(4)
    path.write_text(new + "\n", encoding="utf-8")
    return new


class WandbRun:
    """The W&B run of ``options``'s run in ``workdir``: opened now, continued when ``workdir`` records
    one."""

    def __init__(self, options: RunOptions, workdir: pathlib.Path):
        check_wandb(options)
        import wandb  # noqa: PLC0415

        settings = options.logging.wandb
        self._wandb = wandb
        self.run = wandb.init(
            project=settings.project,
            entity=settings.entity or None,
            name=settings.name or workdir.name,
            tags=list(settings.tags),
            config=json.loads(options.record),
            id=run_id(workdir),
            resume="allow",
            dir=str(workdir),
            settings=wandb.Settings(console="off"),  # the launcher's output stays the terminal's only
        )
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, record: Mapping[str, Any]) -> None:
        """One metrics record (with its ``step``), as the JSONL has it."""
        self.run.log(dict(record))

    def log_samples(self, step: int, rows: Sequence[Mapping[str, Any]]) -> None:
        """A step's rollout samples (``rows``: one mapping per sample, the same keys in each) as a table."""
        if not rows:
            return
        columns = list(rows[0])
        table = self._wandb.Table(columns=columns, data=[[row[c] for c in columns] for row in rows])
        self.run.log({"step": int(step), SAMPLES_KEY: table})

    def close(self) -> None:
        self.run.finish()
