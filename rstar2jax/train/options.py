"""From a validated run config (the launchers' ``ml_collections.ConfigDict``) to the library's typed options:
the optimizer and its schedule, the loss and iteration options, the conversation format, the tokenizer, and
the frozen :class:`RunOptions` the training loops read (stages, data, checkpoints, logging, the RL loop)."""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
from typing import Any

from rstar2jax.data.conversation import PromptConfig, load_prompt_config
from rstar2jax.train.selection import RLIterationConfig
from rstar2jax.train.state import learning_rate_schedule, make_optimizer
from rstar2jax.train.steps import RLLossConfig


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
    if config.tokenizer:
        return config.tokenizer
    path = config.model.get("path", "")
    has_tokenizer = path and any(
        os.path.exists(os.path.join(path, name)) for name in ("tokenizer.json", "tokenizer_config.json")
    )
    return path if has_tokenizer else ""


def _schedule_options(config, total_steps: int | None) -> dict[str, Any]:
    o = config.optimizer
    total = o.total_steps or total_steps
    warmup = o.warmup_steps if o.warmup_steps >= 0 else math.ceil(config.sft.warmup_fraction * total)
    return dict(warmup_steps=warmup, schedule=o.schedule, total_steps=total)


def build_schedule(config, total_steps: int | None = None):
    """The learning-rate schedule of ``config.optimizer`` (what ``build_optimizer`` applies)."""
    return learning_rate_schedule(config.optimizer.learning_rate, **_schedule_options(config, total_steps))


def build_optimizer(config, total_steps: int | None = None):
    """The optimizer of ``config.optimizer`` (``warmup_steps=-1``: ``sft.warmup_fraction`` of the run)."""
    o = config.optimizer
    return make_optimizer(
        o.learning_rate,
        **_schedule_options(config, total_steps),
        weight_decay=o.weight_decay,
        b1=o.b1,
        b2=o.b2,
        eps=o.eps,
        max_grad_norm=o.max_grad_norm,
    )


def build_loss_config(config) -> RLLossConfig:
    return RLLossConfig(**config.loss.to_dict())


def uses_reference(config) -> bool:
    """Whether the run keeps a frozen reference policy in its state (RL with ``loss.kl_coef`` > 0 and no
    LoRA: a LoRA run's reference is its frozen base, the adapters off)."""
    return "loss" in config and config.loss.kl_coef > 0 and not lora_enabled(config)


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
    data-parallel devices."""

    workdir: pathlib.Path
    seed: int
    checkpoint: CheckpointOptions
    logging: LoggingOptions
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


def _fields(cls, node) -> dict[str, Any]:
    return {f.name: node[f.name] for f in dataclasses.fields(cls) if f.name in node}


def run_options(config) -> RunOptions:
    """The :class:`RunOptions` of a validated run config (RL when it has ``stages``)."""
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
        )
    return RunOptions(
        workdir=pathlib.Path(config.workdir),
        seed=config.seed,
        checkpoint=CheckpointOptions(**_fields(CheckpointOptions, config.checkpoint)),
        logging=LoggingOptions(**_fields(LoggingOptions, config.logging)),
        num_microbatches=config.num_microbatches,
        row_multiple=row_multiple(config),
        stages=stages,
        data=data,
        rl=rl,
        sft=SFTOptions(**_fields(SFTOptions, config.sft)) if "sft" in config else None,
    )
