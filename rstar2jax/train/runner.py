"""Training loops behind the launchers: the staged GRPO-RoC recipe and SFT, with exact resume.

Both loops keep everything that decides the next step in the checkpoint (state: params, optimizer, step, RNG;
meta: stage, step inside the stage, data-iterator position, filtered problem ids, metrics history), so a run
killed at any moment and restarted continues with exactly the metrics an uninterrupted run would log.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import pathlib
import signal
import sys
import time
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from rstar2jax import models
from rstar2jax.data.problems import Problem, ProblemIterator, load_problems
from rstar2jax.train import config as config_lib
from rstar2jax.train.batch import Batch, build_batch
from rstar2jax.train.checkpoint import Checkpointer
from rstar2jax.train.metrics import MetricsLogger
from rstar2jax.train.rl import RewardFn, RolloutFn, filter_hard_problems, put_batch, rl_iteration
from rstar2jax.train.runtime import initialize_distributed, mesh_from_config, mesh_size, request_host_devices
from rstar2jax.train.sft_data import load_sft_sequences
from rstar2jax.train.state import TrainState, init_train_state, reset_optimizer
from rstar2jax.train.steps import batch_sharding, make_rl_step, make_sft_step, state_shardings


def model_config_from(config) -> models.ModelConfig:
    """The ``ModelConfig`` of ``config.model`` (an HF folder, an HF config.json or inline fields) with its
    dtype / remat / scan options applied."""
    m = config.model
    options = dict(
        param_dtype=m.param_dtype,
        compute_dtype=m.compute_dtype,
        remat_policy=m.remat_policy,
        scan_layers=m.scan_layers,
    )
    if m.path or m.config_json:
        return models.config_from_hf(m.path or m.config_json, **options)
    return models.ModelConfig(**{**m.spec.to_dict(), **options})


def initial_params(config, model_config: models.ModelConfig, mesh: Mesh):
    """Pretrained weights from ``config.model.path``, else random weights (seeded by ``config.seed``)."""
    if config.model.path:
        _, params = models.load_pretrained(
            config.model.path,
            dtype=model_config.param_dtype,
            compute_dtype=model_config.compute_dtype,
            mesh=mesh,
            remat_policy=model_config.remat_policy,
            scan_layers=model_config.scan_layers,
        )
        return params
    return models.init_params(model_config, jax.random.PRNGKey(config.seed), mesh=mesh)


def abstract_state(model_config, optimizer, shardings: TrainState, seed: int) -> TrainState:
    """Shapes, dtypes and shardings of the train state, without allocating it."""
    shapes = jax.eval_shape(
        lambda: init_train_state(models.init_params(model_config, jax.random.PRNGKey(0)), optimizer, seed)
    )
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)


#: The run's config as JSON, in its work folder: what loads the run's checkpoints without the launcher
#: (``rstar2jax.serve.load_policy`` reads the model and tokenizer from it).
RUN_CONFIG_FILE = "run_config.json"


def write_run_config(workdir: pathlib.Path, config) -> pathlib.Path:
    """Writes ``config`` (an ``ml_collections.ConfigDict``) as ``workdir/run_config.json``."""
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / RUN_CONFIG_FILE
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(config.to_json_best_effort(indent=1), encoding="utf-8")
    temporary.replace(path)
    return path


@dataclasses.dataclass
class Run:
    """What a training loop needs: mesh, model, optimizer, the (restored or fresh) state and its records."""

    config: Any
    workdir: pathlib.Path
    mesh: Mesh
    model_config: models.ModelConfig
    optimizer: optax.GradientTransformation
    schedule: optax.Schedule
    shardings: TrainState
    state: TrainState
    meta: dict
    checkpointer: Checkpointer
    logger: MetricsLogger
    is_main: bool

    @property
    def step(self) -> int:
        return len(self.meta["history"])

    def record(self, metrics: dict, **meta_updates) -> dict:
        """Logs one step's metrics (plus the learning rate it used), updates the resume record and saves a
        checkpoint when one is due."""
        learning_rate = float(self.schedule(self.meta["optimizer_steps"]))
        record = self.logger.log(self.step + 1, {**metrics, "learning_rate": learning_rate})
        self.meta.update(
            meta_updates, history=self.logger.history, optimizer_steps=self.meta["optimizer_steps"] + 1
        )
        self.checkpointer.save(self.step, self.state, self.meta)
        return record

    def reset_optimizer(self) -> None:
        """Fresh optimizer moments and schedule (a stage start with ``reset_optimizer``)."""
        reset = functools.partial(reset_optimizer, optimizer=self.optimizer)
        self.state = jax.jit(reset, out_shardings=self.shardings, donate_argnums=0)(self.state)
        self.meta["optimizer_steps"] = 0

    def close(self) -> None:
        """Final save (unless the state was lost mid-step) and flush."""
        if not any(x.is_deleted() for x in jax.tree.leaves(self.state)):
            self.checkpointer.save(self.step, self.state, self.meta, force=True)
        self.checkpointer.close()
        self.logger.close()


def start_run(config, optimizer, schedule, *, initial_meta: dict) -> Run:
    """Builds mesh and model, then restores the latest checkpoint of ``config.workdir`` or starts fresh."""
    workdir = pathlib.Path(config.workdir)
    mesh = mesh_from_config(config)
    model_config = model_config_from(config)
    shardings = state_shardings(model_config, optimizer, mesh)
    checkpointer = Checkpointer(
        workdir / "checkpoints",
        save_every=config.checkpoint.save_every,
        keep=config.checkpoint.keep,
        async_save=config.checkpoint.async_save,
    )
    restored = checkpointer.restore(abstract_state(model_config, optimizer, shardings, config.seed))
    if restored is None:
        params = initial_params(config, model_config, mesh)
        init = functools.partial(init_train_state, optimizer=optimizer, seed=config.seed)
        state = jax.jit(init, out_shardings=shardings)(params)
        meta = {**initial_meta, "history": [], "optimizer_steps": 0}
    else:
        state, meta = restored
    is_main = jax.process_index() == 0
    if is_main:
        write_run_config(workdir, config)
    logger = MetricsLogger(
        workdir, history=meta["history"], tensorboard=config.logging.tensorboard, enabled=is_main
    )
    return Run(
        config=config,
        workdir=workdir,
        mesh=mesh,
        model_config=model_config,
        optimizer=optimizer,
        schedule=schedule,
        shardings=shardings,
        state=state,
        meta=meta,
        checkpointer=checkpointer,
        logger=logger,
        is_main=is_main,
    )


def _progress(run: Run, total: int, description: str):
    if not (run.config.logging.progress and run.is_main):
        return contextlib.nullcontext(None)
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=run.step, desc=description, dynamic_ncols=True)


def _show(bar, record: dict, keys: tuple[str, ...]) -> None:
    if bar is not None:
        bar.update(1)
        bar.set_postfix({k: f"{record[k]:.4g}" for k in keys if k in record})


def _stage_problems(config, index: int, previous: list[Problem] | None) -> tuple[list[Problem], dict]:
    """Stage ``index``'s dataset (before its filter): its own, else the previous stage's, else config.data."""
    s = config.stages[index]
    if not s.dataset and previous is not None:
        return previous, {}
    d = config.data
    loaded = load_problems(
        s.dataset or d.source,
        split=d.split,
        problem_field=d.problem_field or None,
        answer_field=d.answer_field or None,
        id_field=d.id_field or None,
        integer_answers=d.integer_answers,
        limit=d.limit,
    )
    if not loaded.problems:
        raise ValueError(
            f"stage {s.name!r}: no usable problems in {s.dataset or d.source} ({dict(loaded.skipped)})"
        )
    return loaded.problems, {f"data_skipped/{k}": v for k, v in loaded.skipped.items()}


def train_rl(
    config, *, rollout_fn: RolloutFn, reward_fn: RewardFn | None = None, max_steps: int | None = None
) -> list[dict]:
    """Runs (or resumes) the staged GRPO-RoC recipe of ``config``; returns the metrics history.

    ``rollout_fn`` produces the trajectories (see ``rstar2jax.train.rl``); ``max_steps`` stops early after
    that many steps in total (for demos and tests).
    """
    config_lib.validate_rl_config(config)
    optimizer = config_lib.build_optimizer(config)
    run = start_run(
        config,
        optimizer,
        config_lib.build_schedule(config),
        initial_meta={"stage": 0, "stage_step": 0, "position": 0, "problem_ids": None},
    )
    loss_config = config_lib.build_loss_config(config)
    step_fn = make_rl_step(
        run.model_config,
        optimizer,
        loss_config,
        num_microbatches=config.num_microbatches,
        mesh=run.mesh,
        shardings=run.shardings,
    )
    total = (
        sum(s.steps for s in config.stages)
        if max_steps is None
        else min(max_steps, sum(s.steps for s in config.stages))
    )
    dataset = None
    with _progress(run, total, "rl") as bar:
        try:
            for index in range(len(config.stages)):
                dataset, data_metrics = _stage_problems(config, index, dataset)
                if index < run.meta["stage"]:
                    continue
                s = config.stages[index]
                if run.meta["stage_step"] == 0 and s.reset_optimizer:
                    run.reset_optimizer()
                problems = _hard_problems(run, index, dataset, rollout_fn)
                iterator = ProblemIterator(
                    problems,
                    config.rl.prompts_per_step,
                    seed=config.seed + 7919 * index,
                    position=run.meta["position"],
                )
                iteration = config_lib.build_iteration_config(config, s.max_response_length)
                num_rows = None if config.batch.pack else config.rl.prompts_per_step * config.rl.keep
                while run.meta["stage_step"] < s.steps and run.step < total:
                    run.state, metrics = rl_iteration(
                        run.state,
                        next(iterator),
                        rollout_fn=rollout_fn,
                        rl_step=step_fn,
                        config=iteration,
                        max_response_length=s.max_response_length,
                        max_turns=s.max_turns,
                        reward_fn=reward_fn,
                        num_rows=num_rows,
                        batch_sharding=batch_sharding(run.mesh),
                    )
                    record = run.record(
                        {"stage": index, **data_metrics, **metrics},
                        stage_step=run.meta["stage_step"] + 1,
                        position=iterator.position,
                    )
                    _show(bar, record, ("reward", "accuracy", "response_length", "grad_norm"))
                if run.step >= total:
                    break
                run.meta.update(stage=index + 1, stage_step=0, position=0, problem_ids=None)
        finally:
            run.close()
    return run.logger.history


def _hard_problems(run: Run, index: int, problems: list[Problem], rollout_fn: RolloutFn) -> list[Problem]:
    """Stage ``index``'s problems after its hard-problem filter (kept ids live in the checkpoint meta)."""
    s = run.config.stages[index]
    if not s.hard_filter_rollouts:
        return problems
    if run.meta["problem_ids"] is None:
        kept, stats = filter_hard_problems(
            run.state.params,
            problems,
            rollout_fn=rollout_fn,
            num_rollouts=s.hard_filter_rollouts,
            batch_size=run.config.filter_batch_size,
            max_response_length=s.max_response_length,
            max_turns=s.max_turns,
            seed=run.config.seed + 104729 * (index + 1),
        )
        if not kept:
            raise ValueError(f"stage {s.name!r}: the hard-problem filter dropped every problem ({stats})")
        run.meta["problem_ids"] = [p.id for p in kept]
        print(f"stage {s.name}: hard-problem filter kept {len(kept)} of {len(problems)} problems", flush=True)
    keep = set(run.meta["problem_ids"])
    return [p for p in problems if p.id in keep]


