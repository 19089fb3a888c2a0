"""The config edge: from a validated run config (the launchers' ``ml_collections.ConfigDict``, or a run's
``run_config.json`` read back) to the library's typed, frozen options. :func:`run_options` converts it once
into a :class:`RunOptions` (model and LoRA, mesh, optimizer, loss, iteration, rollout engine, stages, data,
checkpoints, logging); :func:`policy_options` converts the part any run config has (the policy's model,
weights, tokenizer and prompt). Everything below the public entry points reads these objects, never the
config; this module, ``config`` (defaults) and ``validation`` are the only ones that read a ConfigDict."""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
from typing import Any

from rstar2jax import models
from rstar2jax.data.conversation import PromptConfig, load_prompt_config
from rstar2jax.engine.config import EngineConfig, SamplingParams
from rstar2jax.models import peft_adapter
from rstar2jax.train.selection import RLIterationConfig
from rstar2jax.train.state import learning_rate_schedule, make_optimizer
from rstar2jax.train.steps import RLLossConfig


class ConfigError(ValueError):
    """An invalid config field; the message starts with the field's full name."""


def lora_enabled(config) -> bool:
    """Whether the run trains LoRA adapters (``config.model.lora.rank`` > 0) instead of all weights."""
    return bool(config.model.get("lora") and config.model.lora.rank)


def row_multiple(config) -> int:
    """Batch rows must split into micro-batches whose rows split over the data-parallel devices."""
    return config.num_microbatches * config.mesh.data * config.mesh.fsdp


def prompt_from_config(config) -> PromptConfig:
    """The conversation format of a run (``config.prompt``): ``paper`` None takes the one recorded in
    ``config.model.path``'s folder (an exported policy records it), else the paper's prompt; True the paper's
    (system text and the listed tool schema); False ``config.prompt``'s system prompt, user prefix and
    ``list_tools`` with the paper's Python tool and opener. SFT data and rollouts must use the same prompt.
    A run config without a ``prompt`` section (an SFT run of an older version) gives the paper's."""
    p = config.get("prompt")
    if p is None or p.paper:
        return PromptConfig()
    if p.paper is None:
        path = config.model.get("path", "")
        return (load_prompt_config(path) if path and os.path.isdir(path) else None) or PromptConfig()
    return PromptConfig(system_prompt=p.system_prompt, user_prefix=p.user_prefix, list_tools=p.list_tools)


def tokenizer_path(config) -> str:
    """The run's tokenizer folder: ``config.tokenizer``, else ``config.model.path`` when that folder holds a
    tokenizer (an exported policy does), else '' (none)."""
    if config.get("tokenizer"):
        return config.tokenizer
    path = config.model.get("path", "")
    has_tokenizer = path and any(
        os.path.exists(os.path.join(path, name)) for name in ("tokenizer.json", "tokenizer_config.json")
    )
    return path if has_tokenizer else ""


@dataclasses.dataclass(frozen=True)
class OptimizerOptions:
    """``config.optimizer`` (``warmup_steps`` -1: ``warmup_fraction``, the SFT config's
    ``sft.warmup_fraction``, of the run; ``total_steps`` None: the run's own count)."""

    learning_rate: float
    warmup_steps: int
    schedule: str
    total_steps: int | None
    weight_decay: float
    b1: float
    b2: float
    eps: float
    max_grad_norm: float | None
    warmup_fraction: float = 0.0

    def _schedule_options(self, total_steps: int | None) -> dict[str, Any]:
        total = self.total_steps or total_steps
        warmup = self.warmup_steps if self.warmup_steps >= 0 else math.ceil(self.warmup_fraction * total)
        return dict(warmup_steps=warmup, schedule=self.schedule, total_steps=total)

    def learning_rate_schedule(self, total_steps: int | None = None):
        """The learning-rate schedule (what :meth:`optimizer` applies)."""
        return learning_rate_schedule(self.learning_rate, **self._schedule_options(total_steps))

    def optimizer(self, total_steps: int | None = None):
        """The optimizer (``total_steps``: the run's step count when ``total_steps`` is not set)."""
        return make_optimizer(
            self.learning_rate,
            **self._schedule_options(total_steps),
            weight_decay=self.weight_decay,
            b1=self.b1,
            b2=self.b2,
            eps=self.eps,
            max_grad_norm=self.max_grad_norm,
        )


