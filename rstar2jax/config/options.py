"""A run's typed, frozen options: what :func:`rstar2jax.config.parse.parse` makes of a run config, once, and
all that the loops, the run lifecycle, the rollout engine and the memory plan read (never the config itself).

Derived facts are properties, each from one formula: a stage's prompt and response budgets, the batch rows
they fill (:attr:`StageOptions.seq_len`) and the engine length its rollouts run with
(:attr:`StageOptions.engine_max_len`); the engine of the run's longest stage (``RolloutOptions.engine``) and
its KV pool (:attr:`RolloutOptions.kv_pool_tokens`); the rows a batch splits into
(:attr:`RunOptions.row_multiple`).
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
from typing import Any

from rstar2jax import models
from rstar2jax.config.algorithm import RLIterationConfig
from rstar2jax.config.binding import key
from rstar2jax.config.loss_config import RLLossConfig
from rstar2jax.data.conversation import PromptConfig
from rstar2jax.engine.config import EngineConfig, SamplingParams, page_rounded


class ConfigError(ValueError):
    """An invalid config field; the message starts with the field's full name (launchers: one line and
    exit 2)."""


@dataclasses.dataclass(frozen=True)
class OptimizerOptions:
    """``config.optimizer`` (``warmup_steps`` -1: ``warmup_fraction``, the SFT config's
    ``sft.warmup_fraction``, of the run; ``total_steps`` None: the run's own count)."""

    learning_rate: float = key("optimizer.learning_rate")
    warmup_steps: int = key("optimizer.warmup_steps")
    schedule: str = key("optimizer.schedule")
    total_steps: int | None = key("optimizer.total_steps")
    weight_decay: float = key("optimizer.weight_decay")
    b1: float = key("optimizer.b1")
    b2: float = key("optimizer.b2")
    eps: float = key("optimizer.eps")
    max_grad_norm: float | None = key("optimizer.max_grad_norm")
    warmup_fraction: float = 0.0

    def schedule_options(self, total_steps: int | None = None, updates_per_step: int = 1) -> dict[str, Any]:
        """The learning-rate schedule's options for a run of ``total_steps`` (when ``total_steps`` is not
        set): ``warmup_steps``, ``schedule``, ``total_steps``, counted in updates, ``updates_per_step`` per
        step (warm-up and total steps are given in steps)."""
        total = self.total_steps or total_steps
        warmup = self.warmup_steps if self.warmup_steps >= 0 else math.ceil(self.warmup_fraction * total)
        return dict(warmup_steps=warmup * updates_per_step, schedule=self.schedule,
                    total_steps=None if total is None else total * updates_per_step)


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where a run's initial weights come from (``config.model``): an HF folder ``path``, else random
    weights of an HF ``config_json`` or a ``preset`` (seeded by the run's ``seed``); ``adapter``: a LoRA
    run's starting PEFT folder (else new adapters, also seeded by ``seed``)."""

    path: str = ""
    config_json: str = ""
    preset: str = ""
    adapter: str = ""
    seed: int = 0

    @property
    def base_name(self) -> str:
        """What a LoRA adapter's ``base_model_name_or_path`` says: ``path`` (or ``config_json``), else
        ``preset:<name>`` for random weights of a preset, else ``""``."""
        if self.path or self.config_json:
            return str(self.path or self.config_json)
        return f"preset:{self.preset}" if self.preset else ""


@dataclasses.dataclass(frozen=True)
class PolicyOptions:
    """The trained policy's model (with its dtype / remat / scan options applied), where its weights come
    from, its LoRA adapters' shape (None: full fine-tuning), tokenizer folder ('' none) and prompt."""

    model: models.ModelConfig
    source: ModelSource
    lora: models.LoraConfig | None
    tokenizer: str
    prompt: PromptConfig


@dataclasses.dataclass(frozen=True)
class DataOptions:
    """Where RL problems come from (``config.data``); an empty column name is None (the loader's guess)."""

    source: str = key("data.source", default="")
    split: str = key("data.split", default="train")
    problem_field: str | None = key("data.problem_field", default=None)
    answer_field: str | None = key("data.answer_field", default=None)
    solution_field: str | None = key("data.solution_field", default=None)
    id_field: str | None = key("data.id_field", default=None)
    integer_only: bool = key("data.integer_only", default=False)
    limit: int | None = key("data.limit", default=None)


@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
    """``config.checkpoint``: how often to save, how many to keep, whether saves run in the background."""

    save_every: int = key("checkpoint.save_every", default=10)
    keep: int = key("checkpoint.keep", default=3)
    async_save: bool = key("checkpoint.async_save", default=True)


@dataclasses.dataclass(frozen=True)
class WandbOptions:
    """``config.logging.wandb``: the Weights & Biases run (``project`` '': none)."""

    project: str = key("logging.wandb.project", default="")
    entity: str = key("logging.wandb.entity", default="")
    name: str = key("logging.wandb.name", default="")
    tags: tuple[str, ...] = key("logging.wandb.tags", default=())

    @property
    def enabled(self) -> bool:
        return bool(self.project)


@dataclasses.dataclass(frozen=True)
class LoggingOptions:
    """``config.logging``: TensorBoard events, the progress bar / lines (every ``progress_every``), the
    Weights & Biases run, and the fraction of each RL step's groups on the rollout record (None:
    ``rollout_record.auto_fraction``)."""

    tensorboard: bool = key("logging.tensorboard", default=True)
    progress: bool = key("logging.progress", default=True)
    progress_every: int = key("logging.progress_every", default=10)
    rollout_record: float | None = key("logging.rollout_record", default=None)
    wandb: WandbOptions = WandbOptions()  # built from its own section, logging.wandb.*


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """``config.mesh``: the ``data x fsdp x tensor`` device mesh."""

    data: int = key("mesh.data", default=1)
    fsdp: int = key("mesh.fsdp", default=1)
    tensor: int = key("mesh.tensor", default=1)

    @property
    def size(self) -> int:
        return self.data * self.fsdp * self.tensor

    @property
    def data_parallel(self) -> int:
        return self.data * self.fsdp


@dataclasses.dataclass(frozen=True)
class DistributedOptions:
    """``config.distributed``: the processes of a multi-host run (one: a single process). ``num_processes``
    None (the config's ``"auto"``): the cluster scheduler's environment says (``train.cluster``; one process
    outside a scheduler's launch)."""

    coordinator_address: str = key("distributed.coordinator_address", default="")
    num_processes: int | None = key("distributed.num_processes", default=1)
    process_id: int = key("distributed.process_id", default=0)


@dataclasses.dataclass(frozen=True)
class SFTOptions:
    """``config.sft``: the data, its passes, the packed batch and the step count (None: epochs' worth)."""

    data: str = key("sft.data")
    epochs: int = key("sft.epochs", default=3)
    batch_size: int = key("sft.batch_size", default=128)
    seq_len: int = key("sft.seq_len", default=4096)
    steps: int | None = key("sft.steps", default=None)


@dataclasses.dataclass(frozen=True)
class StageOptions:
    """One RL stage (``config.stages[i]``; the field meanings are ``field_help``'s ``stages.*``) with the
    run's prompt budget (``batch.max_prompt_length``) and the engine's KV page size, which its lengths
    follow from."""

    name: str = key("name")
    steps: int = key("steps")
    max_response_length: int = key("max_response_length")
    max_turns: int = key("max_turns")
    max_prompt_length: int
    page_size: int
    dataset: str = key("dataset", default="")
    hard_filter_rollouts: int = key("hard_filter_rollouts", default=0)
    reset_optimizer: bool = key("reset_optimizer", default=False)

    @property
    def max_sequence_length(self) -> int:
        """The longest sequence of the stage: ``max_prompt_length + max_response_length`` tokens."""
        return self.max_prompt_length + self.max_response_length

    @property
    def seq_len(self) -> int:
        """Positions of a batch row that holds one longest sequence: ``max_sequence_length - 1`` (a sequence
        of n tokens takes n - 1 positions: inputs predicting the next token)."""
        return self.max_sequence_length - 1

    @property
    def engine_max_len(self) -> int:
        """The engine length the stage's rollouts run with: ``max_sequence_length`` rounded up to whole KV
        pages (what ``agent.PolicyRollout`` builds its engine with for a call of this response budget)."""
        return page_rounded(self.max_sequence_length, self.page_size)


@dataclasses.dataclass(frozen=True)
class RolloutOptions:
    """What the trainer's rollout function is built from (``config.rollout``): the engine of the run's longest
    stage (its ``max_len`` that stage's ``engine_max_len``: the largest engine the run builds), the sampling
    (whose temperature the loss divides logits by as well), the sandbox, the tool-call limits, the
    partial-rollout segment, the tools and the reward function."""

    engine: EngineConfig
    sampling: SamplingParams
    sandbox_url: str = key("rollout.sandbox_url")
    sandbox_workers: int = key("rollout.sandbox_workers")
    max_tool_calls_per_turn: int = key("rollout.max_tool_calls_per_turn")
    tool_timeout: float = key("rollout.tool_timeout")
    tool_output_chars: int = key("rollout.tool_output_chars")
    sandbox_outage_s: float = key("rollout.sandbox_outage_s")
    partial_segment_tokens: int = key("rollout.partial_segment_tokens")
    on_update: str = key("rollout.on_update", default="keep")
    tools: tuple[str, ...] = key("rollout.tools", default=("python",))
    reward_fn: str = ""  # reward.fn, checked to import by the parser ('': the answer verifier)

    @property
    def kv_pool_tokens(self) -> int:
        """Tokens the engine's KV page pool holds (the null page aside): ``rollout.kv_cache_tokens`` in whole
        pages, else every slot at the longest stage's ``engine_max_len``."""
        return (self.engine.pool_pages - 1) * self.engine.page_size


@dataclasses.dataclass(frozen=True)
class RLLoopOptions:
    """What the RL loop reads besides its stages: problems per step, the rollout schedule
    (``off_policy_steps``, ``partial_token_budget``; ``schedule="async"`` with ``max_staleness`` and the
    producer's ``placement`` / ``rollout_devices``), the non-finite streak that stops a run, the hard
    filter's batch, the fixed batch rows (None: packed rows), where optimizer moments wait during rollout, the
    iteration options of each stage (``iterations[i]``: stage i's, its ``seq_len`` the stage's), the loss and
    the rollout."""

    prompts_per_step: int = key("rl.prompts_per_step")
    off_policy_steps: int = key("rl.off_policy_steps")
    partial_token_budget: int = key("rollout.partial_token_budget")
    max_nonfinite_steps: int = key("rl.max_nonfinite_steps")
    filter_batch_size: int = key("filter_batch_size")
    num_rows: int | None
    optimizer_memory: str = key("colocate.optimizer_memory")
    max_prompt_length: int = key("batch.max_prompt_length")
    iterations: tuple[RLIterationConfig, ...]
    loss: RLLossConfig
    rollout: RolloutOptions
    device_memory_gib: float | None = key("device_memory_gib")
    schedule: str = key("rl.schedule", default="synchronous")
    max_staleness: int = key("rl.max_staleness", default=1)
    placement: str = key("rl.placement", default="colocated")
    rollout_devices: int = key("rl.rollout_devices", default=1)
    ppo_epochs: int = key("rl.ppo_epochs", default=1)
    mini_batches: int = key("rl.mini_batches", default=1)

    @property
    def updates_per_step(self) -> int:
        """Optimizer updates per RL step: ``ppo_epochs`` x ``mini_batches``."""
        return self.ppo_epochs * self.mini_batches

    @property
    def samples_per_problem(self) -> int:
        """Rollouts sampled per problem (2G), the same in every stage."""
        return self.iterations[0].samples_per_problem

    @property
    def keep(self) -> int:
        """Rollouts kept per problem by RoC (G), the same in every stage."""
        return self.iterations[0].keep


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """A run's options, made once from its config by :func:`rstar2jax.config.parse`. ``stages``, ``data`` and
    ``rl`` are an RL run's (empty / None for SFT), ``sft`` an SFT run's. ``notice``: the line the launchers
    print at start. ``record``: the config as JSON, what the run writes as ``run_config.json``."""

    workdir: pathlib.Path
    seed: int
    notice: str
    policy: PolicyOptions
    mesh: MeshShape
    distributed: DistributedOptions
    optimizer: OptimizerOptions
    checkpoint: CheckpointOptions
    logging: LoggingOptions
    num_microbatches: int
    record: str = dataclasses.field(repr=False, compare=False)
    stages: tuple[StageOptions, ...] = ()
    data: DataOptions | None = None
    rl: RLLoopOptions | None = None
    sft: SFTOptions | None = None

    @property
    def kind(self) -> str:
        """"rl" or "sft"."""
        return "rl" if self.rl is not None else "sft"

    @property
    def total_steps(self) -> int:
        """RL steps over every stage."""
        return sum(s.steps for s in self.stages)

    @property
    def longest_stage(self) -> StageOptions:
        """The RL stage with the longest response budget (the first of equals)."""
        return max(self.stages, key=lambda s: s.max_response_length)

    @property
    def row_multiple(self) -> int:
        """Batch rows must split into (RL: ``rl.mini_batches`` mini-batches of) ``num_microbatches``
        micro-batches whose rows split over the data-parallel devices: ``[mini_batches x] num_microbatches x
        mesh.data x mesh.fsdp``."""
        return (self.rl.mini_batches if self.rl else 1) * self.num_microbatches * self.mesh.data_parallel

    @property
    def model(self) -> models.ModelConfig:
        return self.policy.model

    @property
    def lora(self) -> models.LoraConfig | None:
        return self.policy.lora

    @property
    def uses_reference(self) -> bool:
        """Whether the state keeps a frozen reference policy (RL with ``loss.kl_coef`` > 0 and no LoRA: a
        LoRA run's reference is its frozen base, the adapters off)."""
        return self.rl is not None and self.rl.loss.kl_coef > 0 and self.lora is None
