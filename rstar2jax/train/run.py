"""A training run's lifecycle: where it writes (``RunPaths``), its mesh, model and restored-or-fresh state
(``start_run`` -> ``Run``), its per-run stop request (``StopSignal``), its checkpoints and records, and the
policy export.

Both loops (``rl_loop.train_rl``, ``sft_loop.train_sft``) keep everything that decides the next step in the
checkpoint (state: params, optimizer, step, RNG; its JSON record, the typed ``host_state.HostState``: stage,
the step it started at, the step the optimizer was last reset at, data-iterator position, filtered problem
ids, the rollout schedule's state, metrics history), so a run killed at any
moment and restarted continues with exactly the metrics an uninterrupted run would log. ``state.step`` is the
only step counter.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import threading

import jax
import optax
from jax.sharding import Mesh

from rstar2jax import models
from rstar2jax.config.config import write_run_config
from rstar2jax.config.options import RunOptions
from rstar2jax.policy import adapters as adapters_lib
from rstar2jax.policy.weights import CHECKPOINT_DIR, initial_params, save_policy
from rstar2jax.schedules import colocate
from rstar2jax.train import lora as lora_lib
from rstar2jax.train.checkpoint import Checkpointer
from rstar2jax.train.host_state import HostState
from rstar2jax.train.metrics import METRICS_FILE, TENSORBOARD_DIR, MetricsLogger
from rstar2jax.train.runtime import mesh_from_config
from rstar2jax.train.state import TrainState, init_train_state, reset_optimizer
from rstar2jax.train.steps import state_shardings, trainable_params
from rstar2jax.train.wandb_run import WandbRun

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
    """A stop asked for with ``StopSignal.request`` (a launcher's Ctrl-C): the loop finished its step, saved a
    checkpoint at ``step`` in ``checkpoints`` and stopped; re-running the same config resumes there."""

    def __init__(self, step: int, checkpoints: pathlib.Path):
        super().__init__(f"stopped at step {step}; checkpoint saved in {checkpoints}")
        self.step = step
        self.checkpoints = checkpoints


class StopSignal:
    """A request to stop one training run after its current step (a launcher's Ctrl-C or SIGTERM).

    Each run owns one (``train_rl(..., stop=)`` / ``train_sft(..., stop=)``; a fresh one when none is
    given), so nothing a stopped run leaves behind reaches the next run in the same process. ``request`` is
    safe to call from a signal handler: it only sets an event.
    """

    def __init__(self):
        self._requested = threading.Event()
        self._accepting = threading.Event()

    def request(self) -> bool:
        """Asks the run to stop after its current step; False (and nothing asked) when no loop is running
        with this signal."""
        if not self._accepting.is_set():
            return False
        self._requested.set()
        return True

    @property
    def requested(self) -> bool:
        return self._requested.is_set()

    def accept(self) -> None:
        """From now until ``release``, ``request`` stops the run (a request made before is not this run's)."""
        self._requested.clear()
        self._accepting.set()

    def release(self) -> None:
        """The loop ended: later requests are refused and a pending one is dropped."""
        self._accepting.clear()
        self._requested.clear()


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


@dataclasses.dataclass
class Run:
    """What a training loop needs: mesh, model, optimizer, the (restored or fresh) state and its records;
    ``options``: the typed options the loops read."""

    options: RunOptions
    workdir: pathlib.Path
    mesh: Mesh
    model_config: models.ModelConfig
    optimizer: optax.GradientTransformation
    schedule: optax.Schedule
    shardings: TrainState
    state: TrainState
    host: HostState
    checkpointer: Checkpointer
    logger: MetricsLogger
    is_main: bool
    base: lora_lib.FrozenBase | None = None  # LoRA: the frozen base; state.params are the adapters
    stop: StopSignal = dataclasses.field(default_factory=StopSignal)
    _closed: bool = False

    @property
    def step(self) -> int:
        """Steps taken so far: ``state.step``, the one step counter (a step whose update was skipped for a
        non-finite gradient counts, with ``update_skipped`` in its metrics; stages and the learning-rate
        schedule record the step they started at, ``host.stage_start`` and ``host.optimizer_start``)."""
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
        (``policy.adapters.adapter_folder(out)``)."""
        save_policy(self.policy_params(), self.model_config, out, tokenizer=tokenizer, prompt=prompt)
        if self.base is not None:
            source = self.options.policy.source
            adapters_lib.save_adapter(self.state.params, source, self.model_config, self.lora, out)
        return pathlib.Path(out)

    @property
    def resumed(self) -> bool:
        """Whether the run continues from a checkpoint (announced by the loops)."""
        return self.step > 0

    def accept_stop_requests(self) -> None:
        """From now until ``close``, ``self.stop.request()`` stops this run after its current step."""
        self.stop.accept()

    def stop_if_requested(self) -> None:
        """After a step: when a stop was requested, save a checkpoint now and raise ``Interrupted``."""
        if self.stop.requested:
            self.close()
            raise Interrupted(self.step, self.workdir / CHECKPOINT_DIR)

    def record(self, metrics: dict, **host_updates) -> dict:
        """Logs one step's metrics (plus the learning rate it used), updates the host state (``HostState``
        fields) and saves a checkpoint when one is due."""
        step = self.step  # the update just applied is number ``step``; it ran at schedule position step - 1
        learning_rate = float(self.schedule(step - 1 - self.host.optimizer_start))
        record = self.logger.log(step, {**metrics, "learning_rate": learning_rate})
        self.host = self.host.replace(**host_updates, history=tuple(self.logger.history))
        self.checkpointer.save(step, self.state, self.host.to_meta())
        return record

    def reset_optimizer(self) -> None:
        """Fresh optimizer moments and schedule (a stage start with ``reset_optimizer``)."""
        reset = functools.partial(reset_optimizer, optimizer=self.optimizer)
        self.state = jax.jit(reset, out_shardings=self.shardings, donate_argnums=0)(self.state)
        self.host = self.host.replace(optimizer_start=self.step)

    def close(self) -> None:
        """Final save of the last finished step (unless the state was lost mid-step, or a checkpoint write
        failed: the storage is not trusted any more) and flush; closing twice is harmless."""
        if self._closed:
            return
        self._closed = True
        self.stop.release()
        try:
            lost = any(x.is_deleted() for x in jax.tree.leaves(self.state))
            if not (lost or self.checkpointer.write_failed):
                self.checkpointer.save(self.step, self.state, self.host.to_meta(), force=True)
        finally:
            try:
                self.checkpointer.close()
            finally:
                self.logger.close()


def start_run(
    options: RunOptions,
    optimizer,
    schedule,
    *,
    initial_host: HostState | None = None,
    stop: StopSignal | None = None,
) -> Run:
    """Builds mesh and model, then restores the latest checkpoint of ``options.workdir`` or starts fresh (with
    ``initial_host``); ``stop`` (default: a new one) is the signal that stops this run."""
    workdir, policy, lora = options.workdir, options.policy, options.lora
    mesh = mesh_from_config(options)
    model_config = policy.model
    shardings = state_shardings(model_config, optimizer, mesh, reference=options.uses_reference, lora=lora)
    checkpointer = Checkpointer(
        workdir / CHECKPOINT_DIR,
        save_every=options.checkpoint.save_every,
        keep=options.checkpoint.keep,
        async_save=options.checkpoint.async_save,
    )
    base, base_record = None, None
    if lora is not None:  # the frozen base: loaded at every start, never checkpointed
        offload = options.rl is not None and colocate.resolve_offload(options.rl.optimizer_memory)
        base = lora_lib.FrozenBase(
            initial_params(policy.source, model_config, mesh), model_config, lora, offload=offload
        )
        base_record = adapters_lib.base_record(policy.source, lora, base.params)
    adapters_lib.check_checkpoint(checkpointer.latest_meta(), base_record, checkpointer.directory)
    restored = checkpointer.restore(abstract_state(model_config, optimizer, shardings, options.seed, lora))
    if restored is None:
        if lora is None:
            params = initial_params(policy.source, model_config, mesh)
        else:
            params = lora_lib.initial_adapters(policy, mesh)
        reference = shardings.ref_params is not None
        init = functools.partial(
            init_train_state, optimizer=optimizer, seed=options.seed, reference=reference
        )
        state = jax.jit(init, out_shardings=shardings)(params)
        host = (initial_host or HostState()).replace(lora_base=base_record)
    else:
        state, meta = restored
        adapters_lib.check_checkpoint(meta, base_record, checkpointer.directory)
        host = HostState.from_meta(meta, int(jax.device_get(state.step.addressable_data(0))))
    is_main = jax.process_index() == 0
    if is_main:
        write_run_config(workdir, options.record)
    wandb = WandbRun(options, workdir) if is_main and options.logging.wandb.enabled else None
    logger = MetricsLogger(
        workdir, history=host.history, tensorboard=options.logging.tensorboard, enabled=is_main,
        wandb=wandb,
    )
    return Run(
        options=options,
        workdir=workdir,
        mesh=mesh,
        model_config=model_config,
        optimizer=optimizer,
        schedule=schedule,
        shardings=shardings,
        state=state,
        host=host,
        checkpointer=checkpointer,
        logger=logger,
        is_main=is_main,
        base=base,
        stop=stop or StopSignal(),
    )