def _optimizer_options(config) -> OptimizerOptions:
    sft = config.get("sft")
    return OptimizerOptions(
        **_fields(OptimizerOptions, config.optimizer),
        warmup_fraction=sft.warmup_fraction if sft is not None else 0.0,
    )


def build_loss_config(config) -> RLLossConfig:
    return RLLossConfig(**config.loss.to_dict())


def build_iteration_config(config, max_response_length: int) -> RLIterationConfig:
    """The iteration options for a stage whose responses are at most ``max_response_length`` tokens."""
    loop_only = ("prompts_per_step", "off_policy_steps", "max_nonfinite_steps")  # the loop's, not the batch's
    rl = {k: v for k, v in config.rl.items() if k not in loop_only}
    return RLIterationConfig(
        **rl,
        seq_len=config.batch.max_prompt_length + max_response_length - 1,
        pack=config.batch.pack,
        row_multiple=row_multiple(config),
    )


# --- the policy's model: what any run config (or run_config.json) says about it ---------------------------


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


def _lora(config, model_config: models.ModelConfig, source: ModelSource) -> models.LoraConfig | None:
    """``config.model.lora`` as a ``LoraConfig`` checked against the model (None when LoRA is off).

    Raises ``ConfigError`` (one line, launchers exit 2) before any weight is read: a rank larger than a
    target matrix, or a ``model.lora.adapter`` folder that is not a PEFT LoRA folder, names another base,
    has another LoRA shape than the config or tensors this model has no place for."""
    if not lora_enabled(config):
        return None
    options = config.model.lora
    try:
        lora = models.LoraConfig(
            rank=options.rank,
            alpha=float(options.alpha),
            targets=tuple(options.targets),
            dropout=float(options.dropout),
            rslora=bool(options.rslora),
            dtype=options.dtype,
        )
        models.lora.check_lora(model_config, lora)
    except ValueError as error:
        raise ConfigError(f"config.model.lora: {error}") from None
    if source.adapter:
        folder = f"config.model.lora.adapter={source.adapter!r}"
        try:
            saved, _ = peft_adapter.load_peft_adapter(
                source.adapter, model_config, base_model=source.base_name
            )
        except (ValueError, FileNotFoundError) as error:
            raise ConfigError(f"{folder}: {error}") from None
        shape = ("rank", "alpha", "targets", "rslora")
        if differ := [k for k in shape if getattr(saved, k) != getattr(lora, k)]:
            raise ConfigError(
                f"{folder}: the adapter has " + ", ".join(f"{k}={getattr(saved, k)!r}" for k in differ)
                + "; set config.model.lora's fields to match to continue training it"
            )
    return lora


def policy_options(config) -> PolicyOptions:
    """The :class:`PolicyOptions` of a run config (also of a ``run_config.json`` read back)."""
    m = config.model
    lora = m.get("lora")
    source = ModelSource(
        path=m.path,
        config_json=m.config_json,
        preset=m.get("preset") or "",
        adapter=lora.adapter if lora else "",
        seed=config.seed,
    )
    model = model_config_from(config)
    return PolicyOptions(model, source, _lora(config, model, source), tokenizer_path(config),
                         prompt_from_config(config))


# --- typed run options: what the training loops read, converted once from the validated config ----------


@dataclasses.dataclass(frozen=True)
class StageOptions:
    """One RL stage (``config.stages[i]``, written with ``config.stage``; the field meanings are
    ``field_help``'s ``stages.*``)."""

    name: str
    steps: int
    max_response_length: int
    max_turns: int
    dataset: str = ""
    hard_filter_rollouts: int = 0
    reset_optimizer: bool = False


