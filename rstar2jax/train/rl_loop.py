"""The staged GRPO-RoC recipe behind ``experiments.train_rl``: stages, their data and hard-problem filter,
the RL steps with exact resume (see ``rstar2jax.train.run`` for what the checkpoint keeps)."""

from __future__ import annotations

import contextlib
import logging

from rstar2jax.config.options import ConfigError, RunOptions
from rstar2jax.config.rules import precision_gap
from rstar2jax.data.problems import Problem, ProblemIterator, load_problems
from rstar2jax.engine.seeds import stream_seed
from rstar2jax.policy.weights import CHECKPOINT_DIR
from rstar2jax.schedules import colocate
from rstar2jax.schedules.placement import rollout_devices
from rstar2jax.schedules.schedule import RolloutFn, RolloutSchedule
from rstar2jax.schedules.schedule_choice import make_schedule
from rstar2jax.schedules.schedule_state import ScheduleInvariantError
from rstar2jax.train.faults import NonFiniteStreak
from rstar2jax.train.progress import RL_ALERTS, Progress
from rstar2jax.train.rl import filter_hard_problems, rl_iteration
from rstar2jax.train.rollout_record import RolloutRecord, StepRollouts, auto_fraction
from rstar2jax.train.run import Run, StopSignal, start_run
from rstar2jax.train.runtime import check_rollout_precision
from rstar2jax.train.selection import RewardFn
from rstar2jax.train.state import optimizer_from_options, schedule_from_options
from rstar2jax.train.steps import batch_sharding, make_rl_step
from rstar2jax.train.wandb_run import check_wandb

logger = logging.getLogger(__name__)
#: What the progress line adds under the asynchronous schedule: the producer's and trainer's busy fractions,
#: finished groups waiting, the oldest trained token's lag, tokens generated per second.
ASYNC_PROGRESS_KEYS = ("async/rollout_busy", "async/trainer_busy", "async/buffer_depth", "staleness/max",
                       "throughput/generated_tokens_per_s")


def _stage_problems(
    options: RunOptions, index: int, previous: list[Problem] | None
) -> tuple[list[Problem], dict]:
    """Stage ``index``'s dataset (before its filter): its own, else the previous stage's, else ``data``'s."""
    s, d = options.stages[index], options.data
    if not s.dataset and previous is not None:
        return previous, {}
    loaded = load_problems(
        s.dataset or d.source,
        split=d.split,
        problem_field=d.problem_field,
        answer_field=d.answer_field,
        solution_field=d.solution_field,
        id_field=d.id_field,
        integer_only=d.integer_only,
        limit=d.limit,
    )
    if not loaded.problems:
        where = f"stages[{index}].dataset={s.dataset!r}" if s.dataset else f"data.source={d.source!r}"
        where = f"config.{where}"
        raise ConfigError(f"{where}: no usable problems for stage {s.name!r} ({dict(loaded.skipped)})")
    return loaded.problems, {f"data_skipped/{k}": v for k, v in loaded.skipped.items()}


def _hard_problems(run: Run, index: int, problems: list[Problem], rollout_fn: RolloutFn) -> list[Problem]:
    """Stage ``index``'s problems after its hard-problem filter (kept ids live in the host state)."""
    s = run.options.stages[index]
    if not s.hard_filter_rollouts:
        return problems
    if run.host.problem_ids is None:
        kept, stats = filter_hard_problems(
            run.state.params,
            problems,
            rollout_fn=rollout_fn,
            num_rollouts=s.hard_filter_rollouts,
            batch_size=run.options.rl.filter_batch_size,
            max_response_length=s.max_response_length,
            max_turns=s.max_turns,
            seed=stream_seed(run.options.seed, "hard_filter", index),
            policy_version=run.step,
        )
        if not kept:
            raise ValueError(f"stage {s.name!r}: the hard-problem filter dropped every problem ({stats})")
        run.host = run.host.replace(problem_ids=tuple(p.id for p in kept))
        logger.info("stage %s: hard-problem filter kept %d of %d problems", s.name, len(kept), len(problems))
    keep = set(run.host.problem_ids)
    return [p for p in problems if p.id in keep]