def train_sft(config, *, max_steps: int | None = None) -> list[dict]:
    """Runs (or resumes) SFT on ``config.sft.data``; returns the metrics history."""
    config_lib.validate_sft_config(config)
    from rstar2jax.models.tokenizer import load_tokenizer  # transformers (and torch) load only when needed

    tokenizer = load_tokenizer(config.tokenizer) if config.tokenizer else None
    sequences, skipped = load_sft_sequences(config.sft.data, tokenizer)
    if not sequences:
        raise ValueError(f"config.sft.data={config.sft.data!r}: no usable examples ({skipped} skipped)")
    run_steps = config.sft.steps or config.sft.epochs * math.ceil(len(sequences) / config.sft.batch_size)
    total = run_steps if max_steps is None else min(run_steps, max_steps)
    # The schedule spans the whole run, so stopping early (max_steps) and resuming changes nothing.
    optimizer = config_lib.build_optimizer(config, total_steps=run_steps)
    schedule = config_lib.build_schedule(config, total_steps=run_steps)
    run = start_run(config, optimizer, schedule, initial_meta={"position": 0})
    step_fn = make_sft_step(
        run.model_config,
        optimizer,
        num_microbatches=config.num_microbatches,
        mesh=run.mesh,
        shardings=run.shardings,
    )
    iterator = ProblemIterator(
        sequences, config.sft.batch_size, seed=config.seed, position=run.meta["position"]
    )
    sharding = batch_sharding(run.mesh)
    with _progress(run, total, "sft") as bar:
        try:
            while run.step < total:
                start = time.perf_counter()
                batch = build_batch(
                    next(iterator), seq_len=config.sft.seq_len, row_multiple=config_lib.row_multiple(config)
                )
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
                _show(bar, record, ("loss", "grad_norm"))
        finally:
            run.close()
    return run.logger.history


