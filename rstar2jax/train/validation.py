"""Run-config validation: every field checked before any compute, the first bad one named in one line
(``ConfigError``: the field's full name, its value, what is allowed)."""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from typing import Any

from rstar2jax import algo
from rstar2jax.data.problems import looks_local
from rstar2jax.models.config import (
    ATTENTION_ALIASES,
    ATTENTION_IMPLEMENTATIONS,
    REMAT_POLICIES,
    SUPPORTED_DTYPES,
)
from rstar2jax.models.lora import LORA_TARGETS
from rstar2jax.models.presets import PRESETS
from rstar2jax.train.colocate import OFFLOAD_OPTIONS
from rstar2jax.train.options import ConfigError, lora_enabled, prompt_from_config, row_multiple
from rstar2jax.train.state import SCHEDULES
from rstar2jax.train.steps import OLD_LOGPROB_SOURCES


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


def _validate_common(config, *, warmup_may_be_auto: bool = False, check_paths: bool = True) -> None:
    _check(config, "seed", _is_int, "must be an integer")
    _check(config, "workdir", lambda v: isinstance(v, str) and v, "must be a non-empty path")
    # model.path wins over the others: a command line cannot clear a config's inline spec, and
    # --config.model.path=<an exported policy> must start the run from that policy.
    if not _field(config, "model.path"):
        sources = [name for name in ("config_json", "preset") if _field(config, f"model.{name}")]
        if len(_field(config, "model.spec")) and sources != ["preset"]:  # spec fields override a preset's
            sources += ["spec"]
        if len(sources) != 1:
            raise ConfigError(
                f"config.model: set exactly one of config_json / preset / spec (spec may refine a preset; "
                f"model.path wins over all of them), got {sources or 'none'}"
            )
    _check(config, "model.preset", lambda v: not v or v in PRESETS, f"must be one of {PRESETS}")
    for name in ("path", "config_json") if check_paths else ():
        _check(config, f"model.{name}", lambda v: not v or os.path.exists(v), "does not exist")
    if check_paths:
        _check(config, "tokenizer", lambda v: not v or os.path.isdir(v), "is not a tokenizer folder")
    if "prompt" in config:
        _check(config, "prompt.paper", lambda v: v in (None, True, False), "must be None, True or False")
        if check_paths:
            try:
                prompt_from_config(config)
            except ValueError as error:  # the format file of model.path does not parse
                raise ConfigError(f"config.model.path={config.model.path!r}: {error}") from None
    for name in ("param_dtype", "compute_dtype"):
        _one_of(config, f"model.{name}", SUPPORTED_DTYPES)
    _one_of(config, "model.remat_policy", REMAT_POLICIES)
    _one_of(config, "model.attention", (*ATTENTION_IMPLEMENTATIONS, *ATTENTION_ALIASES))
    _check(
        config, "model.attention_block_size", lambda v: v > 0 and v % 8 == 0, "must be a multiple of 8 (> 0)"
    )
    _check(config, "model.mlp_chunk_size", lambda v: v >= 0, "must be >= 0")
    _validate_lora(config, check_paths=check_paths)
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
    _positive_int(config, "logging.progress_every")
    _positive_int(config, "distributed.num_processes")
    _check(
        config,
        "distributed.process_id",
        lambda v: 0 <= v < config.distributed.num_processes,
        "must be in [0, distributed.num_processes)",
    )


def _validate_lora(config, *, check_paths: bool) -> None:
    """``config.model.lora``'s own values (checks against the model's shapes: ``train.lora``)."""
    if "lora" not in config.model:  # a config written before LoRA existed
        return
    rank = _check(
        config, "model.lora.rank", lambda v: _is_int(v) and v >= 0, "must be an integer >= 0 (0: off)"
    )
    if not rank:
        return
    targets = _check(config, "model.lora.targets", lambda v: isinstance(v, list | tuple) and len(v) > 0,
                     f"must list projections (any of {LORA_TARGETS})")
    for target in targets:
        if target not in LORA_TARGETS:
            raise ConfigError(f"config.model.lora.targets: {target!r} is not a projection of the model; "
                              f"expected any of {LORA_TARGETS}")
    _check(config, "model.lora.alpha", lambda v: v > 0, "must be positive")
    _check(config, "model.lora.dropout", lambda v: 0 <= v < 1, "must be in [0, 1)")
    _one_of(config, "model.lora.dtype", SUPPORTED_DTYPES)
    if check_paths:
        _check(config, "model.lora.adapter", lambda v: not v or os.path.isdir(v), "is not a folder")


