"""Run configuration (ml_collections): the defaults, validation that names the offending field before any
compute, and builders from a validated config to the library's typed options.

A config file (see ``experiments/configs/``) starts from ``rl_config()`` or ``sft_config()`` and overrides
fields; launchers accept ``--config.a.b=value`` on top.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

import ml_collections

from rstar2jax import algo
from rstar2jax.models.config import REMAT_POLICIES, SUPPORTED_DTYPES
from rstar2jax.train.rl import RLIterationConfig
from rstar2jax.train.state import SCHEDULES, learning_rate_schedule, make_optimizer
from rstar2jax.train.steps import OLD_LOGPROB_SOURCES, RLLossConfig

placeholder = ml_collections.config_dict.placeholder


def _common() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0
    c.workdir = "runs/default"
    c.model = ml_collections.ConfigDict()
    c.model.path = ""  # HF checkpoint folder (config.json + safetensors): load_pretrained
    c.model.config_json = ""  # or an HF config.json: random init of that shape
    c.model.spec = ml_collections.ConfigDict()  # or inline ModelConfig fields: random init (tiny models)
    c.model.param_dtype = "float32"
    c.model.compute_dtype = "float32"
    c.model.remat_policy = "none"
    c.model.scan_layers = True
    c.mesh = ml_collections.ConfigDict(dict(data=1, fsdp=1, tensor=1))
    c.optimizer = ml_collections.ConfigDict(
        dict(
            learning_rate=1e-6,
            warmup_steps=20,
            schedule="constant",
            total_steps=placeholder(int),
            weight_decay=0.01,
            b1=0.9,
            b2=0.999,
            eps=1e-8,
            max_grad_norm=placeholder(float),
        )
    )
    c.optimizer.max_grad_norm = 1.0
    c.num_microbatches = 1
    c.checkpoint = ml_collections.ConfigDict(dict(save_every=10, keep=3, async_save=True))
    c.logging = ml_collections.ConfigDict(dict(tensorboard=True, progress=True))
    # Multi-host: every process gets the same config plus its own process_id (see the README).
    c.distributed = ml_collections.ConfigDict(dict(coordinator_address="", num_processes=1, process_id=0))
    return c


def rl_config() -> ml_collections.ConfigDict:
    """GRPO-RoC defaults (the paper's where it gives them); stages are added by the config file."""
    c = _common()
    c.tokenizer = ""
    c.data = ml_collections.ConfigDict(
        dict(
            source="",
            split="train",
            problem_field="",
            answer_field="",
            id_field="",
            integer_answers=True,
            limit=placeholder(int),
        )
    )
    c.loss = ml_collections.ConfigDict(
        dict(
            eps_low=0.2,
            eps_high=0.28,
            dual_clip=placeholder(float),
            agg="token_mean",
            entropy_coef=0.0,
            temperature=1.0,
            old_logprobs="sampler",
            # GSPO: "sequence" (its own clip range below); "token" is PPO/GRPO.
            importance_sampling_level="token",
            gspo_eps_low=3e-4,
            gspo_eps_high=4e-4,
            # KL to a frozen reference policy (the initial params); off in the paper.
            kl_coef=0.0,
            kl="k3",
            # Rollout correction (needs old_logprobs="recompute"): token TIS cap C, sequence mask
            # ("sequence" / "geometric" ratio) outside [1/C', C'].
            rollout_is_cap=placeholder(float),
            rollout_mask=placeholder(str),
            rollout_mask_threshold=2.0,
        )
    )
    c.loss.dual_clip = 3.0  # verl's clip_ratio_c and the released code; None turns it off
    c.rl = ml_collections.ConfigDict(
        dict(
            prompts_per_step=512,
            samples_per_problem=32,
            keep=16,
            roc_mode="paper",
            min_negatives=2,
            min_positives=2,
            reject_equal_reward=True,
            roc_eps=1e-6,
            estimator="grpo",
            std="unbiased",
            advantage_eps=1e-6,
            # "paper" (Eq. 5) or "release" (the released code's answer-format rule) for RoC's p_format.
            format_penalty="paper",
            # Truncated responses: drop them from the loss (TRL's mask_truncated_completions) and/or DAPO's
            # soft overlong penalty over the last overlong_buffer tokens of the budget (0 = off).
            mask_truncated=False,
            overlong_buffer=0,
            overlong_penalty_factor=1.0,
        )
    )
    c.batch = ml_collections.ConfigDict(dict(max_prompt_length=1024, pack=True))
    c.rollout = ml_collections.ConfigDict(
        dict(
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_tool_calls_per_turn=1,
            tool_timeout=10.0,
            tool_output_chars=2048,
            sandbox_url="",
            sandbox_workers=2,
            engine_slots=64,
        )
    )
    c.filter_batch_size = 64
    c.stages = []
    return c


def stage(
    name: str,
    *,
    steps: int,
    max_response_length: int,
    max_turns: int,
    dataset: str = "",
    hard_filter_rollouts: int = 0,
    reset_optimizer: bool = False,
) -> ml_collections.ConfigDict:
    """One RL stage. ``dataset`` empty: the previous stage's problems (the first stage: ``config.data``);
    ``hard_filter_rollouts`` k > 0: at the stage start drop problems the current policy solves k/k."""
    return ml_collections.ConfigDict(
        dict(
            name=name,
            steps=steps,
            max_response_length=max_response_length,
            max_turns=max_turns,
            dataset=dataset,
            hard_filter_rollouts=hard_filter_rollouts,
            reset_optimizer=reset_optimizer,
        )
    )


def sft_config() -> ml_collections.ConfigDict:
    """Non-reasoning SFT defaults (paper: 3 epochs, lr 5e-6, 4% warm-up, cosine, batch 128)."""
    c = _common()
    c.tokenizer = ""
    c.optimizer.learning_rate = 5e-6
    c.optimizer.schedule = "cosine"
    c.optimizer.warmup_steps = -1  # -1: warmup_fraction of the total steps
    c.sft = ml_collections.ConfigDict(
        dict(data="", epochs=3, batch_size=128, seq_len=4096, warmup_fraction=0.04, steps=placeholder(int))
    )
    return c


class ConfigError(ValueError):
    """An invalid config field; the message starts with the field's full name."""


def _field(config, path: str) -> Any:
    value = config
    for part in path.split("."):
        if part not in value:
            raise ConfigError(f"config.{path} is missing")
        value = value[part]
    return value


def _check(config, path: str, ok: Callable[[Any], bool], expectation: str) -> Any:
    value = _field(config, path)
    try:
        good = ok(value)
    except TypeError:
        good = False
    if not good:
        raise ConfigError(f"config.{path}={value!r}: {expectation}")
    return value


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _positive_int(config, path):
    return _check(config, path, lambda v: _is_int(v) and v > 0, "must be a positive integer")


def _one_of(config, path, options):
    return _check(config, path, lambda v: v in options, f"must be one of {tuple(options)}")


def _validate_common(config, *, warmup_may_be_auto: bool = False) -> None:
    _check(config, "seed", _is_int, "must be an integer")
    _check(config, "workdir", lambda v: isinstance(v, str) and v, "must be a non-empty path")
    sources = [name for name in ("path", "config_json") if _field(config, f"model.{name}")]
    sources += ["spec"] if len(_field(config, "model.spec")) else []
    if len(sources) != 1:
        raise ConfigError(
            f"config.model: set exactly one of path / config_json / spec, got {sources or 'none'}"
        )
    for name in ("path", "config_json"):
        _check(config, f"model.{name}", lambda v: not v or os.path.exists(v), "does not exist")
    for name in ("param_dtype", "compute_dtype"):
        _one_of(config, f"model.{name}", SUPPORTED_DTYPES)
    _one_of(config, "model.remat_policy", REMAT_POLICIES)
    for axis in ("data", "fsdp", "tensor"):
        _positive_int(config, f"mesh.{axis}")
    _check(config, "optimizer.learning_rate", lambda v: v > 0, "must be positive")
    low = -1 if warmup_may_be_auto else 0
    _check(
        config, "optimizer.warmup_steps", lambda v: _is_int(v) and v >= low, f"must be an integer >= {low}"
    )
    _one_of(config, "optimizer.schedule", SCHEDULES)
    _check(config, "optimizer.weight_decay", lambda v: v >= 0, "must be >= 0")
    _check(config, "optimizer.max_grad_norm", lambda v: v is None or v > 0, "must be positive or None")
    _positive_int(config, "num_microbatches")
    _positive_int(config, "checkpoint.save_every")
    _positive_int(config, "checkpoint.keep")
    _positive_int(config, "distributed.num_processes")
    _check(
        config,
        "distributed.process_id",
        lambda v: 0 <= v < config.distributed.num_processes,
        "must be in [0, distributed.num_processes)",
    )


def row_multiple(config) -> int:
    """Batch rows must split into micro-batches whose rows split over the data-parallel devices."""
    return config.num_microbatches * config.mesh.data * config.mesh.fsdp


def validate_rl_config(config) -> None:
    """Raises ``ConfigError`` naming the first invalid field; runs before any model is built."""
    _validate_common(config)
    _check(config, "tokenizer", lambda v: not v or os.path.isdir(v), "is not a tokenizer folder")
    _one_of(config, "loss.agg", algo.AGG_MODES)
    _check(config, "loss.eps_low", lambda v: 0 < v < 1, "must be in (0, 1)")
    _check(config, "loss.eps_high", lambda v: v > 0, "must be positive")
    _check(config, "loss.dual_clip", lambda v: v is None or v > 1, "must be None or > 1")
    _check(config, "loss.entropy_coef", lambda v: v >= 0, "must be >= 0")
    _check(config, "loss.temperature", lambda v: v > 0, "must be positive")
    _one_of(config, "loss.old_logprobs", OLD_LOGPROB_SOURCES)
    _one_of(config, "loss.importance_sampling_level", algo.IS_LEVELS)
    _check(config, "loss.gspo_eps_low", lambda v: 0 < v < 1, "must be in (0, 1)")
    _check(config, "loss.gspo_eps_high", lambda v: v > 0, "must be positive")
    _check(config, "loss.kl_coef", lambda v: v >= 0, "must be >= 0")
    _one_of(config, "loss.kl", algo.KL_ESTIMATORS)
    _check(config, "loss.rollout_is_cap", lambda v: v is None or v > 1, "must be None or > 1")
    _check(config, "loss.rollout_mask", lambda v: v is None or v in algo.SEQUENCE_RATIOS,
           f"must be None or one of {algo.SEQUENCE_RATIOS}")
    _check(config, "loss.rollout_mask_threshold", lambda v: v > 1, "must be > 1")
    if (config.loss.rollout_is_cap is not None or config.loss.rollout_mask is not None) and (
        config.loss.old_logprobs != "recompute"
    ):
        raise ConfigError(
            "config.loss.rollout_is_cap / loss.rollout_mask: rollout correction compares the trainer's "
            "log-probs with the sampler's; set loss.old_logprobs='recompute'"
        )
    _positive_int(config, "rl.prompts_per_step")
    samples = _check(
        config, "rl.samples_per_problem", lambda v: _is_int(v) and v >= 2, "must be an integer >= 2"
    )
    _check(
        config,
        "rl.keep",
        lambda v: _is_int(v) and 1 <= v <= samples,
        f"must be an integer in [1, rl.samples_per_problem={samples}]",
    )
    _one_of(config, "rl.roc_mode", algo.ROC_MODES)
    _one_of(config, "rl.estimator", algo.ADVANTAGE_ESTIMATORS)
    _one_of(config, "rl.std", algo.STD_MODES)
    _check(config, "rl.roc_eps", lambda v: v > 0, "must be positive")
    _one_of(config, "rl.format_penalty", algo.FORMAT_PENALTIES)
    _check(config, "rl.mask_truncated", lambda v: isinstance(v, bool), "must be True or False")
    _check(config, "rl.overlong_buffer", lambda v: _is_int(v) and v >= 0, "must be an integer >= 0")
    _check(config, "rl.overlong_penalty_factor", lambda v: v >= 0, "must be >= 0")
    _positive_int(config, "batch.max_prompt_length")
    if config.loss.agg != "token_mean" and config.batch.pack:
        raise ConfigError(
            f"config.batch.pack=True: loss.agg={config.loss.agg!r} averages per sequence and needs "
            "one trajectory per row; set batch.pack=False"
        )
    if not config.batch.pack:
        rows, multiple = config.rl.prompts_per_step * config.rl.keep, row_multiple(config)
        if rows % multiple:
            raise ConfigError(
                f"config.rl.prompts_per_step x rl.keep = {rows} rows must be a multiple of "
                f"num_microbatches x mesh.data x mesh.fsdp = {multiple} when batch.pack=False"
            )
    _check(config, "stages", lambda v: len(v) > 0, "must list at least one stage")
    for i, s in enumerate(config.stages):
        for name in ("steps", "max_response_length", "max_turns"):
            _check_stage_int(config, i, name)
        if config.rl.overlong_buffer > s.max_response_length:
            raise ConfigError(
                f"config.rl.overlong_buffer={config.rl.overlong_buffer} is longer than "
                f"stages[{i}].max_response_length={s.max_response_length}"
            )
        if s.hard_filter_rollouts < 0:
            raise ConfigError(
                f"config.stages[{i}].hard_filter_rollouts={s.hard_filter_rollouts}: must be >= 0"
            )
    if not config.data.source and not config.stages[0].dataset:
        raise ConfigError("config.data.source is empty and config.stages[0].dataset names no dataset")
    _positive_int(config, "filter_batch_size")


def _check_stage_int(config, index: int, name: str) -> None:
    value = config.stages[index][name] if name in config.stages[index] else None
    if not _is_int(value) or value <= 0:
        raise ConfigError(f"config.stages[{index}].{name}={value!r}: must be a positive integer")


def validate_sft_config(config, *, check_data: bool = True) -> None:
    """Raises ``ConfigError`` naming the first invalid field (``check_data=False``: dry runs need no data)."""
    _validate_common(config, warmup_may_be_auto=True)
    if check_data:
        _check(config, "sft.data", lambda v: isinstance(v, str) and os.path.exists(v), "does not exist")
    _check(config, "tokenizer", lambda v: not v or os.path.isdir(v), "is not a tokenizer folder")
    _positive_int(config, "sft.epochs")
    _positive_int(config, "sft.batch_size")
    _positive_int(config, "sft.seq_len")
    _check(config, "sft.warmup_fraction", lambda v: 0 <= v < 1, "must be in [0, 1)")
    _check(config, "sft.steps", lambda v: v is None or (_is_int(v) and v > 0), "must be None or positive")


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
    """Whether the run keeps a frozen reference policy in its state (RL with ``loss.kl_coef`` > 0)."""
    return "loss" in config and config.loss.kl_coef > 0


def build_iteration_config(config, max_response_length: int) -> RLIterationConfig:
    """The iteration options for a stage whose responses are at most ``max_response_length`` tokens."""
    rl = {k: v for k, v in config.rl.items() if k != "prompts_per_step"}
    return RLIterationConfig(
        **rl,
        seq_len=config.batch.max_prompt_length + max_response_length - 1,
        pack=config.batch.pack,
        row_multiple=row_multiple(config),
    )