@dataclasses.dataclass(frozen=True)
class DataOptions:
    """Where RL problems come from (``config.data``); an empty column name is None (the loader's guess)."""

    source: str = ""
    split: str = "train"
    problem_field: str | None = None
    answer_field: str | None = None
    solution_field: str | None = None
    id_field: str | None = None
    integer_only: bool = False
    limit: int | None = None


@dataclasses.dataclass(frozen=True)
class CheckpointOptions:
    """``config.checkpoint``: how often to save, how many to keep, whether saves run in the background."""

    save_every: int = 10
    keep: int = 3
    async_save: bool = True


@dataclasses.dataclass(frozen=True)
class LoggingOptions:
    """``config.logging``: TensorBoard events, and the progress bar / lines (every ``progress_every``)."""

    tensorboard: bool = True
    progress: bool = True
    progress_every: int = 10


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """``config.mesh``: the ``data x fsdp x tensor`` device mesh."""

    data: int = 1
    fsdp: int = 1
    tensor: int = 1

    @property
    def size(self) -> int:
        return self.data * self.fsdp * self.tensor

    @property
    def data_parallel(self) -> int:
        return self.data * self.fsdp


@dataclasses.dataclass(frozen=True)
class DistributedOptions:
    """``config.distributed``: the processes of a multi-host run (one: a single process)."""

    coordinator_address: str = ""
    num_processes: int = 1
    process_id: int = 0


def process_layout(config) -> tuple[MeshShape, DistributedOptions]:
    """The mesh and the processes of a run (``config``: its ``RunOptions``, or a config of which only
    ``mesh`` and ``distributed`` are read: what a process needs before JAX starts)."""
    if isinstance(config, RunOptions):
        return config.mesh, config.distributed
    return (
        MeshShape(**_fields(MeshShape, config.mesh)),
        DistributedOptions(**_fields(DistributedOptions, config.distributed)),
    )


@dataclasses.dataclass(frozen=True)
class RolloutOptions:
    """What the trainer's rollout function is built from (``config.rollout``): the engine's sizes, the
    sampling, the tool-call limits, how long to wait for the sandbox, the partial-rollout segment."""

    engine: EngineConfig
    sampling: SamplingParams
    kv_cache_tokens: int = 0
    max_tool_calls_per_turn: int = 1
    tool_timeout: float = 10.0
    tool_output_chars: int = 2048
    sandbox_outage_s: float = 300.0
    partial_segment_tokens: int = 64


def _rollout_options(config) -> RolloutOptions:
    r = config.rollout
    return RolloutOptions(
        engine=EngineConfig(
            num_slots=r.engine_slots,
            seed=config.seed,
            # The page pool the memory plan counts (+1: the engine's null page); 0: enough for every slot.
            num_pages=r.kv_cache_tokens // EngineConfig.page_size + 1 if r.kv_cache_tokens else None,
        ),
        sampling=SamplingParams(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k),
        **_fields(RolloutOptions, r),
    )


@dataclasses.dataclass(frozen=True)
class RLLoopOptions:
    """What the RL loop reads besides its stages: problems per step, the rollout schedule
    (``off_policy_steps``, ``partial_token_budget``), the non-finite streak that stops a run, the hard
    filter's batch, the fixed batch rows (None: packed rows), where optimizer moments wait during rollout."""

    prompts_per_step: int
    off_policy_steps: int = 0
    partial_token_budget: int = 0
    max_nonfinite_steps: int = 3
    filter_batch_size: int = 64
    num_rows: int | None = None
    optimizer_memory: str = "auto"
    max_prompt_length: int = 1024
    iteration: RLIterationConfig | None = None
    loss: RLLossConfig | None = None
    rollout: RolloutOptions | None = None
    device_memory_gib: float | None = None

    def iteration_for(self, max_response_length: int) -> RLIterationConfig:
        """The iteration options for a stage whose responses are at most ``max_response_length`` tokens."""
        return dataclasses.replace(self.iteration, seq_len=self.max_prompt_length + max_response_length - 1)