def validate_rl_config(config, *, check_data: bool = True, check_paths: bool = True) -> None:
    """Raises ``ConfigError`` naming the first invalid field; runs before any model is built
    (``check_data=False``: dry runs need no problem set; ``check_paths=False``: no file need exist yet)."""
    _validate_common(config, check_paths=check_paths)
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
    if lora_enabled(config) and config.model.lora.dropout:
        raise ConfigError(
            f"config.model.lora.dropout={config.model.lora.dropout}: must be 0 in RL (a random policy makes "
            "the importance ratio pi / pi_old noise); dropout is for SFT"
        )
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
    if check_data and check_paths:  # a local problem file that is not there fails now, not at its stage
        missing = "does not exist (a local path; hub dataset names are 'name' or 'org/name')"
        _check(config, "data.source", lambda v: not v or os.path.exists(v) or not looks_local(v), missing)
        for i, s in enumerate(config.stages):
            if s.dataset and not os.path.exists(s.dataset) and looks_local(s.dataset):
                raise ConfigError(f"config.stages[{i}].dataset={s.dataset!r}: {missing}")
    _positive_int(config, "filter_batch_size")
    _positive_int(config, "rl.max_nonfinite_steps")
    _check(
        config,
        "rollout.sandbox_outage_s",
        lambda v: not isinstance(v, bool) and v > 0 and math.isfinite(v),
        "must be a positive number of seconds",
    )
    _check(config, "rollout.kv_cache_tokens", lambda v: _is_int(v) and v >= 0, "must be an integer >= 0")
    _check_rollouts_across_updates(config)
    _one_of(config, "colocate.optimizer_memory", OFFLOAD_OPTIONS)
    _check(config, "device_memory_gib", lambda v: v is None or v > 0, "must be positive or None")


def _check_rollouts_across_updates(config) -> None:
    """One-step off-policy and partial rollouts: valid values, not both, and the rollout correction on."""
    off = _one_of(config, "rl.off_policy_steps", (0, 1))
    budget = _check(
        config, "rollout.partial_token_budget", lambda v: _is_int(v) and v >= 0, "must be an integer >= 0"
    )
    _positive_int(config, "rollout.partial_segment_tokens")
    if off and budget:
        raise ConfigError(
            "config.rl.off_policy_steps=1 and config.rollout.partial_token_budget > 0 do not combine: "
            "pick one way for rollouts to cross a policy update"
        )
    if not (off or budget):
        return
    option = "config.rl.off_policy_steps=1" if off else "config.rollout.partial_token_budget > 0"
    if config.loss.old_logprobs != "recompute" or (
        config.loss.rollout_is_cap is None and config.loss.rollout_mask is None
    ):
        raise ConfigError(
            f"{option} trains on tokens an older policy sampled: it needs the rollout correction, "
            "loss.old_logprobs='recompute' with loss.rollout_is_cap and/or loss.rollout_mask set"
        )
    if budget and config.distributed.num_processes > 1:
        raise ConfigError(f"{option}: partial rollouts run in one process (distributed.num_processes=1)")


def _check_stage_int(config, index: int, name: str) -> None:
    value = config.stages[index][name] if name in config.stages[index] else None
    if not _is_int(value) or value <= 0:
        raise ConfigError(f"config.stages[{index}].{name}={value!r}: must be a positive integer")


def validate_sft_config(config, *, check_data: bool = True, check_paths: bool = True) -> None:
    """Raises ``ConfigError`` naming the first invalid field (``check_data=False``: dry runs need no data;
    ``check_paths=False``: neither data nor the model and tokenizer folders need to exist yet)."""
    _validate_common(config, warmup_may_be_auto=True, check_paths=check_paths)
    if check_data and check_paths:
        _check(config, "sft.data", lambda v: isinstance(v, str) and os.path.exists(v), "does not exist")
    _positive_int(config, "sft.epochs")
    _positive_int(config, "sft.batch_size")
    _positive_int(config, "sft.seq_len")
    _check(config, "sft.warmup_fraction", lambda v: 0 <= v < 1, "must be in [0, 1)")
    _check(config, "sft.steps", lambda v: v is None or (_is_int(v) and v > 0), "must be None or positive")


#: Configs ``validate`` accepted, by content, with how much of them was checked: a run's config is checked
#: once, however many entry points (launcher, ``train_rl`` / ``train_sft``, ``dry_run``) it passes through.
_ACCEPTED: dict[tuple[str, str], tuple[bool, bool]] = {}
KINDS = ("rl", "sft")

def validate(config, kind: str, *, check_data: bool = True, check_paths: bool = True) -> None:
    """The one config check of a run: raises ``ConfigError`` naming the first invalid field, its value and
    what is allowed, before any compute. ``kind`` is "rl" or "sft"; ``check_data=False`` (dry runs) skips
    the existence of SFT data, ``check_paths=False`` also that of the model and tokenizer folders (a recipe
    checking a later phase's config before an earlier phase writes them). A config whose content passed an
    equal or stricter check before is not checked again, so launchers and the library entry points they
    call share one check."""
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}; expected one of {KINDS}")
    key = (kind, config.to_json_best_effort(sort_keys=True))
    wanted = (check_paths, check_data and check_paths)
    done = _ACCEPTED.get(key)
    if done is not None and all(d >= w for d, w in zip(done, wanted, strict=True)):
        return
    if kind == "rl":
        validate_rl_config(config, check_data=check_data, check_paths=check_paths)
    else:
        validate_sft_config(config, check_data=check_data, check_paths=check_paths)
    if len(_ACCEPTED) > 64:
        _ACCEPTED.clear()
    _ACCEPTED[key] = tuple(max(d, w) for d, w in zip(done or (False, False), wanted, strict=True))

