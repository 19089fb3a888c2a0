"""SFT behind ``experiments.sft``: masked cross-entropy on packed sequences, exact resume, policy export."""

from __future__ import annotations

import dataclasses
import logging
import math
import pathlib
import time

import jax

from rstar2jax.config.options import ConfigError, RunOptions
from rstar2jax.data.batch import build_batch
from rstar2jax.data.problems import ProblemIterator
from rstar2jax.data.sft_data import assistant_openers, load_sft_sequences
from rstar2jax.policy.weights import CHECKPOINT_DIR
from rstar2jax.schedules.multihost import put_batch
from rstar2jax.train.progress import Progress
from rstar2jax.train.run import StopSignal, start_run
from rstar2jax.train.state import optimizer_from_options, schedule_from_options
from rstar2jax.train.steps import batch_sharding, make_sft_step
from rstar2jax.train.wandb_run import check_wandb

logger = logging.getLogger(__name__)


def train_sft(
    options: RunOptions,
    *,
    max_steps: int | None = None,
    export_dir: str | pathlib.Path | None = None,
    stop: StopSignal | None = None,
) -> list[dict]:
    """Runs (or resumes) SFT on ``options.sft.data`` (``options``: a run config's ``RunOptions``,
    ``rstar2jax.config.parse``); returns the metrics history.

    ``export_dir``: when the run ends (not when it is interrupted), the policy is written there as an HF
    folder with the tokenizer (``save_policy``), what ``experiments.train_rl --config.model.path=`` starts
    from, and the conversation format: the run's prompt with the assistant opener of the data's chat rows
    (when they share one). ``stop``: the signal that stops the run after its current step (a launcher's
    Ctrl-C; default: a new one nobody else holds).
    """
    from rstar2jax.data.tokenizer import load_tokenizer  # transformers (and torch) load only when needed

    check_wandb(options)  # before any work
    sft = options.sft
    tokenizer_dir = options.policy.tokenizer
    tokenizer = load_tokenizer(tokenizer_dir) if tokenizer_dir else None
    sequences, skipped = load_sft_sequences(sft.data, tokenizer)
    if not sequences:
        raise ConfigError(f"config.sft.data={sft.data!r}: no usable examples ({skipped} skipped)")
    run_steps = sft.steps or sft.epochs * math.ceil(len(sequences) / sft.batch_size)
    total = run_steps if max_steps is None else min(run_steps, max_steps)
    # The schedule spans the whole run, so stopping early (max_steps) and resuming changes nothing.
    optimizer = optimizer_from_options(options.optimizer, total_steps=run_steps)
    schedule = schedule_from_options(options.optimizer, total_steps=run_steps)
    run = start_run(options, optimizer, schedule, stop=stop)
    step_fn = make_sft_step(
        run.model_config,
        optimizer,
        num_microbatches=options.num_microbatches,
        mesh=run.mesh,
        shardings=run.shardings,
        lora=run.lora,
    )
    if run.base is not None:
        step_fn = run.base.bind(step_fn)
    iterator = ProblemIterator(sequences, sft.batch_size, seed=options.seed, position=run.host.position)
    if run.resumed and run.is_main:
        logger.info(
            "resuming SFT from the checkpoint at step %d of %d in %s (epoch %.2f)",
            run.step, total, run.workdir / CHECKPOINT_DIR, iterator.position / len(sequences),
        )
    sharding = batch_sharding(run.mesh)
    with Progress(run, total, "sft", ("loss", "grad_norm")) as progress:
        try:
            run.accept_stop_requests()
            while run.step < total:
                start = time.perf_counter()
                batch = build_batch(next(iterator), seq_len=sft.seq_len, row_multiple=options.row_multiple)
                run.state, metrics = step_fn(run.state, put_batch(batch, sharding))
                metrics = jax.device_get(metrics)
                seconds = time.perf_counter() - start
                record = run.record(
                    {
                        **metrics,
                        "epoch": iterator.position / len(sequences),
                        "examples_skipped": skipped,
                        "time/step": seconds,
                        "throughput/tokens_per_s": float((batch.segment_ids > 0).sum()) / seconds,
                    },
                    position=iterator.position,
                )
                progress.update(record, f"epoch {record['epoch']:.2f}")
                run.stop_if_requested()
        finally:
            run.close()
    if export_dir is not None:
        run.export(export_dir, tokenizer=tokenizer, prompt=_taught_prompt(options))
    return run.logger.history


def _taught_prompt(options: RunOptions):
    """The run's prompt with the assistant opener its SFT data's chat rows share (the opener the policy was
    taught to continue from), or as it is when they share none."""
    openers = assistant_openers(options.sft.data)
    if len(openers) == 1:
        return dataclasses.replace(options.policy.prompt, assistant_opener=openers.pop())
    return options.policy.prompt