@dataclasses.dataclass(frozen=True)
class SFTOptions:
    """``config.sft``: the data, its passes, the packed batch and the step count (None: epochs' worth)."""

    data: str
    epochs: int = 3
    batch_size: int = 128
    seq_len: int = 4096
    steps: int | None = None


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """A run's options the loops and the run lifecycle read, converted once from the validated config
    (:func:`run_options`). ``stages``, ``data`` and ``rl`` are an RL run's (empty / None for SFT), ``sft`` an
    SFT run's. ``row_multiple``: batch rows split into ``num_microbatches`` micro-batches over the
    data-parallel devices. ``record``: the config as JSON, what the run writes as ``run_config.json``."""

    workdir: pathlib.Path
    seed: int
    policy: PolicyOptions
    mesh: MeshShape
    distributed: DistributedOptions
    optimizer: OptimizerOptions
    checkpoint: CheckpointOptions
    logging: LoggingOptions
    record: str = dataclasses.field(default="{}", repr=False, compare=False)
    num_microbatches: int = 1
    row_multiple: int = 1
    stages: tuple[StageOptions, ...] = ()
    data: DataOptions | None = None
    rl: RLLoopOptions | None = None
    sft: SFTOptions | None = None

    @property
    def total_steps(self) -> int:
        """RL steps over every stage."""
        return sum(s.steps for s in self.stages)

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


def _fields(cls, node) -> dict[str, Any]:
    return {f.name: node[f.name] for f in dataclasses.fields(cls) if f.name in node}


def run_options(config) -> RunOptions:
    """The :class:`RunOptions` of a validated run config (RL when it has ``rl``); a ``RunOptions`` is
    returned as it is, so entry points that accept either convert once."""
    if isinstance(config, RunOptions):
        return config
    rl = data = None
    stages = tuple(StageOptions(**_fields(StageOptions, s)) for s in config.get("stages", ()))
    if "rl" in config:
        d = config.data
        data = DataOptions(
            **{k: v for k, v in _fields(DataOptions, d).items() if not k.endswith("_field")},
            **{k: d[k] or None for k in ("problem_field", "answer_field", "solution_field", "id_field")},
        )
        rl = RLLoopOptions(
            prompts_per_step=config.rl.prompts_per_step,
            off_policy_steps=config.rl.off_policy_steps,
            partial_token_budget=config.rollout.partial_token_budget,
            max_nonfinite_steps=config.rl.max_nonfinite_steps,
            filter_batch_size=config.filter_batch_size,
            num_rows=None if config.batch.pack else config.rl.prompts_per_step * config.rl.keep,
            optimizer_memory=config.colocate.optimizer_memory if "colocate" in config else "auto",
            max_prompt_length=config.batch.max_prompt_length,
            iteration=build_iteration_config(config, max((s.max_response_length for s in stages), default=1)),
            loss=build_loss_config(config),
            rollout=_rollout_options(config),
            device_memory_gib=config.get("device_memory_gib"),
        )
    mesh, distributed = process_layout(config)
    return RunOptions(
        workdir=pathlib.Path(config.workdir),
        seed=config.seed,
        policy=policy_options(config),
        mesh=mesh,
        distributed=distributed,
        optimizer=_optimizer_options(config),
        record=config.to_json_best_effort(indent=1),
        checkpoint=CheckpointOptions(**_fields(CheckpointOptions, config.checkpoint)),
        logging=LoggingOptions(**_fields(LoggingOptions, config.logging)),
        num_microbatches=config.num_microbatches,
        row_multiple=row_multiple(config),
        stages=stages,
        data=data,
        rl=rl,
        sft=SFTOptions(**_fields(SFTOptions, config.sft)) if "sft" in config else None,
    )
