"""Training loops behind the launchers: the staged GRPO-RoC recipe and SFT, with exact resume.

Both loops keep everything that decides the next step in the checkpoint (state: params, optimizer, step, RNG;
meta: stage, the step it started at, the step the optimizer was last reset at, data-iterator position,
filtered problem ids, metrics history), so a run killed at any moment and restarted continues with exactly the
metrics an uninterrupted run would log. ``state.step`` is the only step counter.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import pathlib
import shutil
import sys
import threading
import time
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from rstar2jax import models
from rstar2jax.data.batch import Batch, build_batch
from rstar2jax.data.problems import Problem, ProblemIterator, load_problems
from rstar2jax.data.sft_data import assistant_openers, load_sft_sequences
from rstar2jax.train import colocate
from rstar2jax.train import config as config_lib
from rstar2jax.train import lora as lora_lib
from rstar2jax.train import memory_plan as memory_plan_lib
from rstar2jax.train.checkpoint import Checkpointer
from rstar2jax.train.faults import UPDATE_SKIPPED, NonFiniteStreak
from rstar2jax.train.metrics import METRICS_FILE, TENSORBOARD_DIR, MetricsLogger
from rstar2jax.train.rl import (
    RewardFn,
    RolloutCarry,
    RolloutFn,
    filter_hard_problems,
    put_batch,
    rl_iteration,
)
from rstar2jax.train.runtime import initialize_distributed, mesh_from_config, mesh_size, request_host_devices
from rstar2jax.train.state import TrainState, init_train_state, reset_optimizer
from rstar2jax.train.steps import (
    batch_sharding,
    make_rl_step,
    make_sft_step,
    state_shardings,
    trainable_params,
)


def model_config_from(config) -> models.ModelConfig:
    """The ``ModelConfig`` of ``config.model`` (an HF folder, an HF config.json, a named preset refined by
    ``spec`` fields, or inline fields) with its dtype / remat / scan options applied."""
    m = config.model
    options = dict(
        param_dtype=m.param_dtype,
        compute_dtype=m.compute_dtype,
        remat_policy=m.remat_policy,
        scan_layers=m.scan_layers,
        attention=m.attention,
        attention_block_size=m.attention_block_size,
        mlp_chunk_size=m.mlp_chunk_size,
    )
    if m.path or m.config_json:
        return models.config_from_hf(m.path or m.config_json, **options)
    if m.get("preset"):
        return models.preset(m.preset, **{**m.spec.to_dict(), **options})
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
            attention=model_config.attention,
            attention_block_size=model_config.attention_block_size,
            mlp_chunk_size=model_config.mlp_chunk_size,
        )
        return params
    return models.init_params(model_config, jax.random.PRNGKey(config.seed), mesh=mesh)


#: Checkpoint step folders go to ``<workdir>/CHECKPOINT_DIR``.
CHECKPOINT_DIR = "checkpoints"
#: ``experiments.sft`` exports its policy (an HF folder with the tokenizer) to ``<workdir>/POLICY_DIR``.
POLICY_DIR = "policy"


@dataclasses.dataclass(frozen=True)
class RunPaths:
    """Where a run under ``workdir`` writes: checkpoints, the metrics JSONL and TensorBoard events."""

    workdir: pathlib.Path
    checkpoints: pathlib.Path
    metrics: pathlib.Path
    tensorboard: pathlib.Path

    @property
    def policy(self) -> pathlib.Path:
        """Where the SFT launcher exports the trained policy (see ``save_policy``)."""
        return self.workdir / POLICY_DIR

    @classmethod
    def of(cls, workdir: str | pathlib.Path) -> RunPaths:
        w = pathlib.Path(workdir).resolve()
        return cls(w, w / CHECKPOINT_DIR, w / METRICS_FILE, w / TENSORBOARD_DIR)


class Interrupted(KeyboardInterrupt):
    """A stop asked for with ``request_stop`` (a launcher's Ctrl-C): the loop finished its step, saved a
    checkpoint at ``step`` in ``checkpoints`` and stopped; re-running the same config resumes there."""

    def __init__(self, step: int, checkpoints: pathlib.Path):
        super().__init__(f"stopped at step {step}; checkpoint saved in {checkpoints}")
        self.step = step
        self.checkpoints = checkpoints


_STOP = threading.Event()
_RUNNING = threading.Event()


def request_stop() -> bool:
    """Asks the running ``train_rl`` / ``train_sft`` loop to stop after its current step: it saves a
    checkpoint and raises ``Interrupted``. Returns False (and asks nothing) when no loop is running. Safe to
    call from a signal handler."""
    if not _RUNNING.is_set():
        return False
    _STOP.set()
    return True


def save_policy(
    params, model_config: models.ModelConfig, out: str | pathlib.Path, *, tokenizer=None, prompt=None
):
    """Writes ``params`` as an HF folder at ``out`` (config.json, safetensors and, when given, the tokenizer
    with its chat template and the conversation format ``prompt``, a ``PromptConfig``, as
    ``rstar2jax_prompt.json``): the form ``config.model.path`` reads, so RL can start from it. The folder is
    written beside ``out`` and renamed into place, so a crash never leaves a half policy. With several
    processes the parameters are gathered and process 0 writes. Returns ``out`` as a path."""
    out = pathlib.Path(out)
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        params = multihost_utils.process_allgather(params, tiled=True)
        if jax.process_index() != 0:
            return out
    temporary = out.with_name(out.name + ".tmp")
    shutil.rmtree(temporary, ignore_errors=True)
    models.save_pretrained(params, model_config, temporary, tokenizer=tokenizer, prompt=prompt)
    shutil.rmtree(out, ignore_errors=True)
    temporary.replace(out)
    return out


def abstract_state(model_config, optimizer, shardings: TrainState, seed: int, lora=None) -> TrainState:
    """Shapes, dtypes and shardings of the train state (with ``lora``: of the adapters'), without allocating
    it."""
    reference = shardings.ref_params is not None
    shapes = jax.eval_shape(
        lambda: init_train_state(
            trainable_params(model_config, jax.random.PRNGKey(0), lora), optimizer, seed, reference=reference
        )
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
    base: lora_lib.FrozenBase | None = None  # LoRA: the frozen base; state.params are the adapters
    _closed: bool = False

    @property
    def step(self) -> int:
        """Steps taken so far: ``state.step``, the one step counter (a step whose update was skipped for a
        non-finite gradient counts, with ``update_skipped`` in its metrics; stages and the learning-rate
        schedule record the step they started at, ``meta["stage_start"]`` and ``meta["optimizer_start"]``)."""
        return int(jax.device_get(self.state.step.addressable_data(0)))

    @property
    def lora(self) -> models.LoraConfig | None:
        return None if self.base is None else self.base.lora

    def policy_params(self):
        """The parameters the policy samples with: ``state.params``, or (LoRA) the base with the adapters
        merged in."""
        return self.state.params if self.base is None else self.base.merged(self.state.params)

    def export(self, out: str | pathlib.Path, *, tokenizer=None, prompt=None) -> pathlib.Path:
        """Writes the policy as an HF folder at ``out`` (``save_policy``, with ``tokenizer`` and the
        conversation format ``prompt``); a LoRA run also writes its adapters alone as a PEFT folder
        (``train.lora.adapter_folder(out)``)."""
        save_policy(self.policy_params(), self.model_config, out, tokenizer=tokenizer, prompt=prompt)
        if self.base is not None:
            lora_lib.save_adapter(self.state.params, self.config, self.model_config, self.lora, out)
        return pathlib.Path(out)

    @property
    def resumed(self) -> bool:
        """Whether the run continues from a checkpoint (announced by the loops)."""
        return self.step > 0

    def accept_stop_requests(self) -> None:
        """From now until ``close``, ``request_stop`` stops this run after its current step."""
        _STOP.clear()  # a stop asked for before the loop started is not this run's
        _RUNNING.set()

    def stop_if_requested(self) -> None:
        """After a step: when ``request_stop`` was called, save a checkpoint now and raise ``Interrupted``."""
        if _STOP.is_set():
            _STOP.clear()
            self.close()
            raise Interrupted(self.step, self.workdir / CHECKPOINT_DIR)

    def record(self, metrics: dict, **meta_updates) -> dict:
        """Logs one step's metrics (plus the learning rate it used), updates the resume record and saves a
        checkpoint when one is due."""
        step = self.step  # the update just applied is number ``step``; it ran at schedule position step - 1
        learning_rate = float(self.schedule(step - 1 - self.meta["optimizer_start"]))
        record = self.logger.log(step, {**metrics, "learning_rate": learning_rate})
        self.meta.update(meta_updates, history=self.logger.history)
        self.checkpointer.save(step, self.state, self.meta)
        return record

    def reset_optimizer(self) -> None:
        """Fresh optimizer moments and schedule (a stage start with ``reset_optimizer``)."""
        reset = functools.partial(reset_optimizer, optimizer=self.optimizer)
        self.state = jax.jit(reset, out_shardings=self.shardings, donate_argnums=0)(self.state)
        self.meta["optimizer_start"] = self.step

    def close(self) -> None:
        """Final save of the last finished step (unless the state was lost mid-step, or a checkpoint write
        failed: the storage is not trusted any more) and flush; closing twice is harmless."""
        if self._closed:
            return
        self._closed = True
        _RUNNING.clear()
        try:
            lost = any(x.is_deleted() for x in jax.tree.leaves(self.state))
            if not (lost or self.checkpointer.write_failed):
                self.checkpointer.save(self.step, self.state, self.meta, force=True)
        finally:
            try:
                self.checkpointer.close()
            finally:
                self.logger.close()


def _upgrade_meta(meta: dict, step: int) -> None:
    """Checkpoints written before the step counters became one kept counts of their own
    (``optimizer_steps``, ``stage_step``); now they hold the step they started at."""
    if "optimizer_steps" in meta:
        meta["optimizer_start"] = step - meta.pop("optimizer_steps")
    if "stage_step" in meta:
        meta["stage_start"] = step - meta.pop("stage_step")


def start_run(config, optimizer, schedule, *, initial_meta: dict) -> Run:
    """Builds mesh and model, then restores the latest checkpoint of ``config.workdir`` or starts fresh."""
    workdir = pathlib.Path(config.workdir)
    mesh = mesh_from_config(config)
    model_config = model_config_from(config)
    lora = lora_lib.lora_from_config(config, model_config)
    shardings = state_shardings(
        model_config, optimizer, mesh, reference=config_lib.uses_reference(config), lora=lora
    )
    checkpointer = Checkpointer(
        workdir / CHECKPOINT_DIR,
        save_every=config.checkpoint.save_every,
        keep=config.checkpoint.keep,
        async_save=config.checkpoint.async_save,
    )
    base, base_record = None, None
    if lora is not None:  # the frozen base: loaded at every start, never checkpointed
        offload = "colocate" in config and colocate.resolve_offload(config.colocate.optimizer_memory)
        base = lora_lib.FrozenBase(
            initial_params(config, model_config, mesh), model_config, lora, offload=offload
        )
        base_record = lora_lib.base_record(config, lora, base.params)
    lora_lib.check_checkpoint(checkpointer.latest_meta(), base_record, checkpointer.directory)
    restored = checkpointer.restore(abstract_state(model_config, optimizer, shardings, config.seed, lora))
    if restored is None:
        if lora is None:
            params = initial_params(config, model_config, mesh)
        else:
            params = lora_lib.initial_adapters(config, model_config, lora, mesh)
        reference = shardings.ref_params is not None
        init = functools.partial(init_train_state, optimizer=optimizer, seed=config.seed, reference=reference)
        state = jax.jit(init, out_shardings=shardings)(params)
        meta = {**initial_meta, "history": [], "optimizer_start": 0}
        if base_record is not None:
            meta[lora_lib.META_KEY] = base_record
    else:
        state, meta = restored
        lora_lib.check_checkpoint(meta, base_record, checkpointer.directory)
        _upgrade_meta(meta, int(jax.device_get(state.step.addressable_data(0))))
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
        base=base,
    )


class Progress:
    """Step progress of the main process: a tqdm bar on a terminal; elsewhere (a log file, a pipe) one short
    line every ``config.logging.progress_every`` steps and at the last step, never a bar's carriage returns.

    Lines read ``rl step 12/20 (stage 'stage1' 2/10): reward 0.5, accuracy 0.5, 3.2 s/step``. ``alerts``:
    (metric, text with one ``{}`` for its value) shown only when the metric is non-zero; a step with one
    always gets its line (``..., sandbox down 8.2 s, 30 sandbox calls retried, 3.2 s/step``).
    """

    def __init__(
        self,
        run: Run,
        total: int,
        description: str,
        keys: tuple[str, ...],
        alerts: tuple[tuple[str, str], ...] = (),
    ):
        self.total, self.description, self.keys, self.alerts = total, description, keys, alerts
        self.every = run.config.logging.progress_every
        self.enabled = bool(run.config.logging.progress and run.is_main)
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
        print(line, flush=True)


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
        solution_field=d.solution_field or None,
        id_field=d.id_field or None,
        integer_only=d.integer_only,
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

    Rollouts across an update (``config.rl.off_policy_steps`` = 1, ``config.rollout.partial_token_budget``
    > 0; see ``rstar2jax.train.rl``): what one step hands to the next (the next step's rollout, unfinished
    rollouts) is kept in the checkpoint meta (``rollout_carry``), so a resumed run goes on exactly; it does
    not cross a stage boundary (a stage's last step rolls out nothing ahead, and its unfinished rollouts
    are dropped: the next stage has its own budget and problems).
    """
    config_lib.validate(config, "rl")
    optimizer = config_lib.build_optimizer(config)
    run = start_run(
        config,
        optimizer,
        config_lib.build_schedule(config),
        initial_meta={"stage": 0, "stage_start": 0, "position": 0, "problem_ids": None},
    )
    loss_config = config_lib.build_loss_config(config)
    step_fn = make_rl_step(
        run.model_config,
        optimizer,
        loss_config,
        num_microbatches=config.num_microbatches,
        mesh=run.mesh,
        shardings=run.shardings,
        lora=run.lora,
    )
    if run.base is not None:  # LoRA: the step gets the frozen base, rollouts sample from the merged policy
        step_fn, rollout_fn = run.base.bind(step_fn), run.base.rollout(rollout_fn)
    total = (
        sum(s.steps for s in config.stages)
        if max_steps is None
        else min(max_steps, sum(s.steps for s in config.stages))
    )
    if run.resumed and run.is_main:
        stage_index = min(run.meta["stage"], len(config.stages) - 1)
        print(
            f"resuming RL from the checkpoint at step {run.step} in {run.workdir / CHECKPOINT_DIR}: stage "
            f"{run.meta['stage'] + 1}/{len(config.stages)} {config.stages[stage_index].name!r}, "
            f"step {run.step - run.meta['stage_start']} of {config.stages[stage_index].steps}",
            flush=True,
        )
    dataset = None
    offload = colocate.resolve_offload(config.colocate.optimizer_memory)
    off_policy = config.rl.off_policy_steps
    token_budget = config.rollout.partial_token_budget or None
    carries = bool(off_policy or token_budget)
    keys = ("reward", "accuracy", "response_length", "grad_norm")
    streak = NonFiniteStreak(config.rl.max_nonfinite_steps, run.meta.get("nonfinite_in_a_row", 0))
    with Progress(run, total, "rl", keys, RL_ALERTS) as progress:
        try:
            run.accept_stop_requests()
            for index in range(len(config.stages)):
                dataset, data_metrics = _stage_problems(config, index, dataset)
                if index < run.meta["stage"]:
                    continue
                s = config.stages[index]
                if run.step == run.meta["stage_start"] and s.reset_optimizer:
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
                saved = run.meta.get("rollout_carry")
                carry = RolloutCarry.decode(saved) if saved else RolloutCarry()
                while run.step - run.meta["stage_start"] < s.steps and run.step < total:
                    if offload:  # the moments wait in host memory while the engine runs
                        run.state = run.state.replace(opt_state=colocate.to_host(run.state.opt_state))
                    # A stage's last step rolls out nothing ahead (max_steps does not count: a run it
                    # stopped resumes exactly).
                    stage_last = run.step - run.meta["stage_start"] + 1 >= s.steps
                    options = {}
                    if token_budget:
                        wanted = max(config.rl.prompts_per_step - carry.open_groups, 0)
                        problems_now = iterator.take(wanted)
                        options = dict(token_budget=token_budget, num_groups=config.rl.prompts_per_step)
                    elif off_policy:
                        problems_now = [] if carry.ready is not None else next(iterator)
                        ahead = None if stage_last else next(iterator)
                        options = dict(off_policy_steps=1, next_problems=ahead)
                    else:
                        problems_now = next(iterator)
                    run.state, metrics = rl_iteration(
                        run.state,
                        problems_now,
                        rollout_fn=rollout_fn,
                        rl_step=step_fn,
                        config=iteration,
                        max_response_length=s.max_response_length,
                        max_turns=s.max_turns,
                        reward_fn=reward_fn,
                        num_rows=num_rows,
                        batch_sharding=batch_sharding(run.mesh),
                        carry=carry if carries else None,
                        **options,
                    )
                    if carries and stage_last:
                        carry = RolloutCarry()  # nothing crosses into the next stage
                    carried = {"rollout_carry": None if carry.empty else carry.encode()} if carries else {}
                    record = run.record(
                        {"stage": index, **data_metrics, **metrics},
                        position=iterator.position,
                        nonfinite_in_a_row=streak.observe(metrics),
                        **carried,
                    )
                    stage_step = run.step - run.meta["stage_start"]
                    progress.update(record, f"stage {s.name!r} {stage_step}/{s.steps}")
                    streak.check(run.step, run.workdir / CHECKPOINT_DIR)
                    run.stop_if_requested()
                if run.step >= total:
                    break
                run.meta.update(stage=index + 1, stage_start=run.step, position=0, problem_ids=None)
                run.meta.pop("rollout_carry", None)
        finally:
            run.close()
    return run.logger.history


#: What the RL progress line adds when it happened (see ``Progress``).
RL_ALERTS = (
    ("rollout/sandbox_outage_s", "sandbox down {:.1f} s"),
    ("rollout/sandbox_retried_calls", "{:g} sandbox calls retried"),
    ("rollout/sandbox_restarts", "sandbox restarts {:g}"),
    ("rollout/trajectories_dropped_for_sandbox_failures", "{:g} trajectories dropped for sandbox failures"),
    (UPDATE_SKIPPED, "update skipped (non-finite loss or gradient)"),
)


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


def train_sft(
    config, *, max_steps: int | None = None, export_dir: str | pathlib.Path | None = None
) -> list[dict]:
    """Runs (or resumes) SFT on ``config.sft.data``; returns the metrics history.

    ``export_dir``: when the run ends (not when it is interrupted), the policy is written there as an HF
    folder with the tokenizer (``save_policy``), what ``experiments.train_rl --config.model.path=`` starts
    from, and the conversation format: ``config.prompt`` with the assistant opener of the data's chat rows
    (when they share one).
    """
    config_lib.validate(config, "sft")
    from rstar2jax.data.tokenizer import load_tokenizer  # transformers (and torch) load only when needed

    tokenizer_dir = config_lib.tokenizer_path(config)
    tokenizer = load_tokenizer(tokenizer_dir) if tokenizer_dir else None
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
        lora=run.lora,
    )
    if run.base is not None:
        step_fn = run.base.bind(step_fn)
    iterator = ProblemIterator(
        sequences, config.sft.batch_size, seed=config.seed, position=run.meta["position"]
    )
    if run.resumed and run.is_main:
        print(
            f"resuming SFT from the checkpoint at step {run.step} of {total} in "
            f"{run.workdir / CHECKPOINT_DIR} (epoch {iterator.position / len(sequences):.2f})",
            flush=True,
        )
    sharding = batch_sharding(run.mesh)
    with Progress(run, total, "sft", ("loss", "grad_norm")) as progress:
        try:
            run.accept_stop_requests()
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
                progress.update(record, f"epoch {record['epoch']:.2f}")
                run.stop_if_requested()
        finally:
            run.close()
    if export_dir is not None:
        prompt = config_lib.prompt_from_config(config)
        openers = assistant_openers(config.sft.data)
        if len(openers) == 1:  # the opener the policy was taught to continue from is its data's
            prompt = dataclasses.replace(prompt, assistant_opener=openers.pop())
        run.export(export_dir, tokenizer=tokenizer, prompt=prompt)
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


def dry_run(config, *, kind: str, cpu_stand_in: bool = True) -> dict[str, Any]:
    """Compiles the ``kind`` ("rl" | "sft") train step for the configured mesh on abstract shapes (nothing is
    allocated) and returns per-device memory of the compiled executable plus the shapes it was built for.

    RL plans for the worst case: every kept trajectory at full length on its own row. CPU devices stand in
    for accelerators (``cpu_stand_in``): see ``_stand_in_options``.
    """
    config_lib.validate(config, kind, check_data=False)
    if kind == "rl":
        optimizer = config_lib.build_optimizer(config)
        rows = config.rl.prompts_per_step * config.rl.keep
        seq_len = config.batch.max_prompt_length + max(s.max_response_length for s in config.stages) - 1
    else:
        optimizer = config_lib.build_optimizer(config, total_steps=config.sft.steps or 1000)
        rows, seq_len = config.sft.batch_size, config.sft.seq_len
    multiple = config_lib.row_multiple(config)
    rows = -(-rows // multiple) * multiple
    mesh = mesh_from_config(config, allow_emulated=True)
    model_config = model_config_from(config)
    lora = lora_lib.lora_from_config(config, model_config)
    shardings = state_shardings(
        model_config, optimizer, mesh, reference=config_lib.uses_reference(config), lora=lora
    )
    state = abstract_state(model_config, optimizer, shardings, config.seed, lora)
    batch = _abstract_batch(rows, seq_len, batch_sharding(mesh), rl=kind == "rl")
    # LoRA: the frozen base is the step's third argument.
    base = () if lora is None else (abstract_base_params(model_config, mesh),)
    options = dict(num_microbatches=config.num_microbatches, mesh=mesh, shardings=shardings, lora=lora,
                   compiler_options=_stand_in_options(model_config, mesh) if cpu_stand_in else None)
    if kind == "rl":
        step = make_rl_step(model_config, optimizer, config_lib.build_loss_config(config), **options)
    else:
        step = make_sft_step(model_config, optimizer, **options)
    start = time.perf_counter()
    compiled = step.lower(state, batch, *base).compile()
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
    frozen_params = sum(math.prod(x.shape) for x in jax.tree.leaves(base))
    report.update(
        devices=mesh.size,
        platform=mesh.devices.flat[0].platform,
        mesh=dict(mesh.shape),
        batch_shape=[rows, seq_len],
        microbatch_rows=rows // config.num_microbatches,
        num_params=num_params,
        frozen_params=frozen_params,
        lora=None if lora is None else lora_lib.describe(lora),
        compile_seconds=time.perf_counter() - start,
        attention=models.attention.resolve_implementation(model_config.attention),
        remat_policy=model_config.remat_policy,
        logprobs="vocabulary chunks (models.sequence_logprobs)",
    )
    if kind == "rl":
        report["memory_plan"] = memory_plan_lib.memory_plan(config, model_config, state, report, *base)
    return report


def _stand_in_options(model_config, mesh: Mesh) -> dict | None:
    """XLA options of a dry run on CPU devices standing in for accelerators. XLA:CPU has no bfloat16 / float16
    matmul: it computes them in float32 and hoists the upcast of the layer-stacked weights out of the layer
    loop, an extra float32 copy of every weight that no accelerator makes (55 GiB for Qwen3-14B in bfloat16).
    With weights stored in 16 bits, the CPU compiles the plan without that hoisting, so it counts what the
    accelerator holds; float32 weights compile as they are."""
    if mesh.devices.flat[0].platform != "cpu" or model_config.param_dtype == "float32":
        return None
    return {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}


def abstract_base_params(model_config, mesh: Mesh):
    """Shapes, dtypes and shardings of the model's parameters (a LoRA run's frozen base), unallocated."""
    shapes = jax.eval_shape(lambda: models.init_params(model_config, jax.random.PRNGKey(0)))
    return jax.tree.map(
        lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
        shapes,
        models.param_shardings(model_config, mesh),
    )


def format_dry_run(report: dict[str, Any]) -> str:
    """A readable table of a ``dry_run`` report (sizes per device, in GiB)."""
    gib = 2.0**30
    trained = f"{report['num_params'] / 1e6:,.1f}M parameters"
    if report.get("lora"):
        trained = (f"{report['num_params'] / 1e6:,.1f}M LoRA parameters (rank {report['lora']['rank']}) on "
                   f"{report['frozen_params'] / 1e6:,.1f}M frozen")
    lines = [
        f"compiled for {report['devices']} {report['platform']} devices, mesh {report['mesh']}, "
        f"{trained}, batch {report['batch_shape']} "
        f"({report['microbatch_rows']} rows per micro-batch), compile {report['compile_seconds']:.1f}s",
        f"attention {report['attention']}, remat {report['remat_policy']}, log-probs by {report['logprobs']}",
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
    if "memory_plan" in report:
        lines.append(memory_plan_lib.format_plan(report["memory_plan"]))
    return "\n".join(lines)


def check_memory_plan(config, *, kind: str, report: dict[str, Any] | None = None) -> None:
    """RL runs: write the per-device memory plan (``memory_plan.json`` in the work folder) and raise
    ``MemoryPlanError`` with its table when it exceeds a known device memory. Without a dry-run ``report`` (a
    real run) the plan is compiled only when the device memory is known (an accelerator, or
    ``config.device_memory_gib``): fail at start-up rather than out of memory mid-run. The extra compile of
    the step is served by XLA's compilation cache when the run compiles the same step."""
    if kind != "rl":
        return
    if report is None:
        if memory_plan_lib.device_memory_gib(config) is None:
            return
        report = dry_run(config, kind=kind)
    path = memory_plan_lib.write_plan(report["memory_plan"], config.workdir)
    print(f"memory plan: {path}", flush=True)
    memory_plan_lib.check_plan(report["memory_plan"])


def prepare_process(config) -> None:
    """Before any device query: emulate enough CPU devices for this process's share of ``config.mesh`` (only
    the CPU backend is touched) and join the multi-host run ``config.distributed`` describes."""
    request_host_devices(-(-mesh_size(config) // config.distributed.num_processes))
    initialize_distributed(config)