class _RLStages:
    """The RL loop's parts that stay across its stages: the run, its step and rollout functions, the
    rollout schedule, the non-finite streak and the progress line."""

    def __init__(self, run: Run, step_fn, rollout_fn: RolloutFn, reward_fn: RewardFn | None, total: int,
                 schedule: RolloutSchedule):
        loop = run.options.rl
        self.run, self.step_fn, self.rollout_fn, self.reward_fn, self.total = (
            run, step_fn, rollout_fn, reward_fn, total)
        # Asynchronous: the trainer updates while the engine runs, so the moments never leave the device.
        self.offload = loop.schedule != "async" and colocate.resolve_offload(loop.optimizer_memory)
        self.schedule = schedule
        self.streak = NonFiniteStreak(loop.max_nonfinite_steps, run.host.nonfinite_in_a_row)
        self.record = _rollout_record(run)

    def stage(self, index: int, dataset: list[Problem], data_metrics: dict, progress: Progress) -> None:
        """Runs stage ``index`` from where the run stands (its start, or the resumed step)."""
        run, options = self.run, self.run.options
        s, start = options.stages[index], run.host.stage_start
        if run.step == start and s.reset_optimizer:
            run.reset_optimizer()
        iterator = ProblemIterator(
            _hard_problems(run, index, dataset, self.rollout_fn),
            options.rl.prompts_per_step,
            seed=stream_seed(options.seed, "problem_order", index),
            position=run.host.position,
        )
        iteration = options.rl.iterations[index]
        self.schedule.restore(run.host.schedule)
        self.schedule.begin_stage(min(s.steps, self.total - start), run.step - start)
        while run.step - start < s.steps and run.step < self.total:
            if self.offload:  # the moments wait in host memory while the engine runs
                run.state = run.state.replace(opt_state=colocate.to_host(run.state.opt_state))
            # A stage's last step rolls out nothing ahead (max_steps does not count: a run it stopped
            # resumes exactly).
            stage_last = run.step - start + 1 >= s.steps
            trained: list[StepRollouts] = []
            run.state, metrics = rl_iteration(
                run.state,
                self.schedule.draw(iterator, stage_last=stage_last),
                rollout_fn=self.rollout_fn,
                rl_step=self.step_fn,
                config=iteration,
                max_response_length=s.max_response_length,
                max_turns=s.max_turns,
                reward_fn=self.reward_fn,
                num_rows=options.rl.num_rows,
                batch_sharding=batch_sharding(run.mesh),
                schedule=self.schedule,
                record=trained.append,
            )
            self.record.write(trained[0])  # before the step's checkpoint: a step it keeps is on the record
            if stage_last:
                self.schedule.end_stage()  # nothing crosses into the next stage
            record = run.record(
                {"stage": index, **data_metrics, **metrics},
                position=iterator.position,
                nonfinite_in_a_row=self.streak.observe(metrics),
                schedule=self.schedule.checkpoint_meta(),
            )
            run.logger.log_samples(record["step"], [g for g in trained[0].groups if g])
            progress.update(record, f"stage {s.name!r} {run.step - start}/{s.steps}")
            self.streak.check(run.step, run.workdir / CHECKPOINT_DIR)
            run.stop_if_requested()


def _rollout_record(run: Run) -> RolloutRecord:
    """The run's rollout record (``logging.rollout_record``): its text decoded with the policy's tokenizer
    when it has one, a few samples per step as TensorBoard text."""
    options = run.options
    fraction = options.logging.rollout_record
    if fraction is None:
        samples = max(i.samples_per_problem for i in options.rl.iterations)
        fraction = auto_fraction(options.rl.prompts_per_step, samples)
    decode = None
    if fraction > 0 and options.policy.tokenizer and run.is_main:
        from rstar2jax.data.tokenizer import load_tokenizer  # transformers loads only when needed

        tokenizer = load_tokenizer(options.policy.tokenizer)
        decode = tokenizer.decode
    return RolloutRecord(run.workdir, fraction=fraction, resumed_at=run.step, decode=decode,
                         show=run.logger.text, enabled=run.is_main)


def _rollout_precision(run: Run) -> str:
    """How the rollout's precision differs from the trainer's ('' when it does not); the warning, once, of a
    run that trains on such a rollout with every rollout correction off."""
    options = run.options
    engine = options.rl.rollout.engine
    gap = precision_gap(engine.weight_dtype, engine.kv_dtype, options.model.compute_dtype)
    if gap and not options.rl.loss.rollout_correction and run.is_main:
        logger.warning(
            "warning: the rollout samples with %s while the trainer computes in %s, and every rollout "
            "correction is off (loss.allow_uncorrected_mismatch=True): the update takes the sampler's tokens "
            "as the trainer's own; mismatch_* in the metrics measure how far apart they are",
            gap, options.model.compute_dtype,
        )
    return gap


@contextlib.contextmanager
def _saying_where_to_resume(run: Run):
    """A broken schedule invariant (a bug) re-raised naming the checkpoint to resume from: the last finished
    step's, which ``run.close`` writes as the run stops."""
    try:
        yield
    except ScheduleInvariantError as error:
        where = f"resume from the checkpoint of step {run.step} in {run.workdir / CHECKPOINT_DIR}"
        raise ScheduleInvariantError(error.invariant, f"{error.detail}; {where}") from error