# --- dry run ------------------------------------------------------------------------------------------


def _abstract_batch(rows: int, seq_len: int, sharding, *, rl: bool) -> Batch:
    def leaf(dtype):
        return jax.ShapeDtypeStruct((rows, seq_len), dtype, sharding=sharding)

    extra = dict(advantages=leaf(np.float32), old_logp=leaf(np.float32)) if rl else {}
    return Batch(
        tokens=leaf(np.int32),
        targets=leaf(np.int32),
        positions=leaf(np.int32),
        segment_ids=leaf(np.int32),
        loss_mask=leaf(np.float32),
        **extra,
    )


def dry_run(config, *, kind: str) -> dict[str, Any]:
    """Compiles the ``kind`` ("rl" | "sft") train step for the configured mesh on abstract shapes (nothing is
    allocated) and returns per-device memory of the compiled executable plus the shapes it was built for.

    RL plans for the worst case: every kept trajectory at full length on its own row.
    """
    if kind == "rl":
        config_lib.validate_rl_config(config)
        optimizer = config_lib.build_optimizer(config)
        rows = config.rl.prompts_per_step * config.rl.keep
        seq_len = config.batch.max_prompt_length + max(s.max_response_length for s in config.stages) - 1
    elif kind == "sft":
        config_lib.validate_sft_config(config, check_data=False)
        optimizer = config_lib.build_optimizer(config, total_steps=config.sft.steps or 1000)
        rows, seq_len = config.sft.batch_size, config.sft.seq_len
    else:
        raise ValueError(f"kind={kind!r}; expected 'rl' or 'sft'")
    multiple = config_lib.row_multiple(config)
    rows = -(-rows // multiple) * multiple
    mesh = mesh_from_config(config, allow_emulated=True)
    model_config = model_config_from(config)
    shardings = state_shardings(model_config, optimizer, mesh)
    state = abstract_state(model_config, optimizer, shardings, config.seed)
    batch = _abstract_batch(rows, seq_len, batch_sharding(mesh), rl=kind == "rl")
    if kind == "rl":
        step = make_rl_step(
            model_config,
            optimizer,
            config_lib.build_loss_config(config),
            num_microbatches=config.num_microbatches,
            mesh=mesh,
            shardings=shardings,
        )
    else:
        step = make_sft_step(
            model_config, optimizer, num_microbatches=config.num_microbatches, mesh=mesh, shardings=shardings
        )
    start = time.perf_counter()
    compiled = step.lower(state, batch).compile()
    memory = compiled.memory_analysis()
    fields = (
        "argument_size_in_bytes",
        "output_size_in_bytes",
        "alias_size_in_bytes",
        "temp_size_in_bytes",
        "generated_code_size_in_bytes",
    )
    report = {name: int(getattr(memory, name, 0) or 0) for name in fields}
    report["peak_estimate_bytes"] = (
        report["argument_size_in_bytes"]
        + report["output_size_in_bytes"]
        - report["alias_size_in_bytes"]
        + report["temp_size_in_bytes"]
    )
    num_params = sum(math.prod(x.shape) for x in jax.tree.leaves(state.params))
    report.update(
        devices=mesh.size,
        platform=mesh.devices.flat[0].platform,
        mesh=dict(mesh.shape),
        batch_shape=[rows, seq_len],
        microbatch_rows=rows // config.num_microbatches,
        num_params=num_params,
        compile_seconds=time.perf_counter() - start,
    )
    return report


def format_dry_run(report: dict[str, Any]) -> str:
    """A readable table of a ``dry_run`` report (sizes per device, in GiB)."""
    gib = 2.0**30
    lines = [
        f"compiled for {report['devices']} {report['platform']} devices, mesh {report['mesh']}, "
        f"{report['num_params'] / 1e6:,.1f}M parameters, batch {report['batch_shape']} "
        f"({report['microbatch_rows']} rows per micro-batch), compile {report['compile_seconds']:.1f}s",
        "per-device memory of the compiled step:",
    ]
    for key in (
        "argument_size_in_bytes",
        "output_size_in_bytes",
        "alias_size_in_bytes",
        "temp_size_in_bytes",
        "generated_code_size_in_bytes",
        "peak_estimate_bytes",
    ):
        lines.append(
            f"  {key.removesuffix('_in_bytes').removesuffix('_bytes'):<24} {report[key] / gib:10.3f} GiB"
        )
    return "\n".join(lines)


def launch_prologue(config, *, kind: str, dry_run_only: bool, print_config: bool) -> bool:
    """What both launchers do before training: print the config (``print_config``), or validate it before
    any compute, set up this process's devices, and compile-and-report (``dry_run_only``). Returns True when
    the caller should go on to train. Also lowers absl logging to WARNING unless ``--verbosity`` was given
    (orbax logs every checkpoint file at INFO) and turns SIGTERM into a normal exit, so the final checkpoint
    is written when a scheduler preempts the job."""
    from absl import flags, logging

    if print_config:
        print(config)
        return False
    if "verbosity" not in flags.FLAGS or not flags.FLAGS["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
    if kind == "rl":
        config_lib.validate_rl_config(config)
    else:
        config_lib.validate_sft_config(config, check_data=not dry_run_only)
    prepare_process(config)
    if dry_run_only:
        print(format_dry_run(dry_run(config, kind=kind)), flush=True)
        return False
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    return True


def prepare_process(config) -> None:
    """Before any device query: emulate enough CPU devices for this process's share of ``config.mesh`` (only
    the CPU backend is touched) and join the multi-host run ``config.distributed`` describes."""
    request_host_devices(-(-mesh_size(config) // config.distributed.num_processes))
    initialize_distributed(config)
