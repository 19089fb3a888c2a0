"""Step progress of a training loop on the console: a tqdm bar on a terminal, else short log lines."""

from __future__ import annotations

import logging
import sys
import time

from rstar2jax.train.faults import UPDATE_SKIPPED

logger = logging.getLogger(__name__)


#: What the RL progress line adds when it happened (see ``Progress``).
RL_ALERTS = (
    ("rollout/sandbox_outage_s", "sandbox down {:.1f} s"),
    ("rollout/sandbox_retried_calls", "{:g} sandbox calls retried"),
    ("rollout/sandbox_restarts", "sandbox restarts {:g}"),
    ("rollout/trajectories_dropped_for_sandbox_failures", "{:g} trajectories dropped for sandbox failures"),
    (UPDATE_SKIPPED, "update skipped (non-finite loss or gradient)"),
)


class Progress:
    """Step progress of the main process: a tqdm bar on a terminal; elsewhere (a log file, a pipe) one short
    line every ``logging.progress_every`` steps and at the last step, never a bar's carriage returns.

    Lines read ``rl step 12/20 (stage 'stage1' 2/10): reward 0.5, accuracy 0.5, 3.2 s/step``. ``alerts``:
    (metric, text with one ``{}`` for its value) shown only when the metric is non-zero; a step with one
    always gets its line (``..., sandbox down 8.2 s, 30 sandbox calls retried, 3.2 s/step``).
    """

    def __init__(
        self,
        run,
        total: int,
        description: str,
        keys: tuple[str, ...],
        alerts: tuple[tuple[str, str], ...] = (),
    ):
        # ``run``: the ``run.Run`` whose logging options, process and step it reads.
        self.total, self.description, self.keys, self.alerts = total, description, keys, alerts
        self.every = run.options.logging.progress_every
        self.enabled = bool(run.options.logging.progress and run.is_main)
        self.bar = None
        self.last_time, self.last_step = time.perf_counter(), run.step
        if self.enabled and sys.stderr.isatty():
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=run.step, desc=description, dynamic_ncols=True)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()

    def update(self, record: dict, where: str = "") -> None:
        shown = {k: record[k] for k in self.keys if k in record}
        notes = [text.format(record[key]) for key, text in self.alerts if record.get(key)]
        step = record["step"]
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix({k: f"{v:.4g}" for k, v in shown.items()})
            if notes:
                self.bar.write(f"{self.description} step {step}: {', '.join(notes)}")
            return
        if not self.enabled or (step % self.every and step != self.total and not notes):
            return
        now = time.perf_counter()
        seconds = (now - self.last_time) / max(step - self.last_step, 1)
        self.last_time, self.last_step = now, step
        values = ", ".join([f"{k} {v:.4g}" for k, v in shown.items()] + notes)
        where = f" ({where})" if where else ""
        line = f"{self.description} step {step}/{self.total}{where}: {values}, {seconds:.3g} s/step"
        logger.info(line)