def _schedule(options: RunOptions, rollout_fn: RolloutFn) -> RolloutSchedule:
    """The rollout schedule of ``options.rl`` (``make_schedule``): a ``ConfigError`` naming what it needs
    and ``rollout_fn`` lacks (a LoRA run's merged rollout has exactly the capabilities of ``rollout_fn``)."""
    rl = options.rl
    return make_schedule(rollout_fn, schedule=rl.schedule, off_policy_steps=rl.off_policy_steps,
                         partial_token_budget=rl.partial_token_budget, prompts_per_step=rl.prompts_per_step,
                         max_staleness=rl.max_staleness, devices=rollout_devices(options),
                         dtype=options.model.compute_dtype, on_update=rl.rollout.on_update)


def train_rl(
    options: RunOptions,
    *,
    rollout_fn: RolloutFn,
    reward_fn: RewardFn | None = None,
    max_steps: int | None = None,
    stop: StopSignal | None = None,
) -> list[dict]:
    """Runs (or resumes) the staged GRPO-RoC recipe of ``options`` (a run config's ``RunOptions``:
    ``rstar2jax.config.parse``); returns the metrics history.

    ``rollout_fn`` produces the trajectories (see ``rstar2jax.schedules.schedule``); ``max_steps`` stops early
    after that many steps in total (for demos and tests); ``stop``: the signal that stops the run after its
    current step (a launcher's Ctrl-C; default: a new one nobody else holds).

    Rollouts across an update (``rl.off_policy_steps`` = 1, ``rollout.partial_token_budget`` > 0; see
    ``rstar2jax.schedules.schedule``): what one step hands to the next (the next step's rollout,
    unfinished rollouts) is kept in the checkpoint's host state (``host_state.HostState.schedule``), so a
    resumed run goes on exactly; it does not cross a stage boundary (a stage's last step rolls out nothing
    ahead, and its unfinished rollouts are dropped: the next stage has its own budget and problems). The
    asynchronous schedule (``rl.schedule="async"``, ``rstar2jax.schedules.async_schedule``) keeps its whole
    state there too (``schedule_state.AsyncState``) and drains at a stage's end; its engines stop when the
    run does. Trained rollouts go on the record (``logging.rollout_record``, ``rollout_record``).
    """
    check_rollout_precision(options)  # before any work: a ConfigError naming the field
    check_wandb(options)
    schedule = _schedule(options, rollout_fn)  # before any work too
    updates = options.rl.updates_per_step  # the optimizer and its schedule count updates
    optimizer = optimizer_from_options(options.optimizer, updates_per_step=updates)
    run = start_run(
        options,
        optimizer,
        schedule_from_options(options.optimizer, updates_per_step=updates),
        stop=stop,
    )
    rl = options.rl
    step_fn = make_rl_step(run.model_config, optimizer, rl.loss, num_microbatches=options.num_microbatches,
                           mesh=run.mesh, shardings=run.shardings, lora=run.lora, ppo_epochs=rl.ppo_epochs,
                           mini_batches=rl.mini_batches)
    if run.base is not None:  # LoRA: the step gets the frozen base, rollouts sample from the merged policy
        step_fn, rollout_fn = run.base.bind(step_fn), run.base.rollout(rollout_fn)
    stages = run.options.stages
    total = run.options.total_steps if max_steps is None else min(max_steps, run.options.total_steps)
    if run.resumed and run.is_main:
        current = stages[min(run.host.stage, len(stages) - 1)]
        logger.info(
            "resuming RL from the checkpoint at step %d in %s: stage %d/%d %r, step %d of %d",
            run.step, run.workdir / CHECKPOINT_DIR, run.host.stage + 1, len(stages),
            current.name, run.step - run.host.stage_start, current.steps,
        )
    loop = _RLStages(run, step_fn, rollout_fn, reward_fn, total, schedule)
    keys = ("reward", "accuracy", "response_length", "grad_norm")
    if options.rl.schedule == "async":
        keys += ASYNC_PROGRESS_KEYS
    if _rollout_precision(run):
        keys += ("mismatch_abs_log_ratio",)
    dataset = None
    with Progress(run, total, "rl", keys, RL_ALERTS) as progress:
        try:
            run.accept_stop_requests()
            for index in range(len(stages)):
                dataset, data_metrics = _stage_problems(run.options, index, dataset)
                if index < run.host.stage:
                    continue
                with _saying_where_to_resume(run):
                    loop.stage(index, dataset, data_metrics, progress)
                if run.step >= total:
                    break
                run.host = run.host.replace(stage=index + 1, stage_start=run.step, position=0,
                                            problem_ids=None)
        finally:
            try:
                loop.schedule.close()  # the asynchronous producer's engines stop
            finally:
                run.close()
    return run.logger.history
