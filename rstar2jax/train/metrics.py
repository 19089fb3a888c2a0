"""Per-step metrics to JSONL and TensorBoard (and, with ``logging.wandb``, Weights & Biases:
``rstar2jax.train.wandb_run``), resumable: a resumed run rewrites the JSONL and TensorBoard from the
checkpoint's history, so no step from the crashed attempt after its last checkpoint survives there."""

from __future__ import annotations

import json
import math
import os
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rstar2jax.data.trajectory import Trajectory

#: A run's metrics file and TensorBoard folder, inside its work folder.
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"


def to_python(metrics: Mapping[str, Any]) -> dict[str, float | int]:
    """Scalars (NumPy / JAX / Python) as plain ints and floats, ready for JSON."""
    out = {}
    for key, value in metrics.items():
        array = np.asarray(value)
        if array.shape != ():
            raise ValueError(f"metric {key!r} is not a scalar (shape {array.shape})")
        out[key] = array.item() if array.dtype.kind in "iub" else float(array)
    return out


class MetricsLogger:
    """Appends one JSON object per step to ``<workdir>/metrics.jsonl`` and scalars to TensorBoard.

    Args:
      workdir: run folder; JSONL goes to ``metrics.jsonl``, TensorBoard events to ``tensorboard/``.
      history: the metrics already logged (from a checkpoint); the JSONL is rewritten to exactly these and
        TensorBoard events at later steps are purged.
      tensorboard: also write TensorBoard events.
      enabled: False on non-zero processes of a multi-host run (only process 0 writes).
      wandb: a W&B run (``wandb_run.WandbRun``) that gets every record and the rollout samples too.
    """

    def __init__(
        self,
        workdir: str | os.PathLike,
        *,
        history: Sequence[Mapping[str, Any]] = (),
        tensorboard: bool = True,
        enabled: bool = True,
        wandb=None,
    ):
        self.history: list[dict[str, Any]] = [dict(h) for h in history]
        self._enabled = enabled
        self._writer = None
        self._wandb = wandb if enabled else None
        if not enabled:
            return
        workdir = pathlib.Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        self.path = workdir / METRICS_FILE
        with self.path.open("w", encoding="utf-8") as f:
            f.writelines(json.dumps(h) + "\n" for h in self.history)
        if tensorboard:
            from tensorboardX import SummaryWriter

            next_step = self.history[-1]["step"] + 1 if self.history else 0
            self._writer = SummaryWriter(str(workdir / TENSORBOARD_DIR), purge_step=next_step)

    def log(self, step: int, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """Records ``metrics`` (scalars) of ``step``; returns the record (with ``step``) as stored."""
        record = {"step": int(step), **to_python(metrics)}
        self.history.append(record)
        if self._enabled:
            with self.path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
            if self._writer is not None:
                for key, value in record.items():
                    if key != "step" and math.isfinite(value):
                        self._writer.add_scalar(key, value, step)
                self._writer.flush()
            if self._wandb is not None:
                self._wandb.log(record)
        return record

    def text(self, tag: str, text: str, step: int) -> None:
        """A TensorBoard text entry (nothing without a TensorBoard writer)."""
        if self._writer is not None:
            self._writer.add_text(tag, text, step)

    def log_samples(self, step: int, groups: Sequence[Sequence[Trajectory]]) -> None:
        """A step's rollout groups, one row per sample (``sample_rows``), to W&B as a table (when on)."""
        if self._wandb is not None:
            self._wandb.log_samples(step, sample_rows(groups))

    def close(self) -> None:
        try:
            if self._writer is not None:
                self._writer.close()
        finally:
            if self._wandb is not None:
                self._wandb.close()


def sample_rows(groups: Sequence[Sequence[Trajectory]]) -> list[dict[str, Any]]:
    """One row per rollout of ``groups`` (a step's, each one problem's samples): problem id, sample index,
    reward, answer, turns, tool calls and their outcomes, response tokens (sampled ones apart) and whether
    the response was truncated."""
    return [
        {
            "problem_id": t.problem_id,
            "sample": index,
            "reward": float(t.reward),
            "answer": "" if t.answer is None else str(t.answer),
            "turns": int(t.num_turns),
            "tool_calls": len(t.tool_outcomes),
            "tool_outcomes": " ".join(t.tool_outcomes),
            "response_tokens": len(t.response_ids),
            "sampled_tokens": int(sum(t.loss_mask)),
            "truncated": bool(t.truncated),
        }
        for group in groups
        for index, t in enumerate(group)
    ]
