"""Orbax checkpoints of a training run: the ``TrainState`` plus a JSON record of everything else a resumed run
needs to continue exactly (stage, step inside the stage, data-iterator position, metrics history).

Saves are asynchronous (the device-to-host copy happens before ``save`` returns, so the state can be donated
to the next step right away); a save interrupted by a crash leaves a temporary folder that restore ignores.
A save that fails (a full disk, a write error) raises :class:`CheckpointWriteError` naming the step folder it
was writing, at the next ``save``, ``wait`` or ``close`` when it ran in the background; the checkpoints
written before it stay, and a resume uses the newest of them.
A latest checkpoint that cannot be read (a partial or damaged step folder: missing or truncated files, a
broken JSON record) is reported in one line and moved aside to ``<step>.unreadable``, and the next older one
is restored instead.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import jax
import orbax.checkpoint as ocp

from rstar2jax.train.state import TrainState

logger = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint could not be restored or written; the one-line message names its folder and the cause."""


class CheckpointWriteError(CheckpointError):
    """Writing a checkpoint failed; the message names the folder, the cause and the checkpoint a resume
    uses instead."""


def _one_line(error: BaseException, limit: int = 200) -> str:
    """``Type: first line of the message``, cut to ``limit`` characters."""
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Checkpointer:
    """Saves every ``save_every`` steps (and when forced, e.g. at exit), keeps the last ``keep``, restores.

    Args:
      directory: where step folders go (created if missing).
      save_every: save on steps that are multiples of this (``save(..., force=True)`` saves regardless).
      keep: how many of the latest checkpoints to keep.
      async_save: write in a background thread.
    """

    def __init__(
        self, directory: str | os.PathLike, *, save_every: int = 10, keep: int = 3, async_save: bool = True
    ):
        if save_every <= 0 or keep <= 0:
            raise ValueError(f"save_every ({save_every}) and keep ({keep}) must be positive")
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=save_every,
            max_to_keep=keep,
            enable_async_checkpointing=async_save,
            create=True,
        )
        self._manager = ocp.CheckpointManager(
            os.path.abspath(directory), options=options, item_names=("state", "meta")
        )
        self._writing: int | None = None  # the step whose save may still be running in the background
        self.write_failed = False  # a save failed: later saves would write on the same broken storage

    @property
    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def save(self, step: int, state: TrainState, meta: dict[str, Any], *, force: bool = False) -> bool:
        """Saves ``state`` and JSON-serialisable ``meta`` as checkpoint ``step`` if due; True when saved."""
        if (
            self._manager.latest_step() == step
        ):  # already saved (e.g. the exit save right after a periodic one)
            return False
        if not (force or self._manager.should_save(step)):
            return False
        self._finish()  # (orbax waits for it too): a failure of that save names its own step
        try:
            saved = self._manager.save(
                step,
                args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
                force=force,
            )
        except Exception as error:  # orbax / tensorstore / the file system raise many kinds
            raise self._write_error(step, error) from error
        self._writing = step if saved else None
        return saved

    def _finish(self) -> None:
        """Waits for the background save; its failure raises ``CheckpointWriteError`` naming its step."""
        step, self._writing = self._writing, None
        try:
            self._manager.wait_until_finished()
        except Exception as error:
            raise self._write_error(step, error) from error

    def _write_error(self, step: int | None, error: BaseException) -> CheckpointWriteError:
        self.write_failed = True
        self._manager.reload()  # the failed step is not a checkpoint
        latest = self._manager.latest_step()
        kept = (
            f"checkpoint {os.path.join(self.directory, str(latest))} is the one a resume uses"
            if latest is not None
            else "no checkpoint was written before it: a rerun starts afresh"
        )
        folder = os.path.join(self.directory, str(step) if step is not None else "<step>")
        return CheckpointWriteError(f"writing checkpoint {folder} failed ({_one_line(error)}); {kept}")

    def latest_meta(self) -> dict | None:
        """The JSON record of the newest checkpoint (None: no checkpoint, or its record is unreadable, which
        ``restore`` then reports): what a run checks before restoring a state shaped by its config."""
        step = self._manager.latest_step()
        if step is None:
            return None
        try:
            return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
        except Exception:  # a damaged record: restore reports it and falls back
            return None

    def restore(self, abstract_state: TrainState, step: int | None = None) -> tuple[TrainState, dict] | None:
        """The state (placed as ``abstract_state``'s shardings) and meta of ``step`` (default: the newest
        readable checkpoint), or None when there is no checkpoint yet.

        Without ``step``, a checkpoint that fails to restore is reported in one warning line, renamed to
        ``<step>.unreadable`` (by process 0; kept for inspection, out of the way of later saves) and the next
        older one is tried. Raises ``CheckpointError`` (one line, naming the folder) when ``step`` is given
        and unreadable, or when no checkpoint is readable.
        """
        steps = sorted(self._manager.all_steps(), reverse=True) if step is None else [step]
        if not steps:
            return None
        unreadable = []
        for candidate in steps:
            try:
                restored = self._manager.restore(
                    candidate,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()
                    ),
                )
            except Exception as error:  # orbax / tensorstore / json raise many kinds for damaged files
                folder = os.path.join(self.directory, str(candidate))
                if step is not None:
                    raise CheckpointError(f"checkpoint {folder} is unreadable: {_one_line(error)}") from error
                unreadable.append(candidate)
                logger.warning(
                    "checkpoint %s is unreadable (%s); moved to %s.unreadable, trying an older one",
                    folder, _one_line(error), folder,
                )
                if jax.process_index() == 0:
                    os.replace(folder, f"{folder}.unreadable")
                continue
            if unreadable:
                self._manager.reload()
            return restored.state, restored.meta
        self._manager.reload()
        raise CheckpointError(
            f"no readable checkpoint in {self.directory}: steps {unreadable} failed to restore (moved to "
            f"<step>.unreadable); remove the folder or set another workdir to start afresh"
        )

    @property
    def directory(self) -> str:
        return os.fspath(self._manager.directory)

    def wait(self) -> None:
        """Blocks until pending asynchronous saves are on disk (``CheckpointWriteError`` if one failed)."""
        self._finish()

    def close(self) -> None:
        try:
            self._finish()
        finally:
            self._manager.close()
            if self.write_failed:
                _join_orbax_writers()


def _join_orbax_writers(timeout_s: float = 30.0) -> None:
    """After a failed save: orbax stops waiting for a save at its first failed writer and leaves the others
    running; let them end now (within ``timeout_s``), so none outlives the process's thread pools (it would
    print a traceback after the run's one-line error)."""
    deadline = time.monotonic() + timeout_s
    for thread in threading.enumerate():
        if type(thread).__module__.startswith("orbax.") and thread is not threading.current_thread():
            thread.join(max(0.0, deadline - time.monotonic()))


def abstract_like(state: TrainState) -> TrainState:
    """``ShapeDtypeStruct`` (with sharding) of every leaf: a restore target shaped like ``state``."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
